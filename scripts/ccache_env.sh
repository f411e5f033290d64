# Sourced by scripts/build.sh and scripts/test.sh: ccache's settings for every
# compile of this project, CI's and a developer's alike.
#
# Note [One compiler cache]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# ccache puts LANG, LC_ALL, LC_CTYPE and LC_MESSAGES into every key (they
# change the compiler's messages), so a build run from a developer's shell
# (LANG=C.UTF-8) and CI's run of the same tree (another environment) shared
# no object: on 2026-11-28 a fresh clone built warm in 19 minutes, and CI's
# run of the same commit, right after it on the same machine, took 45, most
# of it compiling anew. These are pinned for every build (and, under
# scripts/test.sh, for its tests, which then run in C.UTF-8). CCACHE_BASEDIR
# keeps the clone's path out of the keys (CI clones into a folder of its
# own), and with it CCACHE_NOHASHDIR the folder a compile ran in, which ccache
# otherwise hashes where debug information names it (-g1 in the sanitizer
# builds): a cached object's line tables then name the folder of the clone
# that compiled it first, and a sanitizer's stack still says file and line.
# CCACHE_MAXSIZE keeps a developer's builds (ccache's default: 5 GB) from
# evicting what CI's five builds need (about 3 GB). The sloppiness is
# what ccache needs to cache compiles that use a precompiled header (Note
# [Test build time] in tests/CMakeLists.txt).
if command -v ccache > /dev/null; then
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}" CCACHE_NOHASHDIR=1
  export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-10G}"
  export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"
  export LANG=C.UTF-8
  unset LC_ALL LC_CTYPE LC_MESSAGES
fi
