#!/usr/bin/env bash
# Says which OpenBLAS kernels LibTorch 1.13 (Debian's, which calls the system
# BLAS) runs on, and warns when OpenBLAS took this CPU for an older one.
# Debian bookworm's OpenBLAS 0.3.21 identifies some current Intel Xeons (AVX-512
# with FP16) as "Prescott", a generic SSE3 core: matmuls then run ~3.6x slower
# than they could. OPENBLAS_CORETYPE=SkylakeX (AVX-512) or Haswell (AVX2)
# makes it pick the right kernels. pip's torch uses MKL and is not affected.
set -uo pipefail
python3 - <<'PY'
import ctypes, os, sys
try:
    lib = ctypes.CDLL("libopenblas.so.0")
except OSError:
    sys.exit(0)  # no OpenBLAS: nothing to say
lib.openblas_get_corename.restype = ctypes.c_char_p
core = lib.openblas_get_corename().decode()
flags = set()
with open("/proc/cpuinfo") as f:
    for line in f:
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
best = "SkylakeX" if "avx512f" in flags else "Haswell" if "avx2" in flags else None
forced = os.environ.get("OPENBLAS_CORETYPE")
generic = core.lower() in ("prescott", "core2", "katmai", "coppermine", "northwood", "banias")
print(f"blas: OpenBLAS (LibTorch 1.13) runs {core} kernels"
      + (f" (OPENBLAS_CORETYPE={forced})" if forced else ""))
if generic and best:
    print(f"blas: warning: OpenBLAS took this CPU ({'AVX-512' if best == 'SkylakeX' else 'AVX2'}) "
          f"for a generic {core} core, so LibTorch 1.13's matmuls run several times slower than "
          f"they could. Fix: export OPENBLAS_CORETYPE={best} before running LibTorch 1.13 programs.")
PY
