#!/usr/bin/env python3
"""The CUDA twin of headkl's default Vulkan GEMM tile.

Compiles scripts/cuda_twin/twin.cu (nvcc for sm_90a; NVRTC from the CUDA
wheels PyTorch ships if no nvcc works), loads it through the CUDA driver API
(ctypes), checks every variant against a float64 matmul on a small shape,
then times it at the ceiling report's shape beside cuBLAS (torch.matmul, f16)
in the same process, and prints one table:

    variant, layout, ms, TFLOP/s, % of cuBLAS, registers, shared memory, CTAs/SM, check

Variants (twin.cu says how each is built):
    twin      the default tile glsl:bm128.bk64.s1 as CUDA: global -> registers
              -> shared (static, 36 KiB, one stage) -> ldmatrix -> mma.sync
    async_s2  the same tile, cp.async into a 2-stage ring (72 KiB dynamic
              shared memory: above Vulkan's 48 KiB)
    async_s3  3 stages (108 KiB dynamic)
    twin8     the twin with 8 warps of 64 x 32 (256 threads), <= 255 registers
    twin8x2   the same held to 128 registers (two CTAs an SM)
Layouts, as headkl's ceiling report times them (m:n:k = --shape, default
4096:124160:5120):
    logits    C[m][n] = x[m][k] * W[n][k]^T
    dx        C[m][k] = g[m][n] * W[n][k]   (the kernel's n is hs, its k the vocabulary)

With --headkl PATH it then runs `PATH --quiet tune --backend vulkan --ceiling`
(the Vulkan loader must be set up: scripts/h200.sh does it) and adds its (a)
row and its (e) rows for the default tile and the current GEMM to the table.

A variant that computes a wrong result, fails to load or launch, or hangs is
reported in its row (FAILED ...) and the others still run; the exit status is
1 if any variant failed. --quick: fewer timing rounds, no second cuBLAS pass.
--compile-only: compile and report registers (no GPU, no torch needed).
emulate.py beside this file checks twin.cu's addressing and fragment layouts
on the CPU (NumPy), modelling ldmatrix and mma.sync as the PTX ISA documents
them.
"""
import argparse
import ctypes
import glob
import json
import os
import re
import shutil
import site
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "twin.cu")

BM, BN, BK = 128, 128, 64
# Words (16 bytes) of one shared stage: A [128][9], B [128][9] (nt) or [64][17] (nn).
STAGE_BYTES = {"nt": (128 * 9 + 128 * 9) * 16, "nn": (128 * 9 + 64 * 17) * 16}
LAYOUT_CODE = {"logits": "nt", "dx": "nn"}
# name -> (kernel name pattern, threads, stages, dynamic shared memory, description)
VARIANTS = {
    "twin": ("twin_{code}_s1", 128, 1, False, "the GLSL tile as CUDA: 4 warps, no cp.async"),
    "async_s2": ("async_{code}_s2", 128, 2, True, "cp.async, 2 stages (dynamic smem)"),
    "async_s3": ("async_{code}_s3", 128, 3, True, "cp.async, 3 stages (dynamic smem)"),
    "twin8": ("twin8_{code}_s1", 256, 1, False, "8 warps of 64x32, <= 255 registers"),
    "twin8x2": ("twin8x2_{code}_s1", 256, 1, False, "8 warps of 64x32, <= 128 registers"),
}
CHECK_REL = 2e-4  # |C - ref| / (|a|.|b|): f32 accumulation stays far below
HANG_S = 60.0


def log(msg):
    print(msg, flush=True)


# ---------------------------------------------------------------- compiling


def candidate_dirs():
    """Roots where CUDA toolkits or NVIDIA's wheels may live."""
    roots = []
    for d in list(sys.path) + site.getsitepackages() + [site.getusersitepackages()]:
        if d and os.path.isdir(os.path.join(d, "nvidia")):
            roots.append(os.path.join(d, "nvidia"))
    return roots


