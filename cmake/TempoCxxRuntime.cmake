# One C++ runtime in the process: the shared libstdc++ that torch itself loads.
#
# A compiler driver that links libstdc++'s code statically into shared libraries (the GPU
# image's /opt/gcc g++ did; so do -static-libstdc++ and the "nonshared" archives of
# devtoolset-style toolchains) puts a second copy of the runtime into our libraries beside
# torch's. The two disagree on the locale facets: formatting a number into an error message
# then crashes (an H200, 2026-12-04: tempo.gelu with a bias of the wrong shape, a segfault in
# std::ostream::_M_insert<long> inside libtempo_torch.so) or silently cuts the message short
# (here, with -static-libstdc++).
#
# tempo_cxx_runtime(TORCH_LIB_DIR) links a tiny shared library that formats a long, as our
# libraries do. Where it holds its own std::ostream::_M_insert<long> (an explicit instantiation
# that lives in the shared libstdc++ and nowhere else when the runtime is shared), every target
# from here on links the libstdc++.so.6 that torch's libc10.so resolves to, ahead of the
# driver's copy (whose members are then not pulled in); the probe is linked again that way to
# check, and the configure step says what it did or stops with the reason.
function(_tempo_probe_cxx_runtime dir extra out)
  separate_arguments(flags UNIX_COMMAND "${CMAKE_CXX_FLAGS} ${CMAKE_SHARED_LINKER_FLAGS}")
  execute_process(COMMAND ${CMAKE_CXX_COMPILER} ${flags} -shared -fPIC probe.cpp ${extra} -o libprobe.so
                  WORKING_DIRECTORY ${dir} RESULT_VARIABLE rc OUTPUT_VARIABLE log ERROR_VARIABLE log)
  if(NOT rc EQUAL 0)
    set(${out} "unknown: the probe did not link: ${log}" PARENT_SCOPE)
    return()
  endif()
  execute_process(COMMAND ${CMAKE_NM} ${dir}/libprobe.so OUTPUT_VARIABLE symbols RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    set(${out} "unknown: ${CMAKE_NM} could not read the probe" PARENT_SCOPE)
  elseif(symbols MATCHES " [TtWw] _ZNSo9_M_insertIlEERSoT_(\n|$)")
    set(${out} "static" PARENT_SCOPE)
  else()
    set(${out} "shared" PARENT_SCOPE)
  endif()
endfunction()

function(tempo_cxx_runtime torch_lib_dir)
  if(NOT CMAKE_SYSTEM_NAME STREQUAL "Linux" OR NOT CMAKE_CXX_COMPILER_ID STREQUAL "GNU" OR NOT CMAKE_NM)
    return()
  endif()
  set(dir ${CMAKE_BINARY_DIR}/cxx_runtime_probe)
  file(WRITE ${dir}/probe.cpp "#include <sstream>\n#include <string>\n"
             "int tempo_probe(long x) { std::ostringstream s; s << x; return static_cast<int>(s.str().size()); }\n")
  _tempo_probe_cxx_runtime(${dir} "" how)
  if(how MATCHES "^unknown")
    message(WARNING "tempo: could not check how ${CMAKE_CXX_COMPILER} links the C++ runtime (${how})")
    return()
  elseif(how STREQUAL "shared")
    return()
  endif()
  # Static: the runtime torch's libc10.so loads.
  set(runtime "")
  find_program(TEMPO_LDD NAMES ldd)
  if(TEMPO_LDD AND EXISTS ${torch_lib_dir}/libc10.so)
    execute_process(COMMAND ${TEMPO_LDD} ${torch_lib_dir}/libc10.so OUTPUT_VARIABLE deps)
    if(deps MATCHES "libstdc\\+\\+\\.so\\.6 => ([^ \n]+)")
      set(runtime ${CMAKE_MATCH_1})
    endif()
  endif()
  if(NOT runtime)
    # (a cache variable of its own: a normal variable of find_file's name would shadow the result)
    find_file(TEMPO_LIBSTDCXX_SO NAMES libstdc++.so.6 PATHS ${torch_lib_dir} /lib/x86_64-linux-gnu
              /usr/lib/x86_64-linux-gnu /lib/aarch64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /lib64
              NO_DEFAULT_PATH)
    if(TEMPO_LIBSTDCXX_SO)
      set(runtime ${TEMPO_LIBSTDCXX_SO})
    endif()
  endif()
  if(runtime)
    _tempo_probe_cxx_runtime(${dir} ${runtime} how)
  endif()
  if(NOT runtime OR NOT how STREQUAL "shared")
    message(FATAL_ERROR "tempo: ${CMAKE_CXX_COMPILER} links libstdc++'s code into shared libraries, which would "
                        "give tempo's libraries a second C++ runtime beside torch's (error messages that format "
                        "numbers crash), and linking torch's libstdc++.so.6 (${runtime}) ahead of it did not "
                        "help (${how}): configure with -DCMAKE_CXX_COMPILER=<a g++ that links the shared runtime>")
  endif()
  message(STATUS "tempo: ${CMAKE_CXX_COMPILER} links libstdc++'s code into shared libraries; every target links "
                 "torch's shared runtime ahead of it: ${runtime}")
  link_libraries(${runtime})
endfunction()
