# Note [Unity builds]
# ~~~~~~~~~~~~~~~~~~~
# A file that includes LibTorch spends most of its compile time not on its own
# code but on LibTorch's: loading the headers, instantiating their templates
# and optimising the inline functions it uses, again in every file. A unity
# build compiles a target's files in batches, one translation unit each, so
# that work is done once a batch: the 42 files of libfsdp outside the comm
# layer took 402 s of a core one by one and 93 s in batches (2.15, -O3, with
# the precompiled header either way). The library, the train_gpt example's
# pieces and each directory's tests (Note [One test program per directory] in
# tests/CMakeLists.txt) build so.
# What it asks of the code: names private to a file are still private to its
# batch, so two files of a target must not define the same name in an
# anonymous namespace (tests use a namespace named after their file); each
# file still includes what it uses, which FSDP_UNITY_BUILD=OFF (every file
# alone, as clang-tidy and editors see them) checks.
option(FSDP_UNITY_BUILD "Compile each target's files in batches (Note [Unity builds])" ON)

# Compiles TARGET's files in batches of BATCH when FSDP_UNITY_BUILD is on.
function(fsdp_unity_build target batch)
  if(FSDP_UNITY_BUILD)
    set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE ${batch})
  endif()
endfunction()
