#!/usr/bin/env bash
# One call on the lent H200 (see ../shared/GPU.md): devices, the conformance
# suite on both GPU backends with and without matrix units, the bench, and
# the PyTorch anchors, all in one run so the ratios come from one machine.
# Usage (from the repository root, with .gl, .anchors and target/release/headkl
# carried): bash scripts/h200.sh [check] [bench] [anchors]   (default: all)
set -u
steps="${*:-check bench anchors}"
out="${OUT:-/tmp/headkl-out}"
mkdir -p "$out"
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
if [[ $steps == *check* ]]; then
    for backend in vulkan wgpu; do
        for coop in on off; do
            env_off=""
            [ $coop = off ] && env_off="HEADKL_NO_COOPMAT=1"
            log="$out/check-$backend-coop$coop.txt"
            env $env_off HEADKL_REQUIRE=$backend $headkl check --backend $backend --cases "$cases" >"$log" 2>&1
            echo "check $backend matrix-units=$coop exit=$? $(grep -E '^\s*'$backend "$log" | tail -n 1)" | tee -a "$summary"
        done
    done
fi
if [[ $steps == *bench* ]]; then
    for shape in $shapes; do
        for backend in vulkan wgpu; do
            for kernel in staged direct; do
                log="$out/bench-$shape-$backend-$kernel.txt"
                HEADKL_COOP_KERNEL=$kernel $headkl bench --backend $backend --shape $shape --iters 5 --warmup 1 \
                    --json "$out/bench-$shape-$backend-$kernel.json" >"$log" 2>&1
                echo "bench $shape $backend $kernel exit=$?" | tee -a "$summary"
                tail -n 6 "$log" | tee -a "$summary"
            done
        done
    done
fi
if [[ $steps == *anchors* ]]; then
    PYTHONUNBUFFERED=1 python3 .anchors/torch_head_kl.py --shapes "$(echo $shapes | tr ' ' ,)" \
        --variants floor,compiled,teacher_topk 2>&1 | tee "$out/anchors.txt" | grep -v Warning | tee -a "$summary"
fi
echo "=== summary"; cat "$summary"
