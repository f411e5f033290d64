# Compiler warnings on every target libfsdp builds (Note [Warnings]).
#
# Note [Warnings]
# ~~~~~~~~~~~~~~~
# Every target of this project (the library, tests, examples, benchmarks,
# tools) compiles with -Wall -Wextra; FSDP_WERROR=ON (what scripts/test.sh,
# and so CI, uses for every build) makes them errors.
# fsdp_warnings_on_all_targets() walks the directory
# tree and applies fsdp_target_warnings() to each compiled target, so a new
# target cannot be forgotten. Not enabled, with the reason:
#   -Wunused-parameter  LibTorch's interfaces (Module::forward overloads,
#                       autograd hooks, c10d ProcessGroup virtuals, gtest
#                       bodies taking (rank, world_size)) fix signatures whose
#                       arguments an implementation may not need; naming them
#                       documents the signature.
#   -Warray-bounds, -Wstringop-overflow, -Wstringop-overread
#                       GCC 12 only: at -O2/-O3 they report the memcpy inside
#                       std::vector<uint8_t>::insert of a few bytes (the
#                       store protocol's MessageWriter) as out of bounds, a
#                       known false positive of that release (GCC bug 107852
#                       and its duplicates). The ASan build checks bounds for
#                       real.
#   -Wmaybe-uninitialized  GCC: its result changes with the optimisation level
#                       and sanitizer instrumentation; at -O1 with TSan it
#                       reports a std::optional<ScalarType> inlined from
#                       LibTorch's Tensor::to() (src/wrap/sequential.cpp) as
#                       maybe uninitialised, GCC's long-standing false positive
#                       on std::optional (GCC bug 80635). -Wuninitialized
#                       (definitely uninitialised) stays on.
#   -Wrestrict          GCC 12 reports std::string concatenation inlined at
#                       -O3 (operator+ on a literal and a string, as in
#                       tests/core/test_unit_runtime.cpp) as memcpy with
#                       overlapping 2^63-byte ranges: GCC bug 105329.
#   -Wdangling-else     GCC 12 reports every gtest EXPECT_/ASSERT_ under an
#                       unbraced if (the multi-rank tests' `if (rank == 0)
#                       EXPECT_EQ(...)`), whose expansion ends in an else.
#                       -Wmisleading-indentation (on) and clang-format catch
#                       an else placed under the wrong if.
# LibTorch's own headers never trip these: find_package(Torch) gives imported
# targets, whose include directories CMake passes as -isystem, and GCC and
# Clang report nothing from system headers. The fuzz target, built by a custom
# command with clang, passes the same flags itself (fuzz/CMakeLists.txt).

option(FSDP_WERROR "Treat compiler warnings as errors (scripts/test.sh sets it)" OFF)
# The environment variable, when set, wins over the cache (scripts/build.sh
# passes no options of its own for this).
if(DEFINED ENV{FSDP_WERROR})
  set(FSDP_WERROR "$ENV{FSDP_WERROR}" CACHE BOOL "Treat compiler warnings as errors" FORCE)
endif()

set(FSDP_WARNING_FLAGS -Wall -Wextra -Wno-unused-parameter)
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  list(APPEND FSDP_WARNING_FLAGS -Wno-maybe-uninitialized -Wno-dangling-else -Wno-restrict)
endif()
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12
   AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
  list(APPEND FSDP_WARNING_FLAGS -Wno-array-bounds -Wno-stringop-overflow -Wno-stringop-overread)
endif()
if(FSDP_WERROR)
  list(APPEND FSDP_WARNING_FLAGS -Werror)
endif()

# Adds libfsdp's warning flags to one target (GCC and Clang).
function(fsdp_target_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:GNU,Clang>>:${FSDP_WARNING_FLAGS}>)
endfunction()

# fsdp_target_warnings() on every compiled target defined under `dir`.
function(fsdp_warnings_on_all_targets dir)
  get_property(_targets DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
  foreach(_t IN LISTS _targets)
    get_target_property(_type ${_t} TYPE)
    if(_type MATCHES "^(EXECUTABLE|STATIC_LIBRARY|SHARED_LIBRARY|MODULE_LIBRARY|OBJECT_LIBRARY)$")
      fsdp_target_warnings(${_t})
    endif()
  endforeach()
  get_property(_subdirs DIRECTORY ${dir} PROPERTY SUBDIRECTORIES)
  foreach(_d IN LISTS _subdirs)
    fsdp_warnings_on_all_targets(${_d})
  endforeach()
endfunction()
