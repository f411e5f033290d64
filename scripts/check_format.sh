#!/usr/bin/env bash
# Fails, listing them, when clang-format (the repository's .clang-format)
# would change any tracked C++ file. scripts/test.sh runs it before building.
#   scripts/check_format.sh          check every tracked .cpp/.h/.hpp/.cc
#   scripts/check_format.sh FILE...  check those files only
#   scripts/check_format.sh --fix [FILE...]   reformat them in place instead
# CLANG_FORMAT names the binary (default: clang-format-14, else clang-format;
# versions format differently, so CI and the check use Debian's 14).
set -euo pipefail
cd "$(dirname "$0")/.."

fix=0
if [[ ${1:-} == --fix ]]; then
  fix=1
  shift
fi
cf="${CLANG_FORMAT:-}"
if [[ -z $cf ]]; then
  if command -v clang-format-14 >/dev/null; then cf=clang-format-14; else cf=clang-format; fi
fi
if ! command -v "$cf" >/dev/null; then
  echo "check_format: $cf not found: install clang-format-14 (scripts/setup.sh)" >&2
  exit 2
fi

files=()
if (($# > 0)); then
  # C++ files only: clang-format would take anything else (Markdown too) for C++.
  for f in "$@"; do
    case "$f" in
      *.cpp | *.h | *.hpp | *.cc) files+=("$f") ;;
      *) echo "check_format: skipping $f (not C++)" >&2 ;;
    esac
  done
  ((${#files[@]} > 0)) || exit 0
else
  while IFS= read -r -d '' f; do files+=("$f"); done \
    < <(git ls-files -z '*.cpp' '*.h' '*.hpp' '*.cc')
fi

if ((fix)); then
  "$cf" -i --style=file "${files[@]}"
  exit 0
fi

# One clang-format call for all files; each change it would make is reported
# as "FILE:LINE:COL: error: code should be clang-formatted".
rc=0
out=$("$cf" --style=file --dry-run -Werror "${files[@]}" 2>&1) || rc=$?
bad=()
while IFS= read -r f; do bad+=("$f"); done < <(
  sed -n 's/^\(.*\):[0-9]*:[0-9]*: error: code should be clang-formatted.*/\1/p' <<<"$out" | sort -u)
if ((rc != 0 && ${#bad[@]} == 0)); then
  echo "check_format: $cf failed (status $rc):" >&2
  echo "$out" >&2
  exit 2
fi
if ((${#bad[@]} > 0)); then
  echo "check_format: ${#bad[@]} of ${#files[@]} files are not clang-formatted ($("$cf" --version)):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  echo "check_format: run scripts/check_format.sh --fix FILE... (or $cf -i FILE...)" >&2
  exit 1
fi
echo "check_format: ${#files[@]} files are clang-formatted"