def find_nvcc():
    found = [os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    found += sorted(glob.glob("/usr/local/cuda-*/bin/nvcc"), reverse=True)
    for root in candidate_dirs():
        found += sorted(glob.glob(os.path.join(root, "*", "bin", "nvcc")), reverse=True)
    seen = []
    for f in found:
        if f and os.path.isfile(f) and os.access(f, os.X_OK) and f not in seen:
            seen.append(f)
    return seen


def find_nvrtc():
    found = []
    for root in candidate_dirs():
        found += sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*")), reverse=True)
    found += sorted(glob.glob("/usr/local/cuda*/lib64/libnvrtc.so*"), reverse=True)
    found += ["libnvrtc.so"]
    return [f for f in found if "builtins" not in f and "alt" not in os.path.basename(f)]


def parse_ptxas(text):
    """ptxas -v lines -> {kernel: 'regs N, spill S/L, smem B'}."""
    out, name = {}, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            out.setdefault(name, {})["spill"] = f"{m.group(1)}/{m.group(2)}"
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            out.setdefault(name, {})["regs"] = int(m.group(1))
    return out


def compile_nvcc(nvcc, arch, build_dir):
    cubin = os.path.join(build_dir, "twin.cubin")
    cmd = [nvcc, f"-arch={arch}", "-cubin", "-O3", "-std=c++17", "--ptxas-options=-v", "-o", cubin, SOURCE]
    log("twin: " + " ".join(cmd))
    p = subprocess.run(cmd, capture_output=True, text=True)
    text = p.stdout + p.stderr
    if p.returncode != 0:
        raise RuntimeError(f"nvcc exit {p.returncode}:\n{text[-4000:]}")
    with open(cubin, "rb") as f:
        return f.read(), text


def compile_nvrtc(lib_path, arch):
    lib = ctypes.CDLL(lib_path)
    prog = ctypes.c_void_p()
    with open(SOURCE, "rb") as f:
        src = f.read()

    def ck(res, what):
        if res != 0:
            lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what}: {lib.nvrtcGetErrorString(res).decode()}")

    ck(lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"twin.cu", 0, None, None), "nvrtcCreateProgram")
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", b"--ptxas-options=-v"]
    res = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    text = buf.value.decode(errors="replace")
    ck(res, "nvrtcCompileProgram:\n" + text[-4000:])
    ck(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
    image = ctypes.create_string_buffer(size.value)
    ck(lib.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return image.raw, text


def compile_and_save(args, prefer):
    """Compiles, reports registers, and keeps the image for child processes."""
    image, _, ptxas = compile_twin(args.arch, args.build_dir, prefer)
    args.cubin = os.path.join(args.build_dir, "twin.image")
    with open(args.cubin, "wb") as f:
        f.write(image)
    for name, info in sorted(ptxas.items()):
        log(f"twin: {name}: {info.get('regs')} registers, spill stores/loads {info.get('spill', '?')} bytes")
    return image


def compile_twin(arch, build_dir, prefer):
    """Returns (cubin bytes, compiler name, ptxas info)."""
    os.makedirs(build_dir, exist_ok=True)
    errors = []
    tools = [("nvcc", p) for p in find_nvcc()] + [("nvrtc", p) for p in find_nvrtc()]
    if prefer == "nvrtc":
        tools.sort(key=lambda t: t[0] != "nvrtc")
    for kind, path in tools:
        try:
            if kind == "nvcc":
                image, text = compile_nvcc(path, arch, build_dir)
            else:
                image, text = compile_nvrtc(path, arch)
        except (OSError, RuntimeError) as e:
            errors.append(f"{kind} {path}: {e}")
            continue
        log(f"twin: compiled with {kind} ({path}), {len(image)} bytes")
        for line in text.splitlines():
            if "Used" in line or "spill" in line or "entry function" in line or "error" in line:
                log("  " + line.strip())
        return image, f"{kind} {path}", parse_ptxas(text)
    raise RuntimeError("no compiler worked:\n" + "\n".join(errors))


# ---------------------------------------------------------------- the driver API


class CudaError(RuntimeError):
    pass


class Driver:
    FUNC_SHARED = 1
    FUNC_LOCAL = 3
    FUNC_REGS = 4
    FUNC_MAX_DYN_SHARED = 8
    FUNC_CARVEOUT = 9

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_void_p,
        ]
        self.lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
        self.lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        self.lib.cuFuncGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_void_p]
        self.lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        self.lib.cuOccupancyMaxActiveBlocksPerMultiprocessor.argtypes = [
            ctypes.POINTER(ctypes.c_int),
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_size_t,
        ]

    def check(self, res, what):
        if res != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(res, ctypes.byref(name))
            raise CudaError(f"{what}: {name.value.decode() if name.value else res}")

    def load(self, image):
        mod = ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(mod), image), "cuModuleLoadData")
        return mod

    def function(self, mod, name):
        fn = ctypes.c_void_p()
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), f"cuModuleGetFunction {name}")
        return fn

    def attr(self, fn, a):
        v = ctypes.c_int()
        self.check(self.lib.cuFuncGetAttribute(ctypes.byref(v), a, fn), "cuFuncGetAttribute")
        return v.value

    def set_attr(self, fn, a, value):
        self.check(self.lib.cuFuncSetAttribute(fn, a, value), f"cuFuncSetAttribute {a}={value}")

    def occupancy(self, fn, threads, dyn_smem):
        v = ctypes.c_int()
        self.check(
            self.lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(v), fn, threads, dyn_smem),
            "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        )
        return v.value

    def launch(self, fn, grid, threads, dyn_smem, stream, args):
        holders = [ctypes.c_void_p(a.data_ptr()) if hasattr(a, "data_ptr") else ctypes.c_int(a) for a in args]
        params = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
        self.check(
            self.lib.cuLaunchKernel(fn, grid, 1, 1, threads, 1, 1, dyn_smem, stream, params, None), "cuLaunchKernel"
        )


