# What a CUDA torch's own CMake config (TorchConfig -> Caffe2Config) needs to find, on a
# machine where nvcc is a wrapper script and the toolkit lacks NVRTC (the torch wheel's NVIDIA
# packages have it), and the architectures to build for. Call after check_language(CUDA) has
# found a compiler and before find_package(Torch). A value the user gives wins.
#
#   tempo_torch_cuda_hints(<dir holding TorchConfig.cmake>)
macro(tempo_torch_cuda_hints torch_dir)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES ${TEMPO_CUDA_ARCHS})
  endif()
  enable_language(CUDA)  # gives CMAKE_CUDA_COMPILER_TOOLKIT_ROOT, nvcc's real toolkit
  if(NOT CUDA_TOOLKIT_ROOT_DIR)
    set(CUDA_TOOLKIT_ROOT_DIR "${CMAKE_CUDA_COMPILER_TOOLKIT_ROOT}" CACHE PATH "the CUDA toolkit torch's config uses")
  endif()
  if(NOT CUDA_nvrtc_LIBRARY)
    get_filename_component(_tempo_site "${torch_dir}/../../../.." ABSOLUTE)  # site-packages
    file(GLOB _tempo_nvrtc "${CUDA_TOOLKIT_ROOT_DIR}/lib64/libnvrtc.so" "${CUDA_TOOLKIT_ROOT_DIR}/lib64/libnvrtc.so.*"
         "${_tempo_site}/nvidia/cu*/lib/libnvrtc.so.[0-9]*" "${_tempo_site}/nvidia/cuda_nvrtc/lib/libnvrtc.so.[0-9]*")
    list(FILTER _tempo_nvrtc EXCLUDE REGEX "builtins|alt")
    if(_tempo_nvrtc)
      list(GET _tempo_nvrtc 0 _tempo_nvrtc)
      set(CUDA_nvrtc_LIBRARY "${_tempo_nvrtc}" CACHE FILEPATH "NVRTC, for torch's config")
    endif()
  endif()
  # torch builds for every architecture it knows unless told: ours only.
  if(NOT TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(TORCH_CUDA_ARCH_LIST "")
    foreach(_tempo_arch ${CMAKE_CUDA_ARCHITECTURES})
      string(REGEX REPLACE "-(real|virtual)$" "" _tempo_arch "${_tempo_arch}")
      string(REGEX REPLACE "([0-9]+)([0-9])[a-z]?$" "\\1.\\2" _tempo_arch "${_tempo_arch}")
      list(APPEND TORCH_CUDA_ARCH_LIST "${_tempo_arch}")
    endforeach()
  endif()
endmacro()
