# Finds the one LibTorch torchspeed builds against and defines the target torchspeed::libtorch.
# Used by the build and by the installed package (torchspeedConfig.cmake), so a downstream
# project links the same LibTorch that torchspeed was built with.
#
#   TORCHSPEED_TORCH_DIR  the prefix of a LibTorch install: PyPI's torch wheel (its torch/
#                         folder, what scripts/setup installs into .venv) or a LibTorch zip.
#                         Its CPU libraries are imported from that prefix only. The wheel is a
#                         CUDA build whose TorchConfig.cmake wants the CUDA toolkit and links
#                         libtorch_cuda (3 GB of NVIDIA libraries at run time); torchspeed needs
#                         libtorch_cpu and libc10 alone, which is what we import.
#   unset                 find_package(Torch) as usual (Debian's libtorch-dev 1.13, Torch_DIR,
#                         CMAKE_PREFIX_PATH).
# Either way the result is checked: headers and every library must come from one install.
# See Note [One LibTorch] below.
include_guard(GLOBAL)

# The version in the headers at INCLUDE_DIR (torch/version.h; 2.x also has headeronly/version.h).
function(ts_libtorch_header_version include_dir out)
  set(v "")
  foreach(f torch/headeronly/version.h torch/csrc/api/include/torch/version.h)
    if(NOT v AND EXISTS "${include_dir}/${f}")
      file(STRINGS "${include_dir}/${f}" lines REGEX "#define TORCH_VERSION_(MAJOR|MINOR|PATCH) ")
      set(parts "")
      foreach(l IN LISTS lines)
        string(REGEX REPLACE ".*TORCH_VERSION_[A-Z]+ ([0-9]+).*" "\\1" n "${l}")
        list(APPEND parts "${n}")
      endforeach()
      list(LENGTH parts np)
      if(np EQUAL 3)
        list(JOIN parts "." v)
      endif()
    endif()
  endforeach()
  set(${out} "${v}" PARENT_SCOPE)
endfunction()

# Note [One LibTorch]
# Two LibTorch installs on one machine (Debian's 1.13 and a wheel's 2.x) mix silently: the wheel's
# TorchConfig.cmake finds its libtorch.so with find_library, whose system paths come before the
# wheel's lib/, so a configure pointed at the wheel reported "Found Torch:
# /usr/lib/x86_64-linux-gnu/libtorch.so" and built 2.x headers against the 1.13 library. We refuse
# that: every library file must lie inside the prefix whose include/ holds the headers in use, and
# a library whose file name carries a version (Debian: libtorch.so.1.13) must carry the headers'.
function(ts_libtorch_check_one_install include_dir version)
  get_filename_component(prefix "${include_dir}" DIRECTORY)
  get_filename_component(prefix "${prefix}" REALPATH)
  foreach(lib IN LISTS ARGN)
    if(NOT IS_ABSOLUTE "${lib}" OR NOT EXISTS "${lib}")
      continue()  # a target name or a flag: nothing to compare
    endif()
    get_filename_component(real "${lib}" REALPATH)
    string(REGEX MATCH "\\.so\\.([0-9]+\\.[0-9]+)" m "${real}")
    set(lib_version "${CMAKE_MATCH_1}")
    string(FIND "${real}" "${prefix}/" at)
    set(bad "")
    if(NOT at EQUAL 0)
      set(bad "it lies outside that install (${prefix})")
    elseif(lib_version AND NOT version MATCHES "^${lib_version}")
      set(bad "its version is ${lib_version}")
    endif()
    if(bad)
      message(FATAL_ERROR
        "torchspeed: two LibTorch installs are mixed. The headers are LibTorch ${version} from "
        "${include_dir}, but the library ${lib} (${real}) is from another install: ${bad}.\n"
        "Build against one LibTorch: -DTORCHSPEED_TORCH_DIR=<its prefix> (the folder with "
        "include/ and lib/, e.g. the torch/ folder of PyPI's wheel; scripts/setup does this), or "
        "Debian's 1.13 alone (TORCHSPEED_TORCH=debian scripts/setup, with no Torch_DIR or "
        "CMAKE_PREFIX_PATH naming another LibTorch). Remove the build folder's CMakeCache.txt "
        "after changing it.")
    endif()
  endforeach()
endfunction()

