# Link options that programs linking LibTorch need on top of
# ${TORCH_LIBRARIES}; used for libfsdp's own targets and, through the
# installed fsdpConfig.cmake, for its users'. Needs TORCH_INSTALL_PREFIX (set
# by find_package(Torch)).
#
# - pip's torch wheel is a CUDA build: libtorch_cuda.so finds its CUDA
#   libraries (the venv's nvidia/*/lib) through an $ORIGIN RPATH at run time,
#   but the link editor searches the -rpath directories CMake adds first (for
#   example /usr/local/cuda/lib, whose older NCCL lacks symbols the wheel
#   needs) and fails. -rpath-link points it at the wheel's own copies.
# - Note [libstdc++ before LibTorch]: PyTorch's wheels (2.5 to 2.11 at least,
#   pytorch/pytorch#133437) export libstdc++ functions they link statically,
#   std::filesystem among them, from libtorch.so and libtorch_cpu.so. The
#   dynamic linker binds a program's references to the first library of its
#   DT_NEEDED list that defines them, and CMake puts LibTorch before the
#   libstdc++ that g++ adds last: std::filesystem::remove_all then ran
#   LibTorch's copy, which jumped to address 0 (every checkpoint save crashed
#   with 2.11's wheel). Naming libstdc++ first (--no-as-needed, before the
#   objects) makes it the first definition of every standard-library symbol,
#   whatever LibTorch exports; tests/compat checks every binary's bindings.
#   A sanitizer's run-time still comes first: g++ puts it before everything.
function(fsdp_torch_link_options out)
  file(GLOB _dirs LIST_DIRECTORIES true "${TORCH_INSTALL_PREFIX}/../nvidia/*/lib")
  set(_opts "")
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    list(APPEND _opts "LINKER:--push-state,--no-as-needed,-lstdc++,--pop-state")
  endif()
  if(_dirs)
    list(JOIN _dirs ":" _joined)
    list(APPEND _opts "LINKER:-rpath-link,${_joined}")
  endif()
  set(${out} "${_opts}" PARENT_SCOPE)
endfunction()
