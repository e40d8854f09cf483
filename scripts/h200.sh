#!/usr/bin/env bash
# One call on the lent H200 (see ../shared/GPU.md): devices, the conformance
# suite on both GPU backends with and without matrix units, the bench, and
# the PyTorch anchors, all in one run so the ratios come from one machine.
# Usage (from the repository root, with .gl, .anchors and target/release/headkl
# carried): bash scripts/h200.sh [tune] [check] [bench] [anchors] [cublas]
# (default: all). `tune` runs first so check and bench use its choice.
set -u
steps="${*:-tune check bench anchors cublas}"
out=/tmp/headkl-out
mkdir -p "$out"
# The tune cache lives with the logs (it comes back in the archive).
export HEADKL_CACHE_DIR="$out/cache"
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
headkl=./target/release/headkl
shapes="${SHAPES:-A B}"
cases="${CASES:-48}"

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
$headkl devices 2>&1 | tee "$out/devices.txt"

summary="$out/summary.txt"
: >"$summary"
if [[ $steps == *tune* ]]; then
    for backend in vulkan wgpu; do
        log="$out/tune-$backend.txt"
        # Vulkan also prints each pipeline's register and memory statistics.
        HEADKL_PIPELINE_STATS=1 $headkl tune --backend $backend ${TUNE_ARGS:-} >"$log" 2>&1
        echo "tune $backend exit=$?" | tee -a "$summary"
        grep -vE "^tune: (round|\[)|^headkl-vulkan: pipeline" "$log" | tail -n 26 | tee -a "$summary"
    done
fi
if [[ $steps == *check* ]]; then
    # label | environment | backend
    while IFS='|' read -r label vars backend; do
        log="$out/check-$label.txt"
        env $vars HEADKL_REQUIRE=$backend $headkl check --backend $backend --cases "$cases" >"$log" 2>&1
        echo "check $label exit=$? $(grep -E "^\s*$backend " "$log" | tail -n 1)" | tee -a "$summary"
    done <<'LIST'
vulkan-coop||vulkan
vulkan-fallback|HEADKL_NO_COOPMAT=1|vulkan
vulkan-coop-direct|HEADKL_GEMM=direct|vulkan
vulkan-coop-s2|HEADKL_GEMM=staged:bk32:r2:s2|vulkan
wgpu-coop||wgpu
wgpu-fallback|HEADKL_NO_COOPMAT=1|wgpu
LIST
fi
if [[ $steps == *bench* ]]; then
    # label | environment | backend | shape | extra arguments
    while IFS='|' read -r label vars backend shape extra; do
        [[ " $shapes " == *" $shape "* ]] || continue
        log="$out/bench-$label.txt"
        env $vars HEADKL_TRACE=1 $headkl bench --backend $backend --shape $shape --iters 5 --warmup 1 $extra \
            --json "$out/bench-$label.json" >"$log" 2>&1
        echo "bench $label exit=$?" | tee -a "$summary"
        grep -E "^(vulkan|wgpu|trace) " "$log" | tee -a "$summary"
    done <<'LIST'
A-vulkan||vulkan|A|--plot /tmp/headkl-out/bench-A.svg --all
A-vulkan-m4096||vulkan|A|--budget 8589934592
A-wgpu-m4096||wgpu|A|--budget 8589934592
B-vulkan||vulkan|B|--all
LIST
fi
if [[ $steps == *anchors* ]]; then
    PYTHONUNBUFFERED=1 python3 .anchors/torch_head_kl.py --shapes "$(echo $shapes | tr ' ' ,)" \
        --variants floor,compiled,teacher_topk 2>&1 | tee "$out/anchors.txt" | grep -v Warning | tee -a "$summary"
fi
if [[ $steps == *cublas* ]]; then
    python3 scripts/cublas_gemm.py 2>&1 | grep -v Warning | tee "$out/cublas.txt" | tee -a "$summary"
fi
echo "=== summary"; cat "$summary"
# What comes back: the summary, the devices table, the plot and every log in one archive.
if [ -n "${OUT:-}" ]; then
    cp "$summary" "$out/devices.txt" "$OUT/" 2>/dev/null
    cp "$out"/*.svg "$OUT/" 2>/dev/null
    tar czf "$OUT/logs.tgz" -C "$out" .
fi
