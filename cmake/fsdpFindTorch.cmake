# Note [The LibTorch the package was built against]
# libfsdp.a calls LibTorch by mangled names (at::_ops::zeros_like::call, ...)
# that differ between LibTorch versions and builds. A user's project that links
# fsdp::fsdp with another LibTorch than libfsdp's fails at link time with
# hundreds of undefined references that do not say why, and a plain
# find_dependency(Torch) takes whichever LibTorch CMake finds first: Debian's
# in /usr before pip's wheel when only libfsdp's prefix is named. So
# fsdpConfig.cmake records the LibTorch libfsdp was built against (its version,
# Torch_DIR and TORCH_INSTALL_PREFIX) and fsdp_find_torch() below
#   - finds that one when the user named no LibTorch: it is a HINT, which
#     find_package searches after the user's Torch_DIR, Torch_ROOT and
#     CMAKE_PREFIX_PATH but before the system's /usr;
#   - while loading it, searches its prefix first, because its TorchConfig.cmake
#     looks for libc10, libtorch and Caffe2's config with PATHS, which come
#     after /usr: without this the wheel's config would pick Debian's libc10;
#   - refuses at configure time, in one line naming both and the fix, when the
#     LibTorch CMake would take is another one (another folder, or another
#     version in the same folder, e.g. a wheel upgraded in place). Where the
#     recorded folder is gone (the install was moved to another machine), any
#     LibTorch of the recorded version is taken.

# Sets <out_dir> to the folder of the TorchConfig.cmake that find_package(Torch)
# would load here with `hint` as a HINT ("" if none) and <out_version> to its
# version, loading none: the user's Torch_DIR, else the first candidate that a
# find_package for a version no LibTorch has considers, in find_package's own
# search order.
function(fsdp_torch_candidate hint out_dir out_version)
  set(dir "")
  if(Torch_DIR)
    set(dir "${Torch_DIR}")
  else()
    find_package(Torch 1000000 EXACT CONFIG QUIET HINTS "${hint}")
    unset(Torch_DIR CACHE)  # the probe left Torch_DIR-NOTFOUND there
    if(Torch_CONSIDERED_CONFIGS)
      list(GET Torch_CONSIDERED_CONFIGS 0 config)
      get_filename_component(dir "${config}" DIRECTORY)
    endif()
  endif()
  set(PACKAGE_VERSION "of unknown version")
  if(dir)
    file(GLOB version_file "${dir}/TorchConfigVersion.cmake" "${dir}/torch-config-version.cmake")
    if(version_file)
      set(PACKAGE_FIND_VERSION 0)  # what a version file compares against
      include("${version_file}")
    endif()
  endif()
  set(${out_dir} "${dir}" PARENT_SCOPE)
  set(${out_version} "${PACKAGE_VERSION}" PARENT_SCOPE)
endfunction()

# find_package(Torch) for the LibTorch recorded at libfsdp's build (Note [The
# LibTorch the package was built against]); a macro, so that Torch's variables
# (TORCH_LIBRARIES, TORCH_INSTALL_PREFIX, ...) reach the caller as
# find_package(Torch) would set them. Leaves Torch_FOUND false where no
# LibTorch was found; a fatal error where another one would be taken.
macro(fsdp_find_torch recorded_version recorded_dir recorded_prefix)
  fsdp_torch_candidate("${recorded_dir}" _fsdp_torch_dir _fsdp_torch_version)
  get_filename_component(_fsdp_torch_real "${_fsdp_torch_dir}" REALPATH)
  get_filename_component(_fsdp_recorded_real "${recorded_dir}" REALPATH)
  set(_fsdp_torch_here FALSE)
  if(EXISTS "${recorded_dir}")
    set(_fsdp_torch_here TRUE)
  endif()
  if(_fsdp_torch_dir
     AND (NOT _fsdp_torch_version VERSION_EQUAL "${recorded_version}"
          OR (_fsdp_torch_here AND NOT _fsdp_torch_real STREQUAL _fsdp_recorded_real)))
    if(_fsdp_torch_real STREQUAL _fsdp_recorded_real)
      string(CONCAT _fsdp_torch_fix
        "rebuild libfsdp against it (the LibTorch there changed since libfsdp was built) or "
        "reinstall LibTorch ${recorded_version} there")
    elseif(_fsdp_torch_here)
      string(CONCAT _fsdp_torch_fix
        "point CMake at the first with -DTorch_DIR=${recorded_dir} (and drop the other from "
        "Torch_DIR, Torch_ROOT and CMAKE_PREFIX_PATH), or rebuild libfsdp against the second")
    else()
      string(CONCAT _fsdp_torch_fix
        "point CMake at a LibTorch ${recorded_version} with -DTorch_DIR=<its share/cmake/Torch>, "
        "or rebuild libfsdp against the second")
    endif()
    # One line (a leading space keeps CMake from wrapping it).
    message(FATAL_ERROR
      " libfsdp: expected LibTorch ${recorded_version} at ${recorded_dir} (the one libfsdp was "
      "built against), got LibTorch ${_fsdp_torch_version} at ${_fsdp_torch_dir}. Linking "
      "libfsdp with another LibTorch fails with undefined references. Either ${_fsdp_torch_fix}.")
  endif()
  set(Torch_FOUND FALSE)
  if(_fsdp_torch_dir)
    # Its own libraries and Caffe2 config before any other LibTorch's.
    set(_fsdp_saved_prefix_path "${CMAKE_PREFIX_PATH}")
    if(_fsdp_torch_here)
      list(PREPEND CMAKE_PREFIX_PATH "${recorded_prefix}")
    endif()
    find_package(Torch CONFIG QUIET PATHS "${_fsdp_torch_dir}" NO_DEFAULT_PATH)
    set(CMAKE_PREFIX_PATH "${_fsdp_saved_prefix_path}")
  endif()
endmacro()
