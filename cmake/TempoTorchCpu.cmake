# LibTorch's CPU libraries from a CUDA build of torch, for a machine without nvcc.
#
# A CUDA torch's own CMake config (TorchConfig -> Caffe2Config) stops with a fatal error when
# the CUDA toolkit is missing, although its CPU libraries work without it. Without nvcc tempo
# builds only CPU kernels anyway, so it links torch's CPU libraries directly: an imported
# target named `torch`, like the one TorchConfig makes, and TORCH_CXX_FLAGS with torch's C++
# ABI read from that config when it names one. Used by CMakeLists.txt and by the installed TempoConfig.cmake.
#
#   tempo_torch_cpu_target(<dir holding TorchConfig.cmake>)
function(tempo_torch_cpu_target torch_dir)
  get_filename_component(root "${torch_dir}/../../.." ABSOLUTE)
  foreach(lib torch torch_cpu c10)
    find_library(TEMPO_TORCH_LIB_${lib} NAMES ${lib} PATHS "${root}/lib" NO_DEFAULT_PATH REQUIRED)
  endforeach()
  # Older torch configs name their C++ ABI; newer ones (2.7+) only build the C++11 ABI, the
  # compiler's default, and say nothing.
  file(STRINGS "${torch_dir}/TorchConfig.cmake" abi REGEX "_GLIBCXX_USE_CXX11_ABI=[01]")
  set(flags "")
  if(abi MATCHES "_GLIBCXX_USE_CXX11_ABI=([01])")
    set(flags "_GLIBCXX_USE_CXX11_ABI=${CMAKE_MATCH_1}")
    set(TORCH_CXX_FLAGS "-D${flags}" PARENT_SCOPE)
  endif()
  if(NOT TARGET torch)
    add_library(torch INTERFACE IMPORTED GLOBAL)
    set_target_properties(torch PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${root}/include;${root}/include/torch/csrc/api/include"
      INTERFACE_COMPILE_DEFINITIONS "${flags}"
      INTERFACE_LINK_LIBRARIES "${TEMPO_TORCH_LIB_torch};${TEMPO_TORCH_LIB_torch_cpu};${TEMPO_TORCH_LIB_c10}")
  endif()
  set(TORCH_LIBRARIES torch PARENT_SCOPE)
  set(TORCH_CUDA_LIBRARIES "" PARENT_SCOPE)
  set(Torch_FOUND TRUE PARENT_SCOPE)
endfunction()
