# The layers above the core: the op library, modules, models, trainer, CLI and benchmarks (included by CMakeLists.txt; paths are relative to the source root).

# ---- the layers above the core: ops -> nn -> models -> tools ---------------------------------
# One target per layer, each linking only the layer below, each seeing only its own headers
# and those of the layers below (tests/check_layers.py also rejects relative includes that
# leave a layer). tempo_torch is the op library Python loads.
if(TEMPO_BUILD_TORCH)
  add_library(tempo_torch SHARED
    csrc/torch/library.cpp
    csrc/torch/ops/common.cpp
    csrc/torch/autograd/common.cpp
    ${TEMPO_TORCH_OP_SOURCES}
    csrc/torch/autocast.cpp
    csrc/torch/memory/host.cpp
    csrc/torch/memory/plan.cpp
    csrc/torch/memory/tracker.cpp
    csrc/torch/memory/traffic.cpp)
  target_include_directories(tempo_torch PUBLIC
    $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/csrc/torch/include>
    $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/csrc/core/include>
    $<INSTALL_INTERFACE:include>)
  # LibTorch through its imported target (no absolute paths into one installation in the
  # exported package: find_dependency(Torch) finds the user's).
  target_link_libraries(tempo_torch PUBLIC torch PRIVATE tempo_core)
  # With the CUDA kernels, dropout's seed under CUDA graph capture comes from torch's CUDA
  # generator (ops/common.cpp), which needs ATen's CUDA headers and library.
  target_compile_definitions(tempo_torch PRIVATE TEMPO_TORCH_CUDA=$<BOOL:${TEMPO_WITH_CUDA}>)
  # torch 2.14's headers need C++20 (its config names CXX_STANDARD 20 on a target property
  # that does not propagate); every layer above the core, and its users, compile with it.
  target_compile_features(tempo_torch PUBLIC cxx_std_20)
  # LibTorch's headers, precompiled: parsing them took 11 s of a 14 s layer file on 2 cores
  # (2026-12-07), in each of ~120 files. GCC refuses a PCH used without a macro it was made with
  # (a shared library's <name>_EXPORTS, the core's -fopenmp) or under other code-model flags
  # (-fPIE): tempo_torch, which compiles with the core's flags, makes its own; every target above
  # it reuses one made in a target of its own (an empty source, torch's flags alone), and the
  # executables compile with -fPIC like the libraries. TEMPO_PCH=OFF compiles without, as an
  # installed user's build does (the headers stand alone: tests/check_layers.py, the examples).
  option(TEMPO_PCH "Precompile LibTorch's headers for the layers above the core" ON)
  set(TEMPO_PCH_HEADERS <ATen/ATen.h> <torch/library.h> <torch/csrc/autograd/custom_function.h>
                        <torch/nn/cloneable.h> <torch/nn/pimpl.h> <torch/nn/modules/linear.h>)
  if(TEMPO_PCH)
    target_precompile_headers(tempo_torch PRIVATE ${TEMPO_PCH_HEADERS})
    file(WRITE ${CMAKE_BINARY_DIR}/tempo_pch.cpp "// the precompiled LibTorch headers' host (cmake/TempoLayers.cmake)\n")
    add_library(tempo_pch OBJECT ${CMAKE_BINARY_DIR}/tempo_pch.cpp)
    target_link_libraries(tempo_pch PRIVATE torch)
    target_compile_features(tempo_pch PRIVATE cxx_std_20)
    target_precompile_headers(tempo_pch PRIVATE ${TEMPO_PCH_HEADERS})
  endif()
  function(tempo_reuse_pch)
    if(TEMPO_PCH)
      foreach(t ${ARGN})
        target_precompile_headers(${t} REUSE_FROM tempo_pch)
        get_target_property(_type ${t} TYPE)
        if(_type STREQUAL "EXECUTABLE")
          set_target_properties(${t} PROPERTIES POSITION_INDEPENDENT_CODE OFF)
          target_compile_options(${t} PRIVATE -fPIC)
        endif()
      endforeach()
    endif()
  endfunction()

  add_library(tempo_nn SHARED csrc/nn/checkpoint.cpp ${TEMPO_NN_OP_SOURCES})
  target_include_directories(tempo_nn PUBLIC
    $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/csrc/nn/include> $<INSTALL_INTERFACE:include>)
  target_link_libraries(tempo_nn PUBLIC tempo_torch)

  add_library(tempo_models SHARED
    csrc/models/config.cpp
    csrc/models/file_write.cpp
    csrc/models/hf_files.cpp
    csrc/models/performer.cpp
    csrc/models/pretrained.cpp
    csrc/models/slim.cpp
    csrc/models/transformer.cpp)
  target_include_directories(tempo_models PUBLIC
    $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/csrc/models/include> $<INSTALL_INTERFACE:include>)
  target_link_libraries(tempo_models PUBLIC tempo_nn)
  # Hugging Face checkpoints (config.json, safetensors headers) are parsed with nlohmann-json
  # (Debian: nlohmann-json3-dev; header-only, private). Without it the library still builds and
  # load_pretrained/save_pretrained raise an error that says so.
  find_package(nlohmann_json 3.10 QUIET)
  if(nlohmann_json_FOUND)
    target_link_libraries(tempo_models PRIVATE nlohmann_json::nlohmann_json)
    target_compile_definitions(tempo_models PRIVATE TEMPO_WITH_JSON=1)
  else()
    message(WARNING "nlohmann-json not found: tempo::models::load_pretrained will raise (apt-get install nlohmann-json3-dev)")
  endif()

  # The trainer: tokenizer (SentencePiece, Debian's libsentencepiece-dev), data, checkpoints.
  # Without SentencePiece's C++ library (the GPU image has only its Python package) the trainer
  # still builds and trains on pretokenized ids; making a tokenizer raises.
  find_package(PkgConfig)
  if(PKG_CONFIG_FOUND)
    pkg_check_modules(SENTENCEPIECE IMPORTED_TARGET sentencepiece)
  endif()
  add_library(tempo_train SHARED
    csrc/train/adamw.cpp
    csrc/train/checkpoint.cpp
    csrc/train/data.cpp
    csrc/train/manifest.cpp
    csrc/train/distributed.cpp
    csrc/train/tokenizer.cpp
    csrc/train/trainer.cpp)
  # The optimizer's loop rounds alike in its vectorised body and scalar tail (see adamw.cpp).
  set_source_files_properties(csrc/train/adamw.cpp PROPERTIES COMPILE_OPTIONS "-ffp-contract=off")
  target_include_directories(tempo_train PUBLIC
    $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/csrc/train/include> $<INSTALL_INTERFACE:include>)
  target_link_libraries(tempo_train PUBLIC tempo_models)
  if(SENTENCEPIECE_FOUND)
    target_link_libraries(tempo_train PRIVATE PkgConfig::SENTENCEPIECE)
    target_compile_definitions(tempo_train PRIVATE TEMPO_WITH_SENTENCEPIECE=1)
  else()
    message(WARNING "SentencePiece's C++ library not found: tempo train can only use pretokenized ids "
                    "(apt-get install libsentencepiece-dev pkg-config)")
  endif()
  # Data parallelism on c10d's ProcessGroupGloo: torch links Gloo in but ships no Gloo headers;
  # Debian's libgloo-dev provides them. Without them `tempo train --nproc` raises.
  find_path(GLOO_INCLUDE_DIR gloo/algorithm.h)
  if(GLOO_INCLUDE_DIR)
    target_include_directories(tempo_train PRIVATE ${GLOO_INCLUDE_DIR})
    target_compile_definitions(tempo_train PRIVATE TEMPO_WITH_GLOO=1 USE_C10D_GLOO USE_DISTRIBUTED)
  else()
    message(WARNING "Gloo headers not found: tempo train --nproc will raise (apt-get install libgloo-dev)")
  endif()
  # On CUDA, c10d's ProcessGroupNCCL (in libtorch_cuda; its header needs nccl.h, which the torch
  # wheel's NVIDIA package ships). `tempo train --device cuda --nproc N` uses it.
  if(TORCH_CUDA_LIBRARIES AND NOT TEMPO_TORCH_CPU_ONLY)
    get_filename_component(_tempo_site "${Torch_DIR}/../../../.." ABSOLUTE)
    find_path(NCCL_INCLUDE_DIR nccl.h PATHS "${_tempo_site}/nvidia/nccl/include" ${CUDAToolkit_INCLUDE_DIRS})
    # The c10d header pulls in ATen's CUDA context, which wants the CUDA math libraries' headers
    # (cusparse.h, cublas_v2.h): the toolkit's, or else the torch wheel's NVIDIA package's.
    file(GLOB _tempo_wheel_cuda_include "${_tempo_site}/nvidia/cu*/include")
    find_path(CUSPARSE_INCLUDE_DIR cusparse.h PATHS ${CUDAToolkit_INCLUDE_DIRS} ${_tempo_wheel_cuda_include})
    if(NCCL_INCLUDE_DIR AND CUSPARSE_INCLUDE_DIR)
      target_include_directories(tempo_train SYSTEM AFTER PRIVATE ${NCCL_INCLUDE_DIR} ${CUSPARSE_INCLUDE_DIR})
      target_compile_definitions(tempo_train PRIVATE TEMPO_WITH_NCCL=1 USE_C10D_NCCL)
    else()
      message(WARNING "nccl.h or cusparse.h not found: tempo train --device cuda --nproc will raise")
    endif()
  endif()

  # Installed, each layer finds the one below beside itself (relocatable: $ORIGIN).
  set_target_properties(tempo_torch tempo_nn tempo_models tempo_train PROPERTIES INSTALL_RPATH "$ORIGIN")

  add_executable(tempo csrc/tools/main.cpp csrc/tools/args.cpp csrc/tools/bench.cpp csrc/tools/report.cpp
                       csrc/tools/slim.cpp csrc/tools/train.cpp csrc/tools/data_movement.cpp)
  target_link_libraries(tempo PRIVATE tempo_train)
  target_compile_definitions(tempo PRIVATE TEMPO_TORCH_CPU_ONLY=$<BOOL:${TEMPO_TORCH_CPU_ONLY}>)

  add_executable(bench_activation benchmarks/activation_speed.cpp)
  target_link_libraries(bench_activation PRIVATE tempo_torch)
  add_executable(bench_norm benchmarks/norm_speed.cpp)
  target_link_libraries(bench_norm PRIVATE tempo_torch)
  add_executable(bench_attention benchmarks/attention_speed.cpp)
  target_link_libraries(bench_attention PRIVATE tempo_nn)
  add_executable(bench_layer benchmarks/layer_speed.cpp)
  target_link_libraries(bench_layer PRIVATE tempo_models)
  add_executable(bench_optimizer benchmarks/optimizer_speed.cpp)
  target_link_libraries(bench_optimizer PRIVATE tempo_train)
  tempo_reuse_pch(tempo_nn tempo_models tempo_train tempo bench_activation bench_norm bench_attention bench_layer
                  bench_optimizer)
endif()
