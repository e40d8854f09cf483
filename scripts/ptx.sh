#!/usr/bin/env bash
# Regenerates shaders/gemm_wgmma.ptx from shaders/gemm_wgmma.cu with a pinned
# NVRTC from the Python registry (scripts/ptx.py says more). Arguments:
# --check (compare instead of write), --ptxas (print registers and spills).
set -euo pipefail
exec python3 "$(dirname "$0")/ptx.py" "$@"
