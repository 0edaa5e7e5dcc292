# The C++ test suites: core, emulated CUDA kernels, torch ops, modules and models, examples (included by CMakeLists.txt; paths are relative to the source root).

# ---- tests -------------------------------------------------------------------------------------
if(TEMPO_BUILD_TESTS)
  enable_testing()
  find_package(GTest REQUIRED)
  include(GoogleTest)
  # every tests/cpp/core/test_<unit>.cpp (test_registry.py holds each core unit to one)
  file(GLOB TEMPO_CORE_TEST_SOURCES CONFIGURE_DEPENDS tests/cpp/core/test_*.cpp)
  add_executable(tempo_core_tests ${TEMPO_CORE_TEST_SOURCES})
  target_link_libraries(tempo_core_tests PRIVATE tempo_core GTest::gtest_main)
  # The core's tests may read its internal math (csrc/core/math) as "math/...".
  target_include_directories(tempo_core_tests PRIVATE csrc/core)
  target_compile_options(tempo_core_tests PRIVATE $<$<BOOL:${TEMPO_NATIVE}>:-march=native>)
  gtest_discover_tests(tempo_core_tests DISCOVERY_TIMEOUT 60)
  find_package(Python REQUIRED COMPONENTS Interpreter)
  # The core's CUDA kernels run on the host (tests/simt: threads as fibers, barriers and warp
  # shuffles emulated) against its CPU kernels, so they are tested on machines without a GPU.
  # translate.py rewrites each .cu's launches; the emulated build lives in namespace tempo_simt.
  set(TEMPO_SIMT_SOURCES)
  file(MAKE_DIRECTORY ${CMAKE_BINARY_DIR}/simt)
  foreach(k ${TEMPO_CORE_OPS})
    add_custom_command(OUTPUT ${CMAKE_BINARY_DIR}/simt/${k}.cpp
                       COMMAND ${Python_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/tests/simt/translate.py
                               ${CMAKE_CURRENT_SOURCE_DIR}/csrc/core/cuda/${k}.cu ${CMAKE_BINARY_DIR}/simt/${k}.cpp
                       DEPENDS csrc/core/cuda/${k}.cu tests/simt/translate.py VERBATIM)
    list(APPEND TEMPO_SIMT_SOURCES ${CMAKE_BINARY_DIR}/simt/${k}.cpp)
  endforeach()
  # (objects, not an archive: each translated source registers its entry points as it initialises,
  # and no symbol of it is referenced by name)
  add_library(tempo_simt OBJECT ${TEMPO_SIMT_SOURCES} tests/simt/api.cpp ${TEMPO_CORE_COMMON_SOURCES})
  target_include_directories(tempo_simt BEFORE PRIVATE tests/simt csrc/core/cuda csrc/core/include)
  target_compile_definitions(tempo_simt PRIVATE tempo=tempo_simt TEMPO_WITH_CUDA=1 TEMPO_VERSION="simt"
                             __CUDACC__ __CUDA_ARCH__=900
                             $<TARGET_PROPERTY:tempo_core,INTERFACE_COMPILE_DEFINITIONS>)
  # The stand-in header comes first in every source, as nvcc includes cuda_runtime.h; no
  # contraction of a * b + c: the kernels' own fmaf calls are the only fused operations.
  target_compile_options(tempo_simt PRIVATE -include ${CMAKE_CURRENT_SOURCE_DIR}/tests/simt/cuda_runtime.h
                         -ffp-contract=off -fno-math-errno -Wno-unknown-pragmas)
  add_executable(tempo_simt_tests tests/simt/test_simt.cpp)
  target_link_libraries(tempo_simt_tests PRIVATE tempo_core tempo_simt GTest::gtest_main)
  target_include_directories(tempo_simt_tests PRIVATE csrc/core tests/simt)
  # Each test under three thread schedules (tests/simt/cuda_runtime.h): a barrier missing between
  # a phase that reads shared memory and one that writes it shows under the warp-first ones.
  foreach(schedule round-robin warp-first warp-last)
    gtest_discover_tests(tempo_simt_tests TEST_PREFIX "${schedule}." TEST_LIST simt_${schedule}
                         PROPERTIES ENVIRONMENT SIMT_SCHEDULE=${schedule} DISCOVERY_TIMEOUT 60)
  endforeach()
  # The C++ runtime guard (cmake/TempoCxxRuntime.cmake) against a compiler that links
  # libstdc++'s code into shared libraries; CI's compiler links the shared one, so without this
  # the guard's remedy would never run here.
  if(TEMPO_BUILD_TORCH AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_SYSTEM_NAME STREQUAL "Linux")
    add_test(NAME cxx_runtime_guard
             COMMAND ${CMAKE_COMMAND} -DSRC=${CMAKE_CURRENT_SOURCE_DIR}/tests/cxx_runtime
                     -DBIN=${CMAKE_BINARY_DIR}/cxx_runtime_check -DGENERATOR=${CMAKE_GENERATOR}
                     -DCXX=${CMAKE_CXX_COMPILER} -DNM=${CMAKE_NM} -DTORCH_LIB_DIR=${Torch_DIR}/../../../lib
                     -P ${CMAKE_CURRENT_SOURCE_DIR}/tests/cxx_runtime/check.cmake)
  endif()
  add_test(NAME check_layers COMMAND ${Python_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/tests/check_layers.py
                                     ${CMAKE_CURRENT_SOURCE_DIR}/csrc)
  if(TEMPO_BUILD_TORCH)
    add_executable(tempo_torch_tests tests/cpp/torch/test_activation.cpp tests/cpp/torch/test_adamw.cpp
                                   tests/cpp/torch/test_attention.cpp
                                   tests/cpp/torch/test_models.cpp tests/cpp/torch/test_norm_dropout.cpp
                                   tests/cpp/torch/test_second_derivatives.cpp tests/cpp/torch/test_slim.cpp
                                   tests/cpp/torch/test_train.cpp)
    target_link_libraries(tempo_torch_tests PRIVATE tempo_train GTest::gtest_main)
    gtest_discover_tests(tempo_torch_tests DISCOVERY_TIMEOUT 120)
    # The C++ side of tests/python/cli/test_pretrained.py (comparisons with transformers).
    add_executable(pretrained_tool tests/cpp/torch/pretrained_tool.cpp)
    target_link_libraries(pretrained_tool PRIVATE tempo_models)
    tempo_reuse_pch(tempo_torch_tests pretrained_tool)
    # A separate project that finds this build with find_package(Tempo), builds and runs.
    add_test(NAME example_find_package
             COMMAND ${CMAKE_COMMAND} -DSRC=${CMAKE_CURRENT_SOURCE_DIR}/examples/cpp
                     -DBIN=${CMAKE_BINARY_DIR}/example -DTEMPO_DIR=${CMAKE_BINARY_DIR}
                     -DTORCH_DIR=${Torch_DIR} -DGENERATOR=${CMAKE_GENERATOR}
                     -P ${CMAKE_CURRENT_SOURCE_DIR}/cmake/run_example.cmake)
    # The same against an install prefix moved elsewhere after installing (relocatable package).
    add_test(NAME example_installed_and_moved
             COMMAND ${CMAKE_COMMAND} -DSRC=${CMAKE_CURRENT_SOURCE_DIR}/examples/cpp
                     -DBIN=${CMAKE_BINARY_DIR}/example-installed -DINSTALL_FROM=${CMAKE_BINARY_DIR}
                     -DTORCH_DIR=${Torch_DIR} -DGENERATOR=${CMAKE_GENERATOR}
                     -P ${CMAKE_CURRENT_SOURCE_DIR}/cmake/run_example.cmake)
  endif()
endif()
