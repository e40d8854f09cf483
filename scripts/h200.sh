#!/usr/bin/env bash
# Runs on the lent H100 or H200 (see ../shared/GPU.md): devices, the conformance suite
# on the GPU backends (CUDA; Vulkan and wgpu with and without matrix units), the training example,
# the GEMM ceiling report, the bench (host and device-resident paths), the
# PyTorch anchors and cuBLAS, so the ratios come from one machine.
#
# Usage (from the repository root, with .gl, .anchors and the binaries
# carried): bash scripts/h200.sh [devices] [check] [example] [ceiling] [tune]
# [bench] [dxsplit] [filter] [wgmma] [divergence] [fullvocab] [ce] [anchors] [peers]
# [cublas] [soak] [torch] [faults] (default: all but tune, dxsplit, filter,
# wgmma, divergence, fullvocab, ce, peers, soak, torch and faults).
# `faults` marks a PTX tile failed in a fresh tune cache and shows the
# default passing over it (devices, check) until a tune clears the mark.
# `torch` runs the Python package (a wheel carried in .wheel): its tests with
# the zero-copy CUDA ones, the example on CUDA tensors, and the loss from
# PyTorch at each shape beside the Rust resident path and the peers.
# `ce` times head_kl as the cross-entropy alone (bench --soft-weight 0
# --hard-weight 1 --labels random) at each shape, host and resident, then Cut
# Cross-Entropy, Liger's fused linear CE and torch.compile's CE (peers.py).
# `divergence` times head_kl with each divergence (bench --divergence
# forward, reverse, jsd at β 0.5) at each shape of SHAPES, host and
# resident, then Liger's fused linear KL and JSD (peers.py) in the same call.
# `fullvocab` times the exact full-vocabulary JSD (β 0.5) from teacher hidden
# rows (bench --teacher-hs: the shape's hs, and 4096 at S) beside Liger's
# fused linear JSD at the same teacher sizes (peers.py --variants liger_jsd).
# `soak` runs `headkl soak` (SOAK_CALLS calls a path, default 10000, at
# SOAK_SHAPE, default S) on each of SOAK_BACKENDS (default "vulkan wgpu"):
# memory flat and results bit-identical on the host and resident paths,
# three engines on threads against one; one backend is about 7 minutes, so
# give each its own device call. `wgmma` runs
# the PTX tiles (shaders/gemm_wgmma.cu through VK_NVX_binary_import): their
# CUDA check beside cuBLAS (scripts/wgmma_cuda.py), `check` with each tile
# picked, and the bench at the shapes with them against the default tiles.
# `peers` runs ../shared/anchors/peers.py (Liger's fused linear KL and CE,
# Cut Cross-Entropy, torch.compile CE; carried in .anchors with its wheels).
# `filter` runs the dx GEMM's block filter:
# `check` on each GLSL loop structure's filtered kernel, then bench on the
# `lm` data at A, S and M without the filter, with it, and with it on the
# prior's vocabulary order.
# A device call is at most 10 minutes, so split the steps over two
# back-to-back calls, e.g. `devices check example ceiling` then
# `bench anchors cublas`.
#
# The ceiling step needs a binary built with the report's kernels:
# `cargo build --release -p headkl-cli --features ceiling`.
# SHAPES (default "A B"; any of A B S M) picks the bench rows and the
# anchors' shapes, e.g. SHAPES="S M" for the small students.
# HEADKL_BIN (default ./target/release/headkl) and DISTILL_BIN (default
# ./target/release/examples/distill_step) name the binaries.
set -u
steps="${*:-devices check example ceiling bench anchors cublas}"
out=/tmp/headkl-out
mkdir -p "$out"
# The tune cache lives with the logs (it comes back in the archive).
export HEADKL_CACHE_DIR="$out/cache"
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
headkl="${HEADKL_BIN:-./target/release/headkl}"
distill="${DISTILL_BIN:-./target/release/examples/distill_step}"
shapes="${SHAPES:-A B}"
cases="${CASES:-32}"
quiet=--quiet

