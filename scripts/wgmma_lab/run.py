#!/usr/bin/env python3
"""The research tiles of scripts/wgmma_lab/bulk.cu (wgmma fed by bulk copies
from pre-tiled operands), not shipped: checked against torch on exact small
integers (C poisoned with NaN, shapes off the tiles), then timed against
cuBLAS at the shapes scripts/wgmma_cuda.py times the shipped tiles.

  python3 scripts/wgmma_lab/run.py compile     here: NVRTC (pinned, as
      scripts/ptx.py) -> target/lab/bulk.ptx, then ptxas -v when
      PTXAS names one (registers, spills, shared memory)
  python3 scripts/wgmma_lab/run.py [TILE ...]  on the GPU (torch, libcuda):
      loads target/lab/bulk.ptx; TILE as m128n256k16s3 (default: all)
"""
import ctypes as C
import os
import re
import struct
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PTX = os.path.join(ROOT, "target", "lab", "bulk.ptx")
# Families: m… a producer warp and NC warpgroups; persist_ solo (the
# shipped bulk tile, shaders/gemm_wgmma.cu) over several tiles a block;
# duo_ two warpgroups, thread 0 copies; blocked_ 8 x 8 core matrices
# without a swizzle; async_ solo's pipeline with per-thread cp.async from
# row-major operands. Solo and gather are timed no more (row 53 has their
# figures; solo is headkl's `wgmma:bulk.*` tile, forced through HEADKL_GEMM).
TILES = ["m128n256k16s3", "m128n128k32s2", "m128n128k16s5", "m64n256k16s4", "m64n128k32s3", "m64n128k16s6",
         "persist_m64n256k16s4", "persist_m64n256k16s3", "persist_m64n128k32s3",
         "duo_m128n256k16s3", "duo_m128n128k16s5", "duo_m128n128k32s2",
         "blocked_m64n256k16s4", "blocked_m64n256k16s3", "blocked_m64n256k32s2",
         "async_m64n256k16s4", "async_m64n256k32s2", "async_m64n128k32s3"]


def compile_lab():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import ptx  # noqa: E402  (the shipped tiles' pinned NVRTC)

    source = open(os.path.join(ROOT, "shaders", "gemm_wgmma.cu"), "rb").read()
    source += open(os.path.join(ROOT, "scripts", "wgmma_lab", "bulk.cu"), "rb").read()
    os.makedirs(os.path.dirname(PTX), exist_ok=True)
    with open(PTX, "wb") as f:
        f.write(ptx.compile_ptx(source))
    print("wrote", PTX)
    if os.environ.get("PTXAS"):
        out = subprocess.run([os.environ["PTXAS"], "-arch=sm_90a", "-v", PTX, "-o", PTX + ".cubin"],
                             capture_output=True, text=True)
        for line in (out.stdout + out.stderr).splitlines():
            if "lab_" in line or "Used" in line or "spill" in line or "error" in line:
                print(line)
        out.check_returncode()


if sys.argv[1:2] == ["compile"]:
    compile_lab()
    sys.exit(0)

import torch  # noqa: E402

cuda = C.CDLL("libcuda.so.1")


def ok(status, what):
    if status != 0:
        name = C.c_char_p()
        cuda.cuGetErrorName(status, C.byref(name))
        sys.exit("%s: %s" % (what, name.value.decode()))


torch.zeros(1, device="cuda")
module = C.c_void_p()
ok(cuda.cuModuleLoadData(C.byref(module), open(PTX, "rb").read() + b"\0"), "cuModuleLoadData")
FIELDS = "m n k a_offset lda ldb c_offset ldc alpha accumulate grid_x k_parts k_part c_part_stride stats_offset stats_ld stats_first stats_cols mask_rows mask_ld".split()
functions = {}


def function(name):
    if name not in functions:
        fn = C.c_void_p()
        ok(cuda.cuModuleGetFunction(C.byref(fn), module, name.encode()), name)
        functions[name] = fn
    return functions[name]


def launch(name, grid, threads, args):
    """args: ctypes scalars, or a string buffer holding a parameter block."""
    ptrs = (C.c_void_p * len(args))(*[C.cast(x, C.c_void_p) if isinstance(x, C.Array) else
                                      C.cast(C.pointer(x), C.c_void_p) for x in args])
    stream = torch.cuda.current_stream().cuda_stream
    ok(cuda.cuLaunchKernel(function(name), grid[0], grid[1], 1, threads, 1, 1, 0, C.c_void_p(stream), ptrs, None),
       name)


def shape_of(tile):
    m, n, k, s = map(int, re.fullmatch(r"(?:blocked_|persist_|duo_|async_)?m(\d+)n(\d+)k(\d+)s(\d+)", tile).groups())
    return m, n, k, s


