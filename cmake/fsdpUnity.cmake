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
#
# The batches are written here, not by CMake's UNITY_BUILD: CMake's include
# their files by absolute path (before CMake 4.0's UNITY_BUILD_RELOCATABLE),
# and ccache keys a file on its text, so a clone in another folder (CI's)
# compiled every batch anew: most of a build. These include them by a path
# relative to the batch, the same in every clone (Note [One compiler cache] in
# scripts/ccache_env.sh).
option(FSDP_UNITY_BUILD "Compile each target's files in batches (Note [Unity builds])" ON)

# Compiles TARGET's files in batches of BATCH when FSDP_UNITY_BUILD is on,
# once the project's directories have added all of them (a test program gets
# its files one test at a time).
function(fsdp_unity_build target batch)
  if(FSDP_UNITY_BUILD)
    cmake_language(EVAL CODE "cmake_language(DEFER DIRECTORY \"${PROJECT_SOURCE_DIR}\"
                   CALL _fsdp_write_unity_batches \"${target}\" ${batch})")
  endif()
endfunction()

# Writes batch INDEX of TARGET's files (their #include lines in TEXT) into
# UNITY_DIR and appends it to the list named BATCHES.
macro(_fsdp_write_unity_batch unity_dir text batches)
  list(LENGTH ${batches} _index)
  set(_file "${unity_dir}/unity_${_index}.cxx")
  # Written only when its text changed, so a configure rebuilds nothing.
  file(CONFIGURE OUTPUT "${_file}" @ONLY
       CONTENT "/* A unity batch (Note [Unity builds] in cmake/fsdpUnity.cmake) */\n${text}")
  list(APPEND ${batches} "${_file}")
endmacro()

# What CMake's unity builds leave alone stays alone: files that are not C++
# sources, or that have options, definitions or include folders of their own,
# or SKIP_UNITY_BUILD_INCLUSION.
function(_fsdp_write_unity_batches target batch)
  get_target_property(dir ${target} SOURCE_DIR)
  get_target_property(binary_dir ${target} BINARY_DIR)
  get_target_property(sources ${target} SOURCES)
  set(unity_dir "${binary_dir}/CMakeFiles/${target}.dir/FsdpUnity")
  set(batched "")
  set(batches "")
  set(text "")
  set(count 0)
  foreach(source IN LISTS sources)
    if(source MATCHES "^\\$<" OR NOT source MATCHES "\\.(cpp|cc|cxx)$")
      continue()
    endif()
    get_filename_component(path "${source}" ABSOLUTE BASE_DIR "${dir}")
    set(alone OFF)
    foreach(property SKIP_UNITY_BUILD_INCLUSION COMPILE_OPTIONS COMPILE_DEFINITIONS
                     COMPILE_FLAGS INCLUDE_DIRECTORIES)
      get_source_file_property(value "${path}" TARGET_DIRECTORY ${target} ${property})
      if(value)
        set(alone ON)
      endif()
    endforeach()
    if(alone)
      continue()
    endif()
    file(RELATIVE_PATH relative "${unity_dir}" "${path}")
    string(APPEND text "#include \"${relative}\"\n")
    list(APPEND batched "${path}")
    math(EXPR count "${count} + 1")
    if(count EQUAL batch)
      _fsdp_write_unity_batch("${unity_dir}" "${text}" batches)
      set(text "")
      set(count 0)
    endif()
  endforeach()
  if(count GREATER 0)
    _fsdp_write_unity_batch("${unity_dir}" "${text}" batches)
  endif()
  if(batched)
    set_source_files_properties(${batched} TARGET_DIRECTORY ${target}
                                PROPERTIES HEADER_FILE_ONLY ON)
    target_sources(${target} PRIVATE ${batches})
  endif()
endfunction()
