# Third-party dependencies, all from Debian packages (scripts/setup installs them).
#
# The binaries must run on a GPU machine that has none of these installed, so:
#  - Cap'n Proto / kj are linked from Debian's static archives;
#  - spdlog and fmt are used header-only (Debian ships no static archive for them);
#  - Boost.Asio/Beast, CLI11 and nlohmann-json are header-only anyway.
find_package(Threads REQUIRED)

find_program(CAPNP_EXECUTABLE capnp REQUIRED)
find_program(CAPNPC_CXX_EXECUTABLE capnpc-c++ REQUIRED)
find_path(CAPNP_INCLUDE_DIR capnp/rpc.h REQUIRED)

# A shared object (the Python extension) cannot take Debian's static archives, which are not
# position-independent: a target with the property TESSERA_SHARED_DEPS set links the shared
# libraries instead (evaluated for the target being linked).
set(tessera_capnp_static)
set(tessera_capnp_shared)
foreach(lib capnp-rpc capnp kj-async kj)
  string(REPLACE "-" "_" var "TESSERA_LIB_${lib}")
  find_library(${var} NAMES lib${lib}.a REQUIRED)
  find_library(${var}_shared NAMES lib${lib}.so REQUIRED)
  list(APPEND tessera_capnp_static ${${var}})
  list(APPEND tessera_capnp_shared ${${var}_shared})
endforeach()
add_library(tessera_capnp INTERFACE)
target_include_directories(tessera_capnp SYSTEM INTERFACE ${CAPNP_INCLUDE_DIR})
target_link_libraries(tessera_capnp INTERFACE
  "$<IF:$<BOOL:$<TARGET_PROPERTY:TESSERA_SHARED_DEPS>>,${tessera_capnp_shared},${tessera_capnp_static}>"
  Threads::Threads)

find_path(SPDLOG_INCLUDE_DIR spdlog/spdlog.h REQUIRED)
find_path(FMT_INCLUDE_DIR fmt/format.h REQUIRED)
add_library(tessera_spdlog INTERFACE)
target_include_directories(tessera_spdlog SYSTEM INTERFACE ${SPDLOG_INCLUDE_DIR} ${FMT_INCLUDE_DIR})
# Debian's shared libspdlog and libfmt are linked by default: compiling both header-only into
# every object was most of a build's time. Executables look for them in $ORIGIN/../lib first,
# so a machine without them (the GPU machine) runs the binaries with the two libraries copied
# beside them (scripts/pack-device does); OFF compiles them in, header-only.
option(TESSERA_SPDLOG_SHARED "Link the system's shared spdlog/fmt (else header-only)" ON)
if(TESSERA_SPDLOG_SHARED)
  set(CMAKE_BUILD_RPATH "$ORIGIN/../lib" CACHE STRING "" FORCE)
  find_library(TESSERA_LIB_spdlog NAMES spdlog REQUIRED)
  find_library(TESSERA_LIB_fmt NAMES fmt REQUIRED)
  target_compile_definitions(tessera_spdlog INTERFACE SPDLOG_COMPILED_LIB SPDLOG_SHARED_LIB
    SPDLOG_FMT_EXTERNAL)
  target_link_libraries(tessera_spdlog INTERFACE ${TESSERA_LIB_spdlog} ${TESSERA_LIB_fmt})
else()
  target_compile_definitions(tessera_spdlog INTERFACE SPDLOG_HEADER_ONLY FMT_HEADER_ONLY
    SPDLOG_FMT_EXTERNAL)
endif()

find_path(CLI11_INCLUDE_DIR CLI/CLI.hpp REQUIRED)
add_library(tessera_cli11 INTERFACE)
target_include_directories(tessera_cli11 SYSTEM INTERFACE ${CLI11_INCLUDE_DIR})

find_path(NLOHMANN_JSON_INCLUDE_DIR nlohmann/json.hpp REQUIRED)
add_library(tessera_json INTERFACE)
target_include_directories(tessera_json SYSTEM INTERFACE ${NLOHMANN_JSON_INCLUDE_DIR})

find_path(BOOST_ASIO_INCLUDE_DIR boost/asio.hpp REQUIRED)
add_library(tessera_asio INTERFACE)
target_include_directories(tessera_asio SYSTEM INTERFACE ${BOOST_ASIO_INCLUDE_DIR})

if(TESSERA_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