if(NOT TARGET torchspeed::libtorch)
  set(TORCHSPEED_TORCH_DIR "${TORCHSPEED_TORCH_DIR}" CACHE PATH
      "Prefix of the LibTorch to build against (the torch wheel's torch/ folder); empty: find_package(Torch)")
  add_library(torchspeed::libtorch INTERFACE IMPORTED)
  if(TORCHSPEED_TORCH_DIR)
    set(_ts_inc "${TORCHSPEED_TORCH_DIR}/include")
    if(NOT EXISTS "${_ts_inc}/ATen/ATen.h" OR NOT EXISTS "${_ts_inc}/torch/csrc/api/include/torch/torch.h")
      message(FATAL_ERROR "torchspeed: TORCHSPEED_TORCH_DIR=${TORCHSPEED_TORCH_DIR} holds no LibTorch "
              "headers (expected include/ATen/ATen.h and include/torch/csrc/api/include/torch/torch.h). "
              "Point it at the folder with include/ and lib/ (for PyPI's wheel: site-packages/torch).")
    endif()
    set(_ts_libs "")
    foreach(name torch_cpu c10)
      unset(_ts_lib CACHE)
      find_library(_ts_lib NAMES ${name} PATHS "${TORCHSPEED_TORCH_DIR}/lib" NO_DEFAULT_PATH)
      if(NOT _ts_lib)
        message(FATAL_ERROR "torchspeed: lib${name}.so is not in ${TORCHSPEED_TORCH_DIR}/lib "
                "(TORCHSPEED_TORCH_DIR must be one complete LibTorch install).")
      endif()
      list(APPEND _ts_libs "${_ts_lib}")
    endforeach()
    unset(_ts_lib CACHE)
    set(TORCHSPEED_TORCH_INCLUDE_DIRS "${_ts_inc}" "${_ts_inc}/torch/csrc/api/include")
    set(TORCHSPEED_TORCH_LIBRARIES ${_ts_libs})
    set(TORCHSPEED_TORCH_LIBRARY_FILES ${_ts_libs})
    # --no-as-needed: operators register from static initialisers in libtorch_cpu.so; a program
    # that names none of its symbols directly must still load it.
    set_target_properties(torchspeed::libtorch PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${TORCHSPEED_TORCH_INCLUDE_DIRS}"
      INTERFACE_LINK_LIBRARIES "-Wl,--no-as-needed;${_ts_libs};-Wl,--as-needed")
  else()
    find_package(Torch REQUIRED)
    set(TORCHSPEED_TORCH_INCLUDE_DIRS ${TORCH_INCLUDE_DIRS})
    set(TORCHSPEED_TORCH_LIBRARIES ${TORCH_LIBRARIES})
    # The files behind the targets TORCH_LIBRARIES names, for the check below.
    set(_ts_files "")
    foreach(l IN LISTS TORCH_LIBRARIES)
      if(TARGET ${l})
        get_target_property(_loc ${l} IMPORTED_LOCATION)
        if(NOT _loc)
          get_target_property(_loc ${l} IMPORTED_LOCATION_RELEASE)
        endif()
        if(_loc)
          list(APPEND _ts_files "${_loc}")
        endif()
      else()
        list(APPEND _ts_files "${l}")
      endif()
    endforeach()
    if(TORCH_LIBRARY)
      list(APPEND _ts_files "${TORCH_LIBRARY}")
    endif()
    set(TORCHSPEED_TORCH_LIBRARY_FILES ${_ts_files})
    set_target_properties(torchspeed::libtorch PROPERTIES
      INTERFACE_LINK_LIBRARIES "${TORCH_LIBRARIES}")
    if(TORCH_CXX_FLAGS)
      separate_arguments(_ts_flags UNIX_COMMAND "${TORCH_CXX_FLAGS}")
      set_target_properties(torchspeed::libtorch PROPERTIES INTERFACE_COMPILE_OPTIONS "${_ts_flags}")
    endif()
  endif()

  # The headers in use: the first include directory that holds torch/csrc/api.
  set(TORCHSPEED_TORCH_VERSION "")
  foreach(d IN LISTS TORCHSPEED_TORCH_INCLUDE_DIRS)
    if(NOT TORCHSPEED_TORCH_VERSION AND EXISTS "${d}/torch/csrc/api/include/torch/version.h")
      ts_libtorch_header_version("${d}" TORCHSPEED_TORCH_VERSION)
      set(_ts_header_root "${d}")
    endif()
  endforeach()
  if(NOT TORCHSPEED_TORCH_VERSION)
    message(FATAL_ERROR "torchspeed: no LibTorch version.h under ${TORCHSPEED_TORCH_INCLUDE_DIRS}")
  endif()
  ts_libtorch_check_one_install("${_ts_header_root}" "${TORCHSPEED_TORCH_VERSION}" ${TORCHSPEED_TORCH_LIBRARY_FILES})
  # LibTorch 2.x headers need C++20 (its TorchConfig asks for cxx_std_20); 1.13 is C++17.
  if(TORCHSPEED_TORCH_VERSION VERSION_GREATER_EQUAL 2.0)
    set(TORCHSPEED_TORCH_CXX_STANDARD 20)
  else()
    set(TORCHSPEED_TORCH_CXX_STANDARD 17)
  endif()
  set_property(TARGET torchspeed::libtorch APPEND PROPERTY
    INTERFACE_COMPILE_FEATURES cxx_std_${TORCHSPEED_TORCH_CXX_STANDARD})
  message(STATUS "torchspeed: LibTorch ${TORCHSPEED_TORCH_VERSION} from ${_ts_header_root}")
endif()
