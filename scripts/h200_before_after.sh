#!/usr/bin/env bash
# One H200 call comparing two builds at A and B (the Vulkan host and
# resident paths, with each kl_rows/topk_rows pipeline's registers), the
# small students' shapes S and M, wgpu at A, the KL rows kernel with every
# loss term on and off (the criterion bench, if given), and the PyTorch
# anchors, so every ratio comes from one machine (docs/PERFORMANCE.md,
# "Where it stands"). Run from the repository root with .gl and .anchors
# carried (scripts/h200.sh says how) and the binaries named by:
#   HEADKL_BIN   the build to measure (default ./target/release/headkl)
#   BEFORE_BIN   the build to compare against (optional)
#   KERNELS_BENCH the criterion bench binary of crates/cli/benches/kernels.rs (optional)
set -u
out="${OUT:-/tmp/headkl-out}"; mkdir -p "$out"
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export HEADKL_CACHE_DIR=/tmp/cache
after="${HEADKL_BIN:-./target/release/headkl}"
before="${BEFORE_BIN:-}"
sum="$out/summary.txt"; : >"$sum"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$sum"
# label binary backend shape extra...; builds before 2026-12-01's fourth
# session have no --yes, so it is passed to the measured build only.
bench() {
  local label=$1 bin=$2 backend=$3 shape=$4; shift 4
  HEADKL_TRACE=1 $bin --quiet bench --backend "$backend" --shape "$shape" --iters 5 --warmup 1 "$@" >"$out/bench-$label.txt" 2>&1
  echo "bench $label exit=$?" | tee -a "$sum"
  grep -E "^(vulkan|wgpu) |pipeline.*(kl_rows|topk_rows)" "$out/bench-$label.txt" | cut -c1-200 | head -12 | tee -a "$sum"
}
export HEADKL_PIPELINE_STATS=1
[ -n "$before" ] && bench A-before "$before" vulkan A --resident
bench A-after "$after" vulkan A --resident --yes
unset HEADKL_PIPELINE_STATS
[ -n "$before" ] && bench B-before "$before" vulkan B
bench B-after "$after" vulkan B --yes
bench S-after "$after" vulkan S --yes
bench M-after "$after" vulkan M --yes
bench A-wgpu "$after" wgpu A --yes
if [ -n "${KERNELS_BENCH:-}" ]; then
  HEADKL_BENCH_SHAPE=A HEADKL_REQUIRE=vulkan "$KERNELS_BENCH" --bench "vulkan/A/kl_rows" 2>&1 | grep -E "^vulkan/|time:" | tee -a "$sum"
fi
PYTHONUNBUFFERED=1 timeout 240 python3 .anchors/torch_head_kl.py --shapes A,B,S,M --variants compiled,teacher_topk 2>&1 \
  | grep -v Warning | tee "$out/anchors.txt" | tail -n 10 | tee -a "$sum"
echo "=== summary"; cat "$sum"
