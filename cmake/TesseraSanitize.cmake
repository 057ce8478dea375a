# Sanitizer and libFuzzer builds (clang only). scripts/test-sanitize configures build-asan with
# both on: -DTESSERA_SANITIZE=address,undefined -DTESSERA_FUZZ=ON -DTESSERA_CUDA=OFF.
#
#   TESSERA_SANITIZE  a -fsanitize= list applied to every target of the tree, e.g.
#                     "address,undefined"; empty (the default) for none. Every finding is fatal:
#                     -fno-sanitize-recover=all, and each executable carries default runtime
#                     options (halt_on_error, leak detection, UBSan stack traces) and the leak
#                     suppressions of tests/sanitizers/lsan.supp, compiled in
#                     (tests/sanitizers/sanitizer_defaults.cpp.in). They are compiled in because
#                     the daemon starts tessera-actor with a filtered environment that would drop
#                     ASAN_OPTIONS; $ASAN_OPTIONS and friends still override them. Third-party
#                     header-only libraries listed in tests/sanitizers/ignorelist.txt are left
#                     uninstrumented (build time; the file says why).
#   TESSERA_FUZZ      builds the libFuzzer targets of tests/fuzz (tessera_fuzzer() there); the
#                     libraries they drive get coverage instrumentation (tessera_fuzz_instrument
#                     below).
#
# Optimisation for these builds comes from the build type: scripts/test-sanitize uses
# CMAKE_BUILD_TYPE=Sanitize, whose flags (-O1 -g1, assertions on) are defined here.
set(TESSERA_SANITIZE "" CACHE STRING
  "Sanitizers for every target, as -fsanitize= takes them (e.g. address,undefined); empty: none")
option(TESSERA_FUZZ "Build the libFuzzer targets in tests/fuzz (clang)" OFF)

# The Sanitize build type: -O1 keeps the instrumented tests fast, -g1 (line tables) is all that
# the sanitizers' stack traces need, and NDEBUG stays undefined. project() creates the cache
# entries empty; fill them unless the user set them.
foreach(lang C CXX)
  if(NOT CMAKE_${lang}_FLAGS_SANITIZE)
    set(CMAKE_${lang}_FLAGS_SANITIZE "-O1 -g1" CACHE STRING
      "Flags used by the ${lang} compiler during SANITIZE builds." FORCE)
  endif()
endforeach()

if(NOT TESSERA_SANITIZE AND NOT TESSERA_FUZZ)
  return()
endif()

if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang" OR NOT CMAKE_C_COMPILER_ID STREQUAL "Clang")
  message(FATAL_ERROR "TESSERA_SANITIZE / TESSERA_FUZZ need clang (configure with "
    "-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++); got ${CMAKE_CXX_COMPILER_ID}")
endif()
if(TESSERA_HAVE_CUDA)
  message(FATAL_ERROR "TESSERA_SANITIZE / TESSERA_FUZZ build the CPU code only: add "
    "-DTESSERA_CUDA=OFF")
endif()

set(_tessera_c_cxx "$<COMPILE_LANGUAGE:C,CXX>")
# TESSERA_WARNINGS silences GCC-only warnings that clang does not know.
add_compile_options("$<${_tessera_c_cxx}:-Wno-unknown-warning-option>")
if(TESSERA_SANITIZE)
  add_compile_options(
    "$<${_tessera_c_cxx}:-fsanitize=${TESSERA_SANITIZE}>"
    "$<${_tessera_c_cxx}:-fno-sanitize-recover=all>"
    "$<${_tessera_c_cxx}:-fno-omit-frame-pointer>"
    "$<${_tessera_c_cxx}:-fsanitize-ignorelist=${PROJECT_SOURCE_DIR}/tests/sanitizers/ignorelist.txt>")
  add_link_options("-fsanitize=${TESSERA_SANITIZE}")
  # Our shared libraries are stand-ins for C libraries that the daemon dlopen()s (the fake
  # NVML of tests/daemon), called through pointers of the caller's own prototypes as the real
  # ones are; -fsanitize=function would report those ABI-compatible calls as type mismatches.
  add_compile_options(
    "$<$<AND:${_tessera_c_cxx},$<STREQUAL:$<TARGET_PROPERTY:TYPE>,SHARED_LIBRARY>>:-fno-sanitize=function>")
endif()

# tessera_fuzz_instrument(<target>...): compiles these libraries, and the first-party static
# libraries they link, with libFuzzer's coverage instrumentation (-fsanitize=fuzzer-no-link).
# tessera_fuzzer() (tests/fuzz) calls it on each fuzzer's DEPS: only the code that fuzzers drive
# pays the instrumentation's compile time, and the tests that link it run unchanged (the
# sanitizer runtime has the coverage hooks).
function(tessera_fuzz_instrument)
  foreach(target ${ARGN})
    if(NOT TARGET ${target})
      continue()
    endif()
    get_target_property(type ${target} TYPE)
    get_target_property(imported ${target} IMPORTED)
    get_target_property(done ${target} TESSERA_FUZZ_INSTRUMENTED)
    if(imported OR done OR NOT type MATCHES "^(STATIC_LIBRARY|OBJECT_LIBRARY)$")
      continue()
    endif()
    set_target_properties(${target} PROPERTIES TESSERA_FUZZ_INSTRUMENTED ON)
    target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:C,CXX>:-fsanitize=fuzzer-no-link>")
    get_target_property(deps ${target} LINK_LIBRARIES)
    if(deps)
      tessera_fuzz_instrument(${deps})
    endif()
  endforeach()
endfunction()

# The runtime defaults, linked into every executable (not into libraries: one definition per
# program). Generated so that lsan.supp stays the one place that lists suppressions.
set(_tessera_supp "${PROJECT_SOURCE_DIR}/tests/sanitizers/lsan.supp")
set(_tessera_defaults_in "${PROJECT_SOURCE_DIR}/tests/sanitizers/sanitizer_defaults.cpp.in")
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_tessera_supp}
  ${_tessera_defaults_in})
file(READ ${_tessera_supp} TESSERA_LSAN_SUPPRESSIONS)
configure_file(${_tessera_defaults_in} ${CMAKE_BINARY_DIR}/sanitizer_defaults.cpp @ONLY)
add_library(tessera_sanitizer_defaults OBJECT ${CMAKE_BINARY_DIR}/sanitizer_defaults.cpp)
link_libraries("$<$<STREQUAL:$<TARGET_PROPERTY:TYPE>,EXECUTABLE>:tessera_sanitizer_defaults>")

message(STATUS "Tessera: sanitizers '${TESSERA_SANITIZE}', fuzzers ${TESSERA_FUZZ}")
