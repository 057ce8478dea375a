# ccache in front of every compiler (C, C++, nvcc) when it is installed (scripts/setup installs
# it): a rebuild of the same sources on one machine, a fresh clone included, compiles nothing.
# Its cache lives outside the clone (ccache's default, ~/.cache/ccache, or $CCACHE_DIR); paths
# are hashed relative to the source tree, so a clone at another path hits the same entries.
# -DTESSERA_CCACHE=OFF turns it off.
option(TESSERA_CCACHE "Compile through ccache when it is installed" ON)
find_program(TESSERA_CCACHE_PROGRAM ccache)
if(TESSERA_CCACHE AND TESSERA_CCACHE_PROGRAM)
  set(launcher env CCACHE_BASEDIR=${PROJECT_SOURCE_DIR} CCACHE_NOHASHDIR=true
      CCACHE_SLOPPINESS=include_file_ctime,include_file_mtime,time_macros
      ${TESSERA_CCACHE_PROGRAM})
  foreach(lang C CXX CUDA)
    set(CMAKE_${lang}_COMPILER_LAUNCHER ${launcher})
  endforeach()
  message(STATUS "Tessera: compiling through ${TESSERA_CCACHE_PROGRAM}")
endif()