def pretile(src, rows, kdim, ld, tile_rows, bk, nmajor, steps=None):
    """src (f16, [rows][k] or for nmajor [k][rows]) in the tiles' order."""
    tiles = -(-rows // tile_rows)
    steps = steps or -(-kdim // bk)
    dst = torch.empty(tiles * tile_rows * steps * bk, dtype=torch.float16, device="cuda")
    chunks = tiles * tile_rows * steps * bk // 8
    name = "pretile_r%d_k%d_%s" % (tile_rows, bk, "true" if nmajor else "false")
    args = [C.c_uint64(src.data_ptr()), C.c_uint64(dst.data_ptr())] + [C.c_uint32(v) for v in (rows, kdim, ld, tiles, steps)]
    launch(name, (-(-chunks // 256), 1), 256, args)
    return dst


def run_tile(entry, tile, nn, at, bt, c, m, n, k, flags=0):
    bm, bn, bk, _ = shape_of(tile)
    tiles = -(-m // bm) * -(-n // bn)
    gx = min(tiles, 65535)
    if tile.startswith("persist"):
        # blocks an SM (launch bounds) x the SMs
        gx = min(tiles, (3 if bn == 256 else 4) * 132)
    vals = dict(m=m, n=n, k=k, lda=k, ldb=(n if nn else k), ldc=n, alpha=1.0, grid_x=gx, k_parts=1, k_part=k, mask_rows=flags)
    blob = C.create_string_buffer(struct.pack("<8If11I", *[vals.get(f, 0) for f in FIELDS]), 80)
    gy = 1 if tile.startswith("persist") else -(-tiles // gx)
    launch(entry, (gx, gy), 128 * (bm // 64) + (0 if tile.startswith(("blocked", "persist", "duo", "async")) else 32),
           [blob, C.c_uint64(at.data_ptr()), C.c_uint64(bt.data_ptr()), C.c_uint64(c.data_ptr())])


def blocked(src, rows, cols, prows, pcols):
    dst = torch.empty(prows * pcols, dtype=torch.float16, device="cuda")
    chunks = prows * pcols // 8
    args = [C.c_uint64(src.data_ptr()), C.c_uint64(dst.data_ptr())] + [C.c_uint32(v) for v in (rows, cols, cols, prows, pcols)]
    launch("pretile_blocked", (-(-chunks // 256), 1), 256, args)
    return dst


def up(x, q):
    return -(-x // q) * q


def operands(tile, nn, a, b, m, n, k):
    bm, bn, bk, _ = shape_of(tile)
    if tile.startswith("async"):
        return a, b  # row-major, as stored today
    if tile.startswith("blocked"):
        at = blocked(a, m, k, up(m, bm), up(k, bk))
        bt = blocked(b, k, n, up(k, bk), up(n, bn)) if nn else blocked(b, n, k, up(n, bn), up(k, bk))
        return at, bt
    at = pretile(a, m, k, k, bm, bk, False)
    bt = pretile(b, n, k, n if nn else k, bn, bk, nn)
    return at, bt


def case(tile, nn, m, n, k, flags=0):
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n * 3 + k)
    a = torch.randint(-3, 4, (m, k), device="cuda", generator=g).half()
    b = torch.randint(-3, 4, ((k, n) if nn else (n, k)), device="cuda", generator=g).half()
    ref = a.float() @ (b.float() if nn else b.float().t())
    at, bt = operands(tile, nn, a, b, m, n, k)
    c = torch.full((m * n,), float("nan"), device="cuda")
    entry = "lab_%s_%s" % ("dx" if nn else "logits", tile)
    run_tile(entry, tile, nn, at, bt, c, m, n, k, flags)
    torch.cuda.synchronize()
    err = (c.view(m, n) - ref).abs().max().item()
    good = err <= 1e-3 * max(1.0, ref.abs().max().item())
    print("%-26s m%d n%d k%d flags %d: %s" % (entry, m, n, k, flags, "ok" if good else "max |err| %s" % err), flush=True)
    return good


def timing(tile, nn, m, n, k, flags=0):
    a = torch.randn(m, k, device="cuda").half()
    b = torch.randn(*((k, n) if nn else (n, k)), device="cuda").half()
    c = torch.empty(m * n, device="cuda")
    entry = "lab_%s_%s" % ("dx" if nn else "logits", tile)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    at, bt = operands(tile, nn, a, b, m, n, k)
    t1.record()
    torch.cuda.synchronize()
    pre = t0.elapsed_time(t1)
    for _ in range(3):
        run_tile(entry, tile, nn, at, bt, c, m, n, k, flags)
    t0.record()
    for _ in range(10):
        run_tile(entry, tile, nn, at, bt, c, m, n, k, flags)
    t1.record()
    torch.cuda.synchronize()
    ms = t0.elapsed_time(t1) / 10
    bm_ = b if nn else b.t()
    for _ in range(3):
        torch.matmul(a, bm_)
    t0.record()
    for _ in range(10):
        torch.matmul(a, bm_)
    t1.record()
    torch.cuda.synchronize()
    ref = t0.elapsed_time(t1) / 10
    flop = 2.0 * m * n * k
    print("time %-26s %d:%d:%d: %.3f ms %.0f TFLOP/s (pre-tiling both %.3f ms); cuBLAS f16 %.3f ms %.0f TFLOP/s" %
          (entry, m, n, k, ms, flop / ms / 1e9, pre, ref, flop / ref / 1e9), flush=True)


tiles = sys.argv[1:] or TILES
good = True
flags = {}
for tile in tiles:
    for nn in (False, True):
        # Blocked tiles: without a swizzle the K-major descriptor takes
        # the K stride in LBO (flags 0), the N-major one the K stride too
        # (flags 2); the other N-major order reads past shared memory and
        # loses the context.
        choices = ((2,) if nn else (0,)) if tile.startswith("blocked") else (0,)
        for f in choices:
            if case(tile, nn, 128, 256, 64, f):
                flags[(tile, nn)] = f
                break
        f = flags.get((tile, nn))
        if f is None:
            good = False
            continue
        good &= case(tile, nn, 200, 336, 96, f)
        good &= case(tile, nn, 272, 520, 1040, f)
        good &= case(tile, nn, 16, 16, 16, f)
print("cases:", "all passed" if good else "FAILED", flush=True)
for tile in tiles:
    if (tile, False) in flags:
        timing(tile, False, 4096, 32768, 5120, flags[(tile, False)])
        timing(tile, False, 8192, 32768, 896, flags[(tile, False)])
    if (tile, True) in flags:
        timing(tile, True, 4096, 5120, 32768, flags[(tile, True)])
        timing(tile, True, 8192, 896, 32768, flags[(tile, True)])
