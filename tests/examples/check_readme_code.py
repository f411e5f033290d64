#!/usr/bin/env python3
"""Checks that every code block the README marks with
<!-- file: PATH --> is exactly the file PATH, so the code a reader copies is
the code CI compiles and runs.

    check_readme_code.py REPO_ROOT            # check
    check_readme_code.py REPO_ROOT --update   # paste the files into the README
"""
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1])
readme = (root / "README.md").read_text()
if sys.argv[2:] == ["--update"]:
    def paste(m):
        return m.group(1) + (root / m.group(2)).read_text() + "```"
    (root / "README.md").write_text(re.sub(
        r"(<!-- file: (\S+) -->\s*```[a-z+]*\n).*?```", paste, readme, flags=re.S))
    sys.exit(0)
blocks = re.findall(r"<!-- file: (\S+) -->\s*```[a-z+]*\n(.*?)```", readme, re.S)
if not blocks:
    sys.exit("check_readme_code: README.md marks no code block with <!-- file: PATH -->")
failed = False
for path, code in blocks:
    text = (root / path).read_text()
    if code != text:
        failed = True
        print("check_readme_code: README.md's block for %s differs from the file; run "
              "tests/examples/check_readme_code.py . --update to paste it again" % path)
        for i, (a, b) in enumerate(zip(code.splitlines(), text.splitlines())):
            if a != b:
                print("  first difference, line %d:\n    README: %s\n    file:   %s" % (i + 1, a, b))
                break
    else:
        print("check_readme_code: %s matches" % path)
sys.exit(1 if failed else 0)