# ---------------------------------------------------------------- running


class Hang(RuntimeError):
    pass


def wait(torch, seconds):
    """Waits for the current stream, raising Hang after `seconds`."""
    ev = torch.cuda.Event()
    ev.record()
    deadline = time.time() + seconds
    while not ev.query():
        if time.time() > deadline:
            raise Hang(f"no completion within {seconds:.0f} s")
        time.sleep(0.0005)
    torch.cuda.synchronize()


class Kernel:
    def __init__(self, drv, mod, variant, layout):
        pattern, self.threads, self.stages, self.dynamic, self.describe = VARIANTS[variant]
        self.name = pattern.format(code=LAYOUT_CODE[layout])
        self.drv = drv
        self.fn = drv.function(mod, self.name)
        self.dyn = self.stages * STAGE_BYTES[LAYOUT_CODE[layout]] if self.dynamic else 0
        if self.dynamic:
            drv.set_attr(self.fn, Driver.FUNC_MAX_DYN_SHARED, self.dyn)
            drv.set_attr(self.fn, Driver.FUNC_CARVEOUT, 100)
        self.regs = drv.attr(self.fn, Driver.FUNC_REGS)
        self.local = drv.attr(self.fn, Driver.FUNC_LOCAL)
        self.smem = drv.attr(self.fn, Driver.FUNC_SHARED) + self.dyn
        self.ctas = drv.occupancy(self.fn, self.threads, self.dyn)

    def __call__(self, torch, a, b, c, m, n, k, lda, ldb, ldc):
        for v, what in [(m, "m"), (n, "n"), (k, "k")]:
            if v % {"m": BM, "n": BN, "k": BK}[what] != 0:
                raise ValueError(f"{what}={v} is not a multiple of the tile")
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        grid = (m // BM) * (n // BN)
        self.drv.launch(self.fn, grid, self.threads, self.dyn, stream, [a, b, c, m, n, k, lda, ldb, ldc])


def operands(torch, layout, m, n, k, seed):
    """(a, b, kernel m, n, k, lda, ldb, ldc) for C = a * op(b), f16 in [-1, 1)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(r, c):
        return torch.rand(r, c, device="cuda", generator=gen, dtype=torch.float16) * 2 - 1

    if layout == "logits":
        a, b = rand(m, k), rand(n, k)  # x[m][k], W[n][k]
        return a, b, (m, n, k, k, k, n)
    a, b = rand(m, n), rand(n, k)  # g[m][n], W[n][k]: C[m][k]
    return a, b, (m, k, n, n, k, k)


def reference(torch, layout, a, b, rows=None, cols=None):
    """float64 C and Σ|a·b| (for a relative error), optionally at rows x cols."""
    a64 = a.double() if rows is None else a[rows].double()
    if layout == "logits":
        b64 = b.double() if cols is None else b[cols].double()
        b64 = b64.t()
    else:
        b64 = b.double() if cols is None else b[:, cols].double()
    return a64 @ b64, a64.abs() @ b64.abs()


def check_small(torch, kern, layout, shape):
    m, n, k = shape
    a, b, (km, kn, kk, lda, ldb, ldc) = operands(torch, layout, m, n, k, seed=7)
    c = torch.full((km, kn), float("nan"), device="cuda", dtype=torch.float32)
    kern(torch, a, b, c, km, kn, kk, lda, ldb, ldc)
    wait(torch, 20)
    want, scale = reference(torch, layout, a, b)
    err = (c.double() - want).abs()
    rel = (err / scale.clamp_min(1e-300)).max().item()
    rel_max = (err.max() / want.abs().max()).item()
    bad = int((~torch.isfinite(c)).sum().item())
    ok = bad == 0 and rel <= CHECK_REL
    worst = torch.argmax(torch.nan_to_num(err, nan=float("inf"))).item()
    where = f" (worst at [{worst // kn}][{worst % kn}])" if not ok else ""
    return ok, f"{m}:{n}:{k} rel {rel:.1e} (of max|C| {rel_max:.1e}), {bad} non-finite{where}"


def sampled_full(torch, layout, a, b, c):
    """Rows 0, m/2, m-1 x 16 columns (the last included) against float64;
    and no NaN left anywhere (C is NaN-filled before the run)."""
    km, kn = c.shape
    rows = torch.tensor([0, km // 2, km - 1], device="cuda")
    cols = torch.tensor([(s * 7919 + 31) % kn for s in range(15)] + [kn - 1], device="cuda")
    want, scale = reference(torch, layout, a, b, rows, cols)
    got = c[rows][:, cols].double()
    rel = ((got - want).abs() / scale.clamp_min(1e-300)).max().item()
    nans = int(torch.isnan(c).sum().item())
    ok = nans == 0 and rel <= CHECK_REL
    return ok, f"48 sampled rel {rel:.1e}, {nans} NaN"


def time_ms(torch, fn, warmup, iters):
    for _ in range(warmup):
        fn()
    wait(torch, HANG_S)
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        wait(torch, HANG_S)
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def context_alive(torch):
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
        return True
    except Exception:
        return False


def run_pairs(torch, drv, mod, pairs, args, full):
    """Checks and times each (variant, layout); returns rows, and the pairs
    left over if the CUDA context was lost."""
    rows = []
    tensors = {}
    for i, (variant, layout) in enumerate(pairs):
        row = {"variant": variant, "layout": layout, "describe": VARIANTS[variant][4]}
        try:
            kern = Kernel(drv, mod, variant, layout)
            row.update(
                kernel=kern.name, regs=kern.regs, local=kern.local, smem=kern.smem, ctas=kern.ctas
            )
            ok, text = check_small(torch, kern, layout, args.check_shape)
            row["check"] = text
            if not ok:
                row["error"] = "FAILED check: " + text
                log(f"twin: {kern.name}: {row['error']}")
                rows.append(row)
                continue
            if layout not in tensors:
                tensors.clear()
                torch.cuda.empty_cache()
                tensors[layout] = operands(torch, layout, *full, seed=1)
            a, b, (km, kn, kk, lda, ldb, ldc) = tensors[layout]
            c = torch.full((km, kn), float("nan"), device="cuda", dtype=torch.float32)
            kern(torch, a, b, c, km, kn, kk, lda, ldb, ldc)
            wait(torch, HANG_S)
            ok, text = sampled_full(torch, layout, a, b, c)
            row["check"] += "; " + text
            if not ok:
                row["error"] = "FAILED full-shape check: " + text
            row["ms"] = time_ms(
                torch, lambda: kern(torch, a, b, c, km, kn, kk, lda, ldb, ldc), args.warmup, args.iters
            )
            c = None  # its 2 GB go before the next layout's operands
            log(f"twin: {kern.name}: {row['ms']:.3f} ms, {kern.regs} registers, {kern.ctas} CTAs/SM; {row['check']}")
        except Hang as e:
            row["error"] = f"FAILED: hung ({e})"
            rows.append(row)
            log(f"twin: {variant} {layout}: {row['error']}; the GPU is stuck, stopping here")
            return rows, None
        except Exception as e:  # a launch or device error: report, go on
            row["error"] = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            log(f"twin: {variant} {layout}: {row['error']}")
            rows.append(row)
            if not context_alive(torch):
                log("twin: the CUDA context is lost; the remaining variants run in a fresh process")
                return rows, pairs[i + 1 :]
            continue
        rows.append(row)
    tensors.clear()
    return rows, []


def run_child(pairs, args):
    """Runs `pairs` in a fresh process (after a lost context); returns rows."""
    if not pairs:
        return []
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--cubin", args.cubin]
    cmd += ["--pairs", ",".join(f"{v}:{l}" for v, l in pairs), "--shape", args.shape]
    cmd += ["--check-shape", ":".join(map(str, args.check_shape))]
    cmd += ["--iters", str(args.iters), "--warmup", str(args.warmup)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    rows = []
    for line in p.stdout.splitlines():
        if line.startswith("TWIN-ROW "):
            rows.append(json.loads(line[len("TWIN-ROW ") :]))
        else:
            log("  [child] " + line)
    if p.returncode != 0:
        for line in p.stderr.strip().splitlines()[-10:]:
            log("  [child stderr] " + line)
    done = {(r["variant"], r["layout"]) for r in rows}
    for v, l in pairs:
        if (v, l) not in done:
            rows.append({"variant": v, "layout": l, "describe": VARIANTS[v][4], "error": f"FAILED: child exit {p.returncode}"})
    return rows


def cublas_rows(torch, full, args, label):
    rows = []
    m, n, k = full
    for layout in ["logits", "dx"]:
        if layout not in args.layouts:
            continue
        a, b, _ = operands(torch, layout, m, n, k, seed=1)
        bt = b.t() if layout == "logits" else b
        row = {"variant": label, "layout": layout, "describe": "torch.matmul f16 out"}
        try:
            row["ms"] = time_ms(torch, lambda: torch.matmul(a, bt), args.warmup, args.iters)
        except Exception as e:
            row["error"] = f"FAILED: {e}"
        rows.append(row)
        if not args.quick and label == "cuBLAS":
            row = {"variant": "cuBLAS f32", "layout": layout, "describe": "torch.mm(out_dtype=float32)"}
            try:
                row["ms"] = time_ms(
                    torch, lambda: torch.mm(a, bt, out_dtype=torch.float32), args.warmup, args.iters
                )
            except Exception as e:  # older torch: no out_dtype
                row["error"] = f"n/a ({type(e).__name__})"
            rows.append(row)
        a = b = bt = None
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------- headkl


def headkl_ceiling(path, iters, shape, timeout_s):
    """Runs the Vulkan ceiling report at the twin's shape; returns rows for
    (a), the default tile's (e) and the current GEMM's (e), per layout."""
    cmd = [path, "--quiet", "tune", "--backend", "vulkan", "--ceiling", "--iters", str(iters), "--shape", shape]
    log("twin: " + " ".join(cmd))
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [{"variant": "vulkan", "layout": "-", "describe": "headkl ceiling report",
                 "error": f"FAILED: no result within --headkl-timeout {timeout_s:.0f} s (killed)"}]
    except OSError as e:
        return [{"variant": "vulkan", "layout": "-", "describe": "headkl ceiling report", "error": f"FAILED: {e}"}]
    log(f"twin: headkl ceiling exit {p.returncode} after {time.time() - t0:.0f} s")
    rows, layout = [], None
    for line in p.stdout.splitlines():
        if line.startswith("ceiling logits"):
            layout = "logits"
        elif line.startswith("ceiling dx"):
            layout = "dx"
        cells = re.split(r"\s{2,}", line.strip())
        if layout is None or len(cells) < 4:
            continue
        part, tile = cells[0], cells[1]
        try:
            ms = float(cells[2])
        except ValueError:
            continue
        label = None
        if part.startswith("(a)") and not any(r["layout"] == layout and r["variant"] == "vulkan (a)" for r in rows):
            label = "vulkan (a)"
        elif part.startswith("(e)") and tile == "bm128.bk64.s1":
            label = "vulkan bm128.bk64.s1"
        elif part.startswith("(e)") and tile.startswith("current:"):
            label = "vulkan " + tile
        if label:
            describe = "matrix units from registers" if label == "vulkan (a)" else "headkl ceiling report (e)"
            rows.append({"variant": label, "layout": layout, "describe": describe, "ms": ms,
                         "check": cells[5] if len(cells) > 5 else ""})
    if p.returncode != 0 or not rows:
        tail = (p.stdout + p.stderr).strip().splitlines()[-8:]
        rows.append({"variant": "vulkan", "layout": "-", "describe": "headkl ceiling report",
                     "error": f"FAILED exit {p.returncode}: " + " | ".join(tail)[-300:]})
    return rows


# ---------------------------------------------------------------- report


def print_table(rows, full):
    m, n, k = full
    flops = 2.0 * m * n * k
    cublas = {r["layout"]: r["ms"] for r in rows if r["variant"] == "cuBLAS" and "ms" in r}
    header = ["variant", "layout", "ms", "TFLOP/s", "% cuBLAS", "regs", "smem KiB", "CTAs/SM", "check / note"]
    lines = []
    for r in rows:
        ms = r.get("ms")
        base = cublas.get(r["layout"])
        note = r.get("error") or r.get("check", "") or r.get("describe", "")
        if r.get("local"):
            note = f"SPILLS {r['local']} B/thread; " + note
        lines.append([
            r["variant"],
            r["layout"],
            f"{ms:.3f}" if ms else "-",
            f"{flops / ms / 1e9:.1f}" if ms else "-",
            f"{100 * base / ms:.0f}%" if ms and base else "-",
            str(r.get("regs", "")),
            f"{r['smem'] / 1024:.0f}" if r.get("smem") else "",
            str(r.get("ctas", "")),
            note,
        ])
    width = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h) for i, h in enumerate(header)]
    log(f"\ntwin table: m:n:k = {m}:{n}:{k} (logits C[m][n] = x[m][k]·W[n][k]ᵀ; dx C[m][k] = g[m][n]·W[n][k]), "
        "f16 in, f32 accumulate; twin and Vulkan write f32 C, cuBLAS f16 (cuBLAS f32: f32 C)")
    log("  ".join(h.ljust(w) for h, w in zip(header, width)).rstrip())
    for l in lines:
        log("  ".join(c.ljust(w) for c, w in zip(l, width)).rstrip())


def parse_shape(s):
    v = [int(x) for x in s.split(":")]
    if len(v) != 3:
        raise argparse.ArgumentTypeError(f"{s}: expected M:N:K")
    return v


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="4096:124160:5120", help="m:n:k of the ceiling report (default %(default)s)")
    ap.add_argument("--check-shape", type=parse_shape, default=[384, 640, 1024],
                    help="small m:n:k checked against float64 (default 384:640:1024)")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="5 timed rounds, 1 warm-up, no second cuBLAS pass")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--layouts", default="logits,dx")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--compiler", choices=["auto", "nvcc", "nvrtc"], default="auto")
    ap.add_argument("--build-dir", default="/tmp/cuda_twin_build")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--headkl", help="headkl binary: also run its Vulkan ceiling report")
    ap.add_argument("--headkl-iters", type=int, default=3)
    ap.add_argument("--headkl-timeout", type=float, default=420, help="seconds for the ceiling report (%(default)s)")
    ap.add_argument("--cubin", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pairs", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.iters, args.warmup = 5, 1
    full = parse_shape(args.shape)
    args.layouts = [l for l in args.layouts.split(",") if l]
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"--variants: unknown variant {v} (known: {', '.join(VARIANTS)})")
    for l in args.layouts:
        if l not in LAYOUT_CODE:
            ap.error(f"--layouts: unknown layout {l}")

    image, problem = None, None
    if args.cubin:
        with open(args.cubin, "rb") as f:
            image = f.read()
    else:
        try:
            image = compile_and_save(args, args.compiler)
        except RuntimeError as e:
            problem = f"compiling: {e}"
            log(f"twin: FAILED {problem}")
    if args.compile_only:
        return 0 if image else 1

    import torch

    torch.cuda.init()
    torch.ones(1, device="cuda").item()  # the primary context, current on this thread
    drv = Driver()
    mod = None
    if image:
        try:
            mod = drv.load(image)
        except CudaError as e:
            problem = f"loading the module: {e}"
            if not args.child and args.compiler != "nvrtc":
                # A cubin the driver refuses (a toolkit newer than it): NVRTC
                # from PyTorch's CUDA wheels matches the runtime torch uses.
                log(f"twin: {problem}; compiling with NVRTC instead")
                try:
                    mod = drv.load(compile_and_save(args, "nvrtc"))
                    problem = None
                except (RuntimeError, CudaError) as e2:
                    problem += f"; with NVRTC first: {e2}"
    if args.child:
        pairs = [tuple(p.split(":")) for p in args.pairs.split(",")]
        rows, rest = run_pairs(torch, drv, mod, pairs, args, full)
        rows += run_child(rest or [], args)
        for r in rows:
            print("TWIN-ROW " + json.dumps(r), flush=True)
        return 0

    log(f"twin: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}; "
        f"m:n:k {args.shape}, median of {args.iters} after {args.warmup} warm-up")
    rows = cublas_rows(torch, full, args, "cuBLAS")
    pairs = [(v, l) for v in variants for l in args.layouts]
    if mod is None:
        log(f"twin: FAILED {problem}: no variant runs; cuBLAS and headkl still do")
        twin_rows = [
            {"variant": v, "layout": l, "describe": VARIANTS[v][4], "error": f"FAILED {problem}"[:300]}
            for v, l in pairs
        ]
        rest = []
    else:
        twin_rows, rest = run_pairs(torch, drv, mod, pairs, args, full)
    rows += twin_rows
    if rest is None:  # hung: the device is stuck
        print_table(rows, full)
        sys.stdout.flush()
        os._exit(3)
    if rest:
        rows += run_child(rest, args)
    elif not args.quick:
        rows += cublas_rows(torch, full, args, "cuBLAS again")
    if args.headkl:
        # The CUDA figures first, in case the ceiling outlasts the call.
        print_table(rows, full)
        torch.cuda.empty_cache()
        rows += headkl_ceiling(args.headkl, args.headkl_iters, args.shape, args.headkl_timeout)
    print_table(rows, full)
    failed = [r for r in rows if str(r.get("error", "")).startswith("FAILED") and not r["variant"].startswith("vulkan")]
    if failed:
        log(f"twin: {len(failed)} variant(s) FAILED: " + ", ".join(f"{r['variant']} {r['layout']}" for r in failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
