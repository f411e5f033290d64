# Link options that LibTorch from pip's torch wheel needs on top of
# ${TORCH_LIBRARIES}. The wheel is a CUDA build: libtorch_cuda.so finds its
# CUDA libraries (the venv's nvidia/*/lib) through an $ORIGIN RPATH at run
# time, but the link editor searches the -rpath directories CMake adds first
# (for example /usr/local/cuda/lib, whose older NCCL lacks symbols the wheel
# needs) and fails. -rpath-link points it at the wheel's own copies. Empty for
# other LibTorch builds. Needs TORCH_INSTALL_PREFIX (set by find_package(Torch)).
function(fsdp_torch_link_options out)
  file(GLOB _dirs LIST_DIRECTORIES true "${TORCH_INSTALL_PREFIX}/../nvidia/*/lib")
  set(_opts "")
  if(_dirs)
    list(JOIN _dirs ":" _joined)
    set(_opts "LINKER:-rpath-link,${_joined}")
  endif()
  set(${out} "${_opts}" PARENT_SCOPE)
endfunction()
