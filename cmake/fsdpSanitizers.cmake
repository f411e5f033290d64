# Sanitizer builds (Note [Sanitizer builds]).
#
# Note [Sanitizer builds]
# ~~~~~~~~~~~~~~~~~~~~~~~
# FSDP_SANITIZE=address,undefined or FSDP_SANITIZE=thread compiles and links
# every target of this project with that sanitizer (include this file before
# any target is defined). LibTorch, Gloo and libstdc++ are not instrumented:
#   - ASan still sees every heap block (it replaces malloc for the whole
#     process) and every access made by our code; leaks inside LibTorch's
#     static registries are not ours, so CI runs with detect_leaks=0.
#   - UBSan checks our code only; -fno-sanitize-recover makes a finding fail
#     the test instead of printing and going on.
#   - TSan sees our threads, atomics and mutexes; what LibTorch or OpenMP
#     synchronise inside themselves it cannot see, which
#     scripts/sanitizers/tsan.supp suppresses by library.
# scripts/test.sh sets the run-time options (scripts/sanitizers/env.sh) and says
# which build runs which tests.

set(FSDP_SANITIZE "" CACHE STRING
    "Sanitizers for every target: empty, address,undefined, or thread")
# The environment variable, when set, wins over the cache (as FSDP_WERROR).
if(DEFINED ENV{FSDP_SANITIZE})
  set(FSDP_SANITIZE "$ENV{FSDP_SANITIZE}" CACHE STRING "Sanitizers for every target" FORCE)
endif()
if(FSDP_SANITIZE)
  if(NOT FSDP_SANITIZE MATCHES "^(address|undefined|address,undefined|undefined,address|thread)$")
    message(FATAL_ERROR "FSDP_SANITIZE='${FSDP_SANITIZE}': use address,undefined or thread")
  endif()
  # -O1 keeps the instrumented tests fast enough while the stacks stay
  # readable. -g1 (line tables) is all a sanitizer's stack needs for file:line;
  # full -g doubles the compile time of a file that includes LibTorch
  # (flat_parameter.cpp with ASan+UBSan: 29 s with -g, 15 s with -g1).
  add_compile_options(-fsanitize=${FSDP_SANITIZE} -fno-omit-frame-pointer -g1 -O1)
  if(FSDP_SANITIZE MATCHES undefined)
    add_compile_options(-fno-sanitize-recover=undefined)
  endif()
  # GCC 12 warns (-Wtsan) where LibTorch's headers use atomic_thread_fence,
  # which TSan does not model (torch/csrc/autograd/node.h, the Python object
  # slot that C++ programs never touch); with -Werror that stopped the build.
  if(FSDP_SANITIZE STREQUAL "thread" AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU"
     AND CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12)
    add_compile_options(-Wno-tsan)
  endif()
  add_link_options(-fsanitize=${FSDP_SANITIZE})
  message(STATUS "libfsdp: sanitizers ${FSDP_SANITIZE}")
endif()
