# The installed layout (`cmake --install BUILD [--prefix P]`) and the .deb CPack makes of it
# (scripts/package-deb BUILD; scripts/test-deb installs it into a clean Debian root in CI).
# Included once, at the end of the top CMakeLists.txt, after every target exists.
#
#   <prefix>/bin/tessera, <prefix>/bin/tessera-actor   one folder: the daemon runs the actor next
#                                                      to itself (daemon/process.cpp, /proc/self/exe)
#   <prefix>/lib/systemd/system/tessera.service        the unit (scripts/systemd), when it exists
#   <prefix>/lib/python3/dist-packages/tessera/        the Python module, where it is built
#   <prefix>/share/doc/tessera/                        README.md and docs/
#
# CUDA: the release build's tessera-actor links libcublasLt.so.13 and libnccl.so.2 from the CUDA
# toolkit (/usr/local/cuda/lib here), which no Debian package provides under those names (NVIDIA
# ships them as pip wheels, a .run installer or its own apt repository). The package does not
# bundle them (cuBLASLt alone is 540 MB) and does not declare them as Debian dependencies: the
# .deb's Depends lists only what Debian ships (spdlog, fmt, Cap'n Proto for the Python module,
# libc, libstdc++), and the CUDA toolkit must be present on the machine, where the installed
# actor's RUNPATH (the toolkit's library folder at build time) or the loader's path finds it.
# `tessera` itself links no CUDA library (NVML is dlopen'ed), so `tessera --version`,
# `tessera start`, `status` and `stop` run without the toolkit; only actors need it.
include(GNUInstallDirs)

# ---- the programs -------------------------------------------------------------------------
# The actor keeps the non-system folders it was linked from (the CUDA toolkit's) in its installed
# RUNPATH; the build tree's $ORIGIN/../lib (spdlog/fmt copied beside the binaries by
# scripts/pack-device) is not kept: installed, they come from Debian's packages.
set_target_properties(tessera-actor PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)
install(TARGETS tessera tessera-actor RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

# ---- the systemd unit (scripts/systemd/tessera.service, where the tree has it) --------------
# A glob, re-checked by every ninja run: a unit added after the tree was configured is installed
# once ninja has run again. lib/systemd/system under /usr (the .deb) or /usr/local: both are on
# systemd's unit path.
file(GLOB tessera_systemd_units CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/scripts/systemd/tessera*.service)
if(tessera_systemd_units)
  install(FILES ${tessera_systemd_units} DESTINATION lib/systemd/system)
endif()

# ---- the Python module (driver/python; not built in sanitizer builds or without pybind11) ----
# lib/python3/dist-packages is where Debian's python3 finds packages under /usr (the .deb's
# prefix); under another prefix, PYTHONPATH=<prefix>/lib/python3/dist-packages.
set(TESSERA_INSTALL_PYTHONDIR "lib/python3/dist-packages" CACHE STRING
    "Where `cmake --install` puts the tessera Python package, relative to the prefix")
if(TARGET _tessera)
  install(TARGETS _tessera LIBRARY DESTINATION ${TESSERA_INSTALL_PYTHONDIR}/tessera)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/driver/python/tessera
          DESTINATION ${TESSERA_INSTALL_PYTHONDIR}
          FILES_MATCHING PATTERN "*.py" PATTERN "*.pyi" PATTERN "py.typed"
          PATTERN "__pycache__" EXCLUDE)
endif()

# ---- the docs -----------------------------------------------------------------------------
install(FILES ${PROJECT_SOURCE_DIR}/README.md DESTINATION ${CMAKE_INSTALL_DOCDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/docs/ DESTINATION ${CMAKE_INSTALL_DOCDIR})

# ---- the .deb (cpack -G DEB, run by scripts/package-deb) -------------------------------------
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME tessera)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})  # what `tessera --version` prints (TESSERA_VERSION)
set(CPACK_PACKAGE_VENDOR "Tessera")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "Distributed LLM inference runtime (node daemon, actors, CLI)")
set(CPACK_PACKAGE_DESCRIPTION
    "Tessera serves large language models across the GPUs of one or several machines: a node\n"
    "daemon per machine (tessera start), an actor process per GPU (tessera-actor), and the\n"
    "command line that plans, serves (OpenAI API) and benchmarks models.")
string(JOIN "" CPACK_PACKAGE_DESCRIPTION ${CPACK_PACKAGE_DESCRIPTION})
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_PACKAGE_CONTACT "Tessera maintainers <maintainers@users.noreply.a-seed-7a4931c7.example>"
    CACHE STRING "The .deb's Maintainer")
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${CPACK_PACKAGE_CONTACT}")
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)        # tessera_<version>_<arch>.deb
set(CPACK_DEBIAN_PACKAGE_SECTION misc)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
# Depends from dpkg-shlibdeps over the installed binaries and extension: the Debian packages of
# the shared libraries they need. CPack passes --ignore-missing-info, so the CUDA libraries (found
# through the private dirs below, owned by no Debian package) add nothing: see the top comment.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
if(TESSERA_HAVE_CUDA)
  set(tessera_cuda_lib_dirs ${CUDAToolkit_LIBRARY_DIR})
  if(TESSERA_NCCL_LIBRARY)
    get_filename_component(tessera_nccl_dir ${TESSERA_NCCL_LIBRARY} DIRECTORY)
    list(APPEND tessera_cuda_lib_dirs ${tessera_nccl_dir})
  endif()
  list(REMOVE_DUPLICATES tessera_cuda_lib_dirs)
  set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS ${tessera_cuda_lib_dirs})
  string(APPEND CPACK_PACKAGE_DESCRIPTION
         "\nThis build's tessera-actor needs the CUDA toolkit's libcublasLt.so.13 and libnccl.so.2\n"
         "(not Debian packages): install CUDA first; the CLI and the daemon run without it.")
endif()
if(TARGET _tessera)
  # The extension is built for this python3 (its ABI tag is in the file name): a recommendation,
  # so that a node that only runs the daemon does not pull in Python.
  set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "python3 (>= 3.11~), python3 (<< 3.12)")
  if(TESSERA_PYTHON_EXECUTABLE)
    execute_process(COMMAND ${TESSERA_PYTHON_EXECUTABLE} -c
                            "import sys; print('%d.%d' % sys.version_info[:2])"
                    OUTPUT_VARIABLE tessera_py_version OUTPUT_STRIP_TRAILING_WHITESPACE
                    RESULT_VARIABLE tessera_py_rc)
    if(tessera_py_rc EQUAL 0 AND tessera_py_version MATCHES "^3\\.([0-9]+)$")
      math(EXPR tessera_py_next "${CMAKE_MATCH_1} + 1")
      set(CPACK_DEBIAN_PACKAGE_RECOMMENDS
          "python3 (>= ${tessera_py_version}~), python3 (<< 3.${tessera_py_next})")
    endif()
  endif()
endif()
# The binaries keep their line tables (-g1, for backtraces); zstd packs the ~150 MB installed
# several times faster than xz on CI's two cores (Debian's dpkg reads zstd since bookworm).
set(CPACK_DEBIAN_COMPRESSION_TYPE zstd)
set(CPACK_PACKAGE_DIRECTORY ${CMAKE_BINARY_DIR}/package)
set(CPACK_OUTPUT_CONFIG_FILE ${CMAKE_BINARY_DIR}/CPackConfig.cmake)
include(CPack)
