#!/usr/bin/env bash
# Fails if any of the given programs binds a symbol of the C++ standard
# library (libstdc++) into another library, LibTorch above all (Note
# [libstdc++ before LibTorch] in cmake/fsdpTorchLink.cmake).
#   std_bindings.sh PROBE PROGRAM... (a directory: every program in it)
# The dynamic linker binds each undefined symbol of a program to the first
# library in load order that defines it. For every program this script takes
# the standard-library symbols it imports, walks the libraries that load
# before libstdc++ (ldd prints them in load order) and reports any that
# defines one. Two programs are also run under LD_DEBUG=bindings, the dynamic
# linker's own account, and must agree with that prediction: PROBE (linked
# without libfsdp's options; with a wheel that exports std::filesystem from
# libtorch.so it must be reported, which proves the check can fail) and the
# first PROGRAM.
set -uo pipefail
probe="$1"
shift
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

libstdcxx=$(ldd "$probe" | awk '/libstdc\+\+\.so/ {print $3; exit}')
[[ -n $libstdcxx ]] || { echo "std_bindings: $probe does not load libstdc++"; exit 1; }
nm -D --defined-only "$libstdcxx" | awk '{print $NF}' | sed 's/@.*//' | sort -u > "$tmp/std"

# A sanitizer's run-time comes first and takes operator new, __cxa_throw and
# the like on purpose (its interceptors): not a binding to report.
sanitizer='/lib(a|t|ub|l)san\.so'

# The exported symbols of a library, listed once per library.
exports() {
  local f="$tmp/exports_$(echo "$1" | md5sum | cut -c1-16)"
  [[ -f $f ]] || nm -D --defined-only "$1" 2>/dev/null | awk '{print $NF}' | sed 's/@.*//' | sort -u > "$f"
  echo "$f"
}

# Prints "symbol library" for each standard-library symbol that `program`
# would bind to a library loading before libstdc++.
predicted() {
  local program="$1" lib
  nm -D --undefined-only "$program" | awk '{print $NF}' | sed 's/@.*//' | sort -u |
    comm -12 - "$tmp/std" > "$tmp/wanted"
  while read -r lib; do
    [[ $lib == "$libstdcxx" ]] && break
    [[ $lib =~ $sanitizer ]] && continue
    comm -12 "$tmp/wanted" "$(exports "$lib")" | sed "s|\$| $lib|"
  done < <(ldd "$program" | awk '$2 == "=>" && $3 ~ /^\// {print $3}')
}

# The same, from the dynamic linker itself. A program's bindings to itself
# are its copy relocations (std::cout and the like, copied into the program
# and used from there by libstdc++ too): not a binding into another library.
observed() {
  local program="$1"
  rm -f "$tmp"/ld.*
  LD_DEBUG=bindings LD_BIND_NOW=1 LD_DEBUG_OUTPUT="$tmp/ld" timeout 120 "$program" --help \
    > /dev/null 2>&1 < /dev/null
  cat "$tmp"/ld.* | grep -F "binding file $program [0] to " |
    sed -E "s/.* to ([^ ]+) \[[0-9]+\]: normal symbol \`([^']+)'.*/\2 \1/" |
    awk -v std="$libstdcxx" -v self="$program" -v san="$sanitizer" \
      '$2 != std && $2 != self && $2 !~ san' | sort -u > "$tmp/bound"
  comm -12 <(cut -d' ' -f1 "$tmp/bound" | sort -u) "$tmp/std" | sort -u > "$tmp/bound_std"
  grep -F -w -f "$tmp/bound_std" "$tmp/bound" | sort -u
}

status=0
check_agreement() {
  local program="$1" p o
  p=$(predicted "$program" | sort -u)
  o=$(observed "$program")
  if [[ $p != "$o" ]]; then
    echo "std_bindings: the prediction for $program disagrees with LD_DEBUG=bindings:"
    diff <(echo "$p") <(echo "$o") | head -20
    status=1
  fi
  echo "$p"
}

probe_bound=$(check_agreement "$probe")
probe_fs=$(nm -D --undefined-only "$probe" | grep -c '_ZNSt10filesystem')
torch_fs=""
while read -r lib; do
  [[ $lib == "$libstdcxx" ]] && break
  if grep -q '^_ZNSt10filesystem10remove_all' "$(exports "$lib")"; then torch_fs="$lib"; fi
done < <(ldd "$probe" | awk '$2 == "=>" && $3 ~ /^\// {print $3}')
if [[ -n $torch_fs ]]; then
  if ! grep -q '_ZNSt10filesystem10remove_all' <<< "$probe_bound"; then
    echo "std_bindings: $torch_fs exports std::filesystem ahead of libstdc++, but the probe's binding into it was not seen: the check is blind"
    status=1
  else
    echo "control: the probe binds std::filesystem into $torch_fs, as a program linked without libfsdp's options would (detected)"
  fi
else
  echo "control: no library ahead of libstdc++ exports std::filesystem for the probe ($probe_fs references); nothing to detect with this LibTorch"
fi

# Directories stand for the programs built into them (not the probe).
programs=()
for arg in "$@"; do
  if [[ -d $arg ]]; then
    while read -r f; do
      [[ $f == "$probe" ]] || [[ " ${programs[*]} " == *" $f "* ]] || programs+=("$f")
    done < <(find "$arg" -maxdepth 1 -type f -perm -u+x | sort)
  else
    programs+=("$arg")
  fi
done
first=1
for program in "${programs[@]}"; do
  if ((first)); then
    bad=$(check_agreement "$program")
    first=0
  else
    bad=$(predicted "$program" | sort -u)
  fi
  if [[ -n $bad ]]; then
    echo "FAIL $program binds standard-library symbols into other libraries:"
    c++filt <<< "$bad" | head -10
    status=1
  else
    echo "ok   $program"
  fi
done
exit $status
