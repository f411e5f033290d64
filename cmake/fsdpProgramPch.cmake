# Note [Program build time]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# The examples and benchmarks are programs of one file and a main() each, so
# they share no unity batch (Note [Unity builds]): each parsed and compiled
# <torch/torch.h> on its own, 40-60 s of a core at -O2 (bench_step 60 s,
# getting_started 39 s). They share one precompiled <torch/torch.h> instead,
# built once with their own options: not the tests' (Note [Test build time]
# in tests/CMakeLists.txt), which are -Og, since the benchmarks' figures come
# from these builds. FSDP_PCH=OFF compiles without.

# Compiles TARGET (a program that links fsdp) with the programs' precompiled
# header, which the first call defines.
function(fsdp_program target)
  if(NOT FSDP_PCH)
    return()
  endif()
  if(NOT TARGET fsdp_program_pch)
    set(anchor ${PROJECT_BINARY_DIR}/fsdp_program_pch.cpp)
    file(CONFIGURE OUTPUT ${anchor} CONTENT "// The programs' precompiled header (Note [Program build time]).\n")
    add_library(fsdp_program_pch STATIC ${anchor})
    target_link_libraries(fsdp_program_pch PRIVATE fsdp)
    target_precompile_headers(fsdp_program_pch PRIVATE <torch/torch.h>)
  endif()
  target_precompile_headers(${target} REUSE_FROM fsdp_program_pch)
  # The header's options must equal the program's; this says so if they do not.
  target_compile_options(${target} PRIVATE -Winvalid-pch)
endfunction()
