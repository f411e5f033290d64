#!/usr/bin/env bash
# Prints the targets that the ctest tests selected by the arguments run: the
# executables under BUILD_DIR/bin named in their commands, read from the
# configured build's CTestTestfile.cmake files (so before anything is built),
# and the executables of gtest_discover_tests() not built yet.
#   scripts/ctest_targets.sh BUILD_DIR [ctest selection: -L comm -LE faults ...]
# scripts/test.sh uses it to build only what the sanitizer runs need.
set -euo pipefail
dir="$(cd "$1" && pwd)"
shift
ctest --test-dir "$dir" -N --show-only=json-v1 "$@" | python3 -c '
import json, pathlib, re, sys
build = pathlib.Path(sys.argv[1])
names = {t["name"] for t in json.load(sys.stdin)["tests"]}
# gtest_discover_tests() lists its tests only once the executable exists;
# before, it stands in as one test named <target>_NOT_BUILT, which carries the
# label of its tests (fsdp_discover_tests in tests/CMakeLists.txt), so the label
# selection above has already applied to it.
targets = {n[: -len("_NOT_BUILT")] for n in names if n.endswith("_NOT_BUILT")}
# Discovered tests of an executable that exists are listed in its
# "<target>[N]_tests.cmake": a stale one is rebuilt too.
files = list(build.rglob("CTestTestfile.cmake")) + list(build.rglob("*_tests.cmake"))
for f in files:
    for m in re.finditer(r"^add_test\(\[=\[(.*?)\]=\] +(.*)$", f.read_text(), re.M):
        if m.group(1) in names:
            targets.update(re.findall(re.escape(str(build)) + r"/bin/([A-Za-z0-9_]+)", m.group(2)))
print("\n".join(sorted(targets)))
' "$dir"