summary="$out/summary.txt"
: >"$summary"
has() { [[ " $steps " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$summary"
if has devices; then
    $headkl devices 2>&1 | tee "$out/devices.txt"
fi
if has tune; then
    for backend in vulkan wgpu; do
        log="$out/tune-$backend.txt"
        HEADKL_PIPELINE_STATS=1 $headkl $quiet tune --backend $backend ${TUNE_ARGS:-} >"$log" 2>&1
        echo "tune $backend exit=$?" | tee -a "$summary"
        grep -vE "^tune: (round|\[)|^headkl-vulkan: pipeline" "$log" | tail -n 26 | tee -a "$summary"
    done
fi
if has soak; then
    for backend in ${SOAK_BACKENDS:-vulkan wgpu}; do
        log="$out/soak-$backend.txt"
        $headkl soak --backend "$backend" --shape "${SOAK_SHAPE:-S}" --calls "${SOAK_CALLS:-10000}" >"$log" 2>&1
        echo "soak $backend exit=$?" | tee -a "$summary"
        grep -E "^soak:" "$log" | tee -a "$summary"
    done
fi
if has check; then
    # label | environment | backend
    while IFS='|' read -r label vars backend; do
        log="$out/check-$label.txt"
        env $vars HEADKL_REQUIRE=$backend $headkl $quiet check --backend $backend --cases "$cases" >"$log" 2>&1
        echo "check $label exit=$? $(grep -E "^\s*$backend " "$log" | tail -n 1)" | tee -a "$summary"
    done <<'LIST'
cuda-default||cuda
vulkan-default||vulkan
vulkan-glsl|HEADKL_GEMM=glsl:bm128.bk64.s1|vulkan
vulkan-glsl-s2|HEADKL_GEMM=logits=glsl:bm128.bk64.s1,dx=glsl:bm128.bk32.s2|vulkan
vulkan-wgsl|HEADKL_GEMM=logits=staged:bk64:r2:s1,dx=staged:bk32:r4:s1:pf|vulkan
vulkan-fallback|HEADKL_NO_COOPMAT=1|vulkan
wgpu-default||wgpu
wgpu-wgsl|HEADKL_GEMM=staged:bk32:r4:s1:pf|wgpu
wgpu-fallback|HEADKL_NO_COOPMAT=1|wgpu
LIST
fi
if has faults; then
    # A PTX tile marked failed in the tune cache (as a refused module or a
    # device lost under it would mark it) is not picked by the default:
    # `devices` says why, `check` runs the GLSL tiles, and a tune clears it.
    faults="$out/faults"
    mkdir -p "$faults"
    HEADKL_CACHE_DIR="$faults" $headkl devices >"$faults/devices-before.txt" 2>&1
    HEADKL_CACHE_DIR="$faults" $headkl devices --json >"$faults/devices.json" 2>"$faults/devices-json-err.txt"
    python3 - "$faults" <<'PY'
import json, sys
folder = sys.argv[1]
listing = json.load(open(f"{folder}/devices.json"))
rows = listing if isinstance(listing, list) else listing.get("devices", [])
dev = next(r for r in rows if r.get("backend") == "vulkan" and r.get("matrix_units"))
line = f"vulkan\t{dev['name']}\t{dev['driver']}\tfailed:wgmma:bm64.bk64.s1\tdevice lost: planted by h200.sh\n"
open(f"{folder}/gemm-tune.tsv", "w").write(line)
PY
    HEADKL_CACHE_DIR="$faults" $headkl devices >"$faults/devices-marked.txt" 2>&1
    HEADKL_CACHE_DIR="$faults" HEADKL_REQUIRE=vulkan $headkl check --backend vulkan --cases 4 >"$faults/check-marked.txt" 2>&1
    echo "faults check exit=$?" | tee -a "$summary"
    grep -hE "vulkan device|GEMM|gemm" "$faults"/devices-before.txt "$faults"/devices-marked.txt "$faults/check-marked.txt" | cut -c1-300 | tee -a "$summary"
    HEADKL_CACHE_DIR="$faults" $headkl $quiet tune --backend vulkan --kernels wgmma:bm64.bk64.s1,glsl:bm128.bk64.s1 --shape 2048:32768:2048 --iters 2 >"$faults/tune.txt" 2>&1
    echo "faults tune exit=$? $(grep -E '^best' "$faults/tune.txt")" | tee -a "$summary"
    cat "$faults/gemm-tune.tsv" | tee -a "$summary"
fi
if has example; then
    # The training step that learns, on the H200: the loss must fall by half.
    $distill --steps 40 >"$out/distill_step.txt" 2>&1
    echo "distill_step exit=$? $(tail -n 1 "$out/distill_step.txt")" | tee -a "$summary"
    $distill --steps 40 --ntok 2048 --vocab 32768 --hs 1024 --k 64 >"$out/distill_step-large.txt" 2>&1
    echo "distill_step large exit=$? $(tail -n 1 "$out/distill_step-large.txt")" | tee -a "$summary"
fi
if has ceiling; then
    $headkl $quiet tune --backend vulkan --ceiling --iters 3 >"$out/ceiling.txt" 2>"$out/ceiling-err.txt"
    echo "ceiling exit=$?" | tee -a "$summary"
    grep -E "\(a\)|\(b\)|\(c\)|\(d\)|\(e\)|^ceiling|current" "$out/ceiling.txt" | sed -E 's/ +/ /g' | cut -c1-160 | tee -a "$summary"
fi
if has bench; then
    # label | environment | backend | shape | extra arguments
    while IFS='|' read -r label vars backend shape extra; do
        [[ " $shapes " == *" $shape "* ]] || continue
        log="$out/bench-$label.txt"
        env $vars HEADKL_TRACE=1 $headkl $quiet bench --backend $backend --shape $shape --iters 5 --warmup 1 $extra \
            --json "$out/bench-$label.json" >"$log" 2>&1
        echo "bench $label exit=$?" | tee -a "$summary"
        grep -E "^(cuda|vulkan|wgpu|trace) |^bench: queue" "$log" | tee -a "$summary"
    done <<'LIST'
A-cuda||cuda|A|--resident
A-vulkan||vulkan|A|--resident --plot /tmp/headkl-out/bench-A.svg
A-vulkan-glsl|HEADKL_GEMM=glsl:bm128.bk64.s1|vulkan|A|--resident
A-vulkan-wgsl|HEADKL_GEMM=logits=staged:bk64:r2:s1,dx=staged:bk32:r4:s1:pf|vulkan|A|--resident
A-wgpu||wgpu|A|--resident
A-wgpu-wgsl|HEADKL_GEMM=staged:bk32:r4:s1:pf|wgpu|A|--resident
A-wgpu-universal|HEADKL_QUEUE=universal|wgpu|A|
A-vulkan-universal|HEADKL_QUEUE=universal|vulkan|A|
B-cuda||cuda|B|--resident
B-vulkan||vulkan|B|--resident
B-vulkan-glsl|HEADKL_GEMM=glsl:bm128.bk64.s1|vulkan|B|
B-wgpu||wgpu|B|
S-cuda||cuda|S|--resident
S-vulkan||vulkan|S|--resident
S-vulkan-glsl|HEADKL_GEMM=glsl:bm128.bk64.s1|vulkan|S|
S-wgpu||wgpu|S|
M-cuda||cuda|M|--resident
M-vulkan||vulkan|M|--resident
M-vulkan-glsl|HEADKL_GEMM=glsl:bm128.bk64.s1|vulkan|M|
M-wgpu||wgpu|M|
LIST
fi
if has dxsplit; then
    # The dx GEMM's split-K (HEADKL_DX_SPLIT) at shape A on the production
    # GLSL tiles and on the WGSL kernels: 1 (no split) against auto, 2, 3, 4.
    for gemm in glsl wgsl; do
        # Named either way: the tune cache may hold either.
        vars="HEADKL_GEMM=logits=staged:bk64:r2:s1,dx=staged:bk32:r4:s1:pf"
        [ "$gemm" = glsl ] && vars="HEADKL_GEMM=glsl:bm128.bk64.s1"
        for split in 1 auto 2 3 4; do
            log="$out/bench-dxsplit-$gemm-$split.txt"
            env $vars HEADKL_DX_SPLIT=$split $headkl $quiet bench --backend vulkan --shape A --iters 5 --warmup 1 \
                --resident --json "$out/bench-dxsplit-$gemm-$split.json" >"$log" 2>&1
            echo "bench dxsplit $gemm $split exit=$?" | tee -a "$summary"
            grep -E "^bench: dx GEMM split|^vulkan " "$log" | tee -a "$summary"
        done
    done
fi
if has filter; then
    # Each GLSL main-loop structure's filtered dx GEMM (one stage, two, two
    # interleaved, warp-specialised at two and four stages), through the
    # suite's filtered kernel cases and the filter's head_kl cases.
    while IFS='|' read -r label vars; do
        log="$out/check-filter-$label.txt"
        env $vars HEADKL_REQUIRE=vulkan $headkl $quiet check --backend vulkan --cases 4 >"$log" 2>&1
        echo "check filter $label exit=$? $(grep -E "^\s*vulkan " "$log" | tail -n 1)" | tee -a "$summary"
    done <<'LIST'
s1|HEADKL_GEMM=glsl:bm128.bk64.s1
s2|HEADKL_GEMM=glsl:bm128.bk32.s2
s2i|HEADKL_GEMM=glsl:bm128.bk32.s2.i
ws2|HEADKL_GEMM=glsl:bm128.bk32.s2.ws
ws4|HEADKL_GEMM=glsl:bm128.bk16.s4.ws
bm64|HEADKL_GEMM=glsl:bm64.bk32.s1
wgsl|HEADKL_GEMM=logits=staged:bk64:r2:s1,dx=staged:bk32:r4:s1:pf
direct|HEADKL_GEMM=direct
LIST
    # label | shape | extra arguments
    while IFS='|' read -r label shape extra; do
        log="$out/bench-filter-$label.txt"
        HEADKL_TRACE=1 $headkl $quiet bench --backend vulkan --shape $shape --iters 5 --warmup 1 --data lm $extra \
            --json "$out/bench-filter-$label.json" >"$log" 2>&1
        echo "bench filter $label exit=$?" | tee -a "$summary"
        grep -E "^(vulkan|trace) |^bench: (lm|dx block|  )" "$log" | tee -a "$summary"
    done <<'LIST'
A-off|A|
A-auto|A|--filter-eps auto
A-auto-prior|A|--filter-eps auto --vocab-order prior
S-auto-prior|S|--filter-eps auto --vocab-order prior
M-auto-prior|M|--filter-eps auto --vocab-order prior
LIST
fi
if has wgmma; then
    PYTHONUNBUFFERED=1 python3 scripts/wgmma_cuda.py >"$out/wgmma-cuda.txt" 2>&1
    echo "wgmma cuda exit=$?" | tee -a "$summary"
    grep -E "^cases|^time|FAIL|err" "$out/wgmma-cuda.txt" | tee -a "$summary"
    while IFS='|' read -r label vars; do
        log="$out/check-wgmma-$label.txt"
        env $vars HEADKL_REQUIRE=vulkan $headkl $quiet check --backend vulkan --cases "$cases" >"$log" 2>&1
        echo "check wgmma $label exit=$? $(grep -E "^\s*vulkan " "$log" | tail -n 1)" | tee -a "$summary"
        grep -iE "error|fail|lost" "$log" | head -n 5 | tee -a "$summary"
    done <<'LIST'
bm64-bk32|HEADKL_GEMM=wgmma:bm64.bk32.s3
bm64-bk64|HEADKL_GEMM=wgmma:bm64.bk64.s1
bm128|HEADKL_GEMM=wgmma:bm128.bk32.s2
bulk|HEADKL_GEMM=wgmma:bulk.bm64.bn256.bk16.s4
mixed|HEADKL_GEMM=logits=wgmma:bm64.bk64.s1,dx=glsl:bm128.bk64.s1
LIST
    for shape in $shapes; do
        for gemm in default glsl:bm128.bk64.s1 wgmma:bm64.bk32.s3 wgmma:bm64.bk64.s1 wgmma:bm128.bk32.s2 \
            wgmma:bulk.bm64.bn256.bk16.s4; do
            vars=""
            [ "$gemm" = default ] || vars="HEADKL_GEMM=$gemm"
            log="$out/bench-wgmma-$shape-${gemm//[:.]/_}.txt"
            env $vars $headkl $quiet bench --backend vulkan --shape $shape --iters 5 --warmup 1 \
                --json "${log%.txt}.json" >"$log" 2>&1
            echo "bench wgmma $shape $gemm exit=$?" | tee -a "$summary"
            grep -E "^vulkan |gemm_(logits|dx)" "$log" | tee -a "$summary"
        done
    done
fi
if has divergence; then
    for shape in $shapes; do
        for divergence in forward reverse jsd; do
            log="$out/bench-divergence-$shape-$divergence.txt"
            $headkl $quiet bench --backend vulkan --shape $shape --iters 5 --warmup 1 --resident \
                --divergence $divergence --json "${log%.txt}.json" >"$log" 2>&1
            echo "bench divergence $shape $divergence exit=$?" | tee -a "$summary"
            grep -E "^vulkan " "$log" | tee -a "$summary"
        done
    done
    PYTHONUNBUFFERED=1 python3 .anchors/peers.py --shapes "$(echo $shapes | tr ' ' ,)" --variants liger_kl,liger_jsd \
        2>&1 | tee "$out/peers-divergence.txt" | grep -v Warning | tee -a "$summary"
fi
if has fullvocab; then
    # The teacher's hs: the student's (the shape's), and 4096 at S.
    for run in $(for shape in $shapes; do
                     case $shape in A) echo A:5120;; B) echo B:4096;; S) echo S:896 S:4096;; M) echo M:2048;; esac
                 done); do
        shape=${run%%:*} ths=${run##*:}
        log="$out/bench-fullvocab-$shape-$ths.txt"
        $headkl $quiet bench --backend vulkan --shape $shape --iters 5 --warmup 1 --teacher-hs $ths \
            --divergence jsd --beta 0.5 --json "${log%.txt}.json" >"$log" 2>&1
        echo "bench fullvocab $shape teacher hs $ths exit=$?" | tee -a "$summary"
        grep -E "^vulkan " "$log" | tee -a "$summary"
    done
    PYTHONUNBUFFERED=1 python3 .anchors/peers.py --shapes "$(echo $shapes | tr ' ' ,)" --variants liger_jsd \
        2>&1 | tee "$out/peers-fullvocab.txt" | grep -v Warning | tee -a "$summary"
    case " $shapes " in *" S "*)
        PYTHONUNBUFFERED=1 python3 .anchors/peers.py --shapes S --variants liger_jsd --teacher-hs 4096 \
            2>&1 | tee "$out/peers-fullvocab-S-4096.txt" | grep -v Warning | tee -a "$summary";;
    esac
