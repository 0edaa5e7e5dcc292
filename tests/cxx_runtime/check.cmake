# ctest helper (cmake -P): configure and build tests/cxx_runtime with the plain compiler CXX and
# with gxx_static.sh wrapping it. Both libraries must leave the C++ runtime to the shared
# libstdc++ (no std::ostream::_M_insert<long> of their own), and only the wrapped compiler may
# make tempo_cxx_runtime link torch's runtime ahead (its configure message says so).
# "static-search": the same without torch's folder (no libc10.so to ask), so the runtime is
# searched for in the system's library folders.
foreach(kind plain static static-search)
  set(b ${BIN}/${kind})
  file(REMOVE_RECURSE ${b})
  set(compiler ${CXX})
  set(torch_lib ${TORCH_LIB_DIR})
  if(kind MATCHES "^static")
    set(compiler ${SRC}/gxx_static.sh)
  endif()
  if(kind STREQUAL "static-search")
    set(torch_lib ${b}/no-torch)
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} -E env TEMPO_REAL_CXX=${CXX}
                          ${CMAKE_COMMAND} -S ${SRC} -B ${b} -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${compiler}
                          -DTORCH_LIB_DIR=${torch_lib}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${kind}: configure failed:\n${out}")
  endif()
  string(FIND "${out}" "shared runtime ahead of it" said)
  if(kind MATCHES "^static" AND said EQUAL -1)
    message(FATAL_ERROR "${kind}: the probe did not see libstdc++'s code linked in:\n${out}")
  elseif(kind STREQUAL "plain" AND NOT said EQUAL -1)
    message(FATAL_ERROR "plain: the probe saw a static runtime where there is none:\n${out}")
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} -E env TEMPO_REAL_CXX=${CXX} ${CMAKE_COMMAND} --build ${b}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${kind}: build failed:\n${out}")
  endif()
  execute_process(COMMAND ${NM} ${b}/libformats.so OUTPUT_VARIABLE symbols RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0 OR symbols MATCHES " [TtWw] _ZNSo9_M_insertIlEERSoT_(\n|$)")
    message(FATAL_ERROR "${kind}: libformats.so carries its own C++ runtime (or nm failed: ${rc})")
  endif()
  message(STATUS "${kind}: the shared C++ runtime")
endforeach()
