# Installation: the Python wheel's op library and the CMake package find_package(Tempo) (included by CMakeLists.txt; paths are relative to the source root).

# ---- Python wheel (pip install .): the op library inside the package ----------------------
if(SKBUILD AND TEMPO_BUILD_TORCH)
  install(TARGETS tempo_torch LIBRARY DESTINATION tempo/lib COMPONENT python)
endif()

# ---- CMake package: find_package(Tempo) ------------------------------------------------------
if(TEMPO_BUILD_TORCH)
  include(CMakePackageConfigHelpers)
  install(TARGETS tempo_train tempo_models tempo_nn tempo_torch tempo_core EXPORT TempoTargets
          LIBRARY DESTINATION lib ARCHIVE DESTINATION lib RUNTIME DESTINATION bin)
  install(DIRECTORY csrc/core/include/ csrc/torch/include/ csrc/nn/include/ csrc/models/include/ csrc/train/include/
          DESTINATION include)
  install(FILES ${CMAKE_BINARY_DIR}/include/tempo/ops.h DESTINATION include/tempo)  # generated (TempoLayers.cmake)
  install(EXPORT TempoTargets NAMESPACE Tempo:: DESTINATION lib/cmake/Tempo)
  export(EXPORT TempoTargets NAMESPACE Tempo:: FILE ${CMAKE_BINARY_DIR}/TempoTargets.cmake)
  configure_file(cmake/TempoTorchCpu.cmake ${CMAKE_BINARY_DIR}/TempoTorchCpu.cmake COPYONLY)
  configure_package_config_file(cmake/TempoConfig.cmake.in ${CMAKE_BINARY_DIR}/TempoConfig.cmake
                                INSTALL_DESTINATION lib/cmake/Tempo)
  write_basic_package_version_file(${CMAKE_BINARY_DIR}/TempoConfigVersion.cmake COMPATIBILITY SameMinorVersion)
  install(FILES ${CMAKE_BINARY_DIR}/TempoConfig.cmake ${CMAKE_BINARY_DIR}/TempoConfigVersion.cmake
                cmake/TempoTorchCpu.cmake DESTINATION lib/cmake/Tempo)
endif()