fi
if has ce; then
    for shape in $shapes; do
        log="$out/bench-ce-$shape.txt"
        $headkl $quiet bench --backend vulkan --shape $shape --iters 5 --warmup 1 --resident \
            --soft-weight 0 --hard-weight 1 --labels random --json "${log%.txt}.json" >"$log" 2>&1
        echo "bench ce $shape exit=$?" | tee -a "$summary"
        grep -E "^vulkan " "$log" | tee -a "$summary"
    done
    PYTHONUNBUFFERED=1 python3 .anchors/peers.py --shapes "$(echo $shapes | tr ' ' ,)" \
        --variants cce_ce,liger_ce,compiled_ce 2>&1 | tee "$out/peers-ce.txt" | grep -v Warning | tee -a "$summary"
fi
if has torch; then
    # The Python package (a wheel built here, `pip wheel --no-deps -w .wheel
    # ./python`, carried in .wheel): its tests with both GPU backends
    # required, the zero-copy CUDA ones among them; the example on CUDA
    # tensors; then the loss from PyTorch on CUDA tensors at each shape
    # beside the Rust device-resident path, Liger's fused linear KL and
    # torch.compile, and at A with 32768 tokens.
    pydir=/tmp/headkl-python
    mkdir -p "$pydir" && python3 -m zipfile -e .wheel/*.whl "$pydir"
    HEADKL_REQUIRE=cuda,vulkan,wgpu PYTHONPATH="$pydir:$PWD/python/tests" python3 -m pytest -q -p no:cacheprovider \
        python/tests 2>&1 | tee "$out/torch-tests.txt" | tail -n 3 | tee -a "$summary"
    PYTHONPATH="$pydir" python3 python/examples/distill.py --headkl "$headkl" --device cuda --backend vulkan \
        2>&1 | tee "$out/torch-distill.txt" | tail -n 1 | tee -a "$summary"
    for shape in $shapes; do
        $headkl $quiet bench --backend vulkan --shape $shape --iters 5 --warmup 1 --resident 2>&1 \
            | grep -E "^vulkan .*head_kl \(resident\)" | tee -a "$summary"
    done
    for backend in cuda vulkan; do
        PYTHONUNBUFFERED=1 PYTHONPATH="$pydir" python3 python/examples/bench_cuda.py --backend $backend \
            --shapes "$(echo $shapes | tr ' ' ,)" 2>&1 | grep -v Warning | sed "s/^/$backend /" \
            | tee -a "$out/torch-bench.txt" | tee -a "$summary"
    done
    PYTHONUNBUFFERED=1 PYTHONPATH="$pydir" python3 python/examples/bench_cuda.py --shapes A --ntok 32768 --iters 3 \
        2>&1 | grep -v Warning | tee -a "$out/torch-bench.txt" | tee -a "$summary"
    PYTHONUNBUFFERED=1 python3 .anchors/peers.py --shapes "$(echo $shapes | tr ' ' ,)" --variants liger_kl \
        2>&1 | grep -v Warning | tee "$out/torch-peers.txt" | tee -a "$summary"
    PYTHONUNBUFFERED=1 python3 .anchors/torch_head_kl.py --shapes "$(echo $shapes | tr ' ' ,)" --variants compiled \
        2>&1 | grep -v Warning | tee -a "$out/torch-peers.txt" | tee -a "$summary"
fi
if has peers; then
    PYTHONUNBUFFERED=1 python3 .anchors/peers.py --shapes "$(echo $shapes | tr ' ' ,)" 2>&1 \
        | tee "$out/peers.txt" | grep -v Warning | tee -a "$summary"
fi
if has anchors; then
    PYTHONUNBUFFERED=1 python3 .anchors/torch_head_kl.py --shapes "$(echo $shapes | tr ' ' ,)" \
        --variants floor,compiled,teacher_topk 2>&1 | tee "$out/anchors.txt" | grep -v Warning | tee -a "$summary"
fi
if has cublas; then
    python3 scripts/cublas_gemm.py 2>&1 | grep -v Warning | tee "$out/cublas.txt" | tee -a "$summary"
fi
echo "=== summary"; cat "$summary"
# What comes back: the summary, the devices table, the plot and every log in one archive.
if [ -n "${OUT:-}" ]; then
    cp "$summary" "$OUT/" 2>/dev/null
    cp "$out"/*.svg "$OUT/" 2>/dev/null
    tar czf "$OUT/logs.tgz" -C "$out" .
fi
