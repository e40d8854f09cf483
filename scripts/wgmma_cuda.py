#!/usr/bin/env python3
"""The PTX GEMM tiles (shaders/gemm_wgmma.ptx) run through CUDA on an NVIDIA
GPU, beside torch: each entry point's results against torch's f32 GEMM on
the same f16 operands, then its TFLOP/s against cuBLAS's at a shape. A
check of the kernels apart from the Vulkan backend's NVX path (which
`headkl check` covers); needs torch with CUDA and the driver's libcuda.

  python3 scripts/wgmma_cuda.py [TILE ...]   (e.g. bm64_bk32_s3; default: the shipped tiles)
"""
import ctypes as C
import os
import re
import struct
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
cuda = C.CDLL("libcuda.so.1")


def ok(status, what):
    if status != 0:
        name = C.c_char_p()
        cuda.cuGetErrorName(status, C.byref(name))
        sys.exit("%s: %s" % (what, name.value.decode()))


torch.cuda.init()
torch.zeros(1, device="cuda")  # the primary context, current
module = C.c_void_p()
ptx = open(os.path.join(ROOT, "shaders", "gemm_wgmma.ptx"), "rb").read() + b"\0"
ok(cuda.cuModuleLoadData(C.byref(module), ptx), "cuModuleLoadData")

FIELDS = "m n k a_offset lda ldb c_offset ldc alpha accumulate grid_x k_parts k_part c_part_stride stats_offset stats_ld stats_first stats_cols mask_rows mask_ld".split()


def params(**kw):
    return struct.pack("<8If11I", *[kw.get(f, 0) for f in FIELDS])


def launch(entry, bm, p, a, b, c, parts):
    threads = bm * 2
    bn = 256 if "_bn256" in entry else 128
    fn = C.c_void_p()
    ok(cuda.cuModuleGetFunction(C.byref(fn), module, entry.encode()), entry)
    tiles = -(-p["m"] // bm) * -(-p["n"] // bn) * parts
    gx = min(tiles, 65535)
    gy = -(-tiles // gx)
    p["grid_x"] = gx
    blob = C.create_string_buffer(params(**p), 80)
    ptrs = [C.c_uint64(t.data_ptr()) for t in (a, b, c)]
    args = (C.c_void_p * 4)(C.cast(blob, C.c_void_p), *[C.cast(C.pointer(x), C.c_void_p) for x in ptrs])
    stream = torch.cuda.current_stream().cuda_stream
    ok(cuda.cuLaunchKernel(fn, gx, gy, 1, threads, 1, 1, 0, C.c_void_p(stream), args, None), "launch " + entry)


def k_part_len(k, parts):
    return -(-(-(-k // parts)) // 64) * 64


def case(entry, bm, nn, m, n, k, parts=1, accumulate=False, stats=False, alpha=1.0):
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n * 3 + k)
    a = torch.randint(-3, 4, (m, k), device="cuda", generator=g).half()
    b = torch.randint(-3, 4, ((k, n) if nn else (n, k)), device="cuda", generator=g).half()
    ref = alpha * (a.float() @ (b.float() if nn else b.float().t()))
    kp = k_part_len(k, parts)
    groups = -(-n // 32)
    stats_ld = groups + groups % 2
    c_stride = m * n
    stats_at = parts * c_stride if stats else 0
    c = torch.full((parts * c_stride + (m * 2 * stats_ld if stats else 0) + 4,), float("nan"), device="cuda")
    prev = None
    if accumulate:
        c[: parts * c_stride] = torch.randint(-3, 4, (parts * c_stride,), device="cuda", generator=g).float()
        prev = c[: parts * c_stride].clone()
    p = dict(m=m, n=n, k=k, lda=k, ldb=(n if nn else k), ldc=n, alpha=alpha, accumulate=int(accumulate),
             k_parts=parts, k_part=kp, c_part_stride=c_stride, stats_offset=stats_at, stats_ld=stats_ld,
             stats_cols=n - 5 if stats else 0)
    launch(entry, bm, p, a, b, c, parts)
    torch.cuda.synchronize()
    got = c[: parts * c_stride].view(parts, m, n)
    if accumulate:
        got = got - prev.view(parts, m, n)
    total = got.sum(0)
    err = (total - ref).abs().max().item()
    bad = f"max |err| {err}" if not err <= 1e-3 * max(1.0, ref.abs().max().item()) else None
    if stats and bad is None:
        st = c[stats_at: stats_at + m * 2 * stats_ld].view(m, stats_ld, 2)
        real = ref[:, : n - 5]
        for gi in range(groups):
            blk = real[:, gi * 32: (gi + 1) * 32]
            if blk.shape[1] == 0:
                continue
            mx = blk.max(1).values
            sm = (blk - mx[:, None]).exp().sum(1)
            e1 = (st[:, gi, 0] - mx).abs().max().item()
            e2 = ((st[:, gi, 1] - sm).abs() / sm).max().item()
            if e1 > 1e-3 or e2 > 1e-4:
                bad = f"row stats group {gi}: max err {e1}, sum rel err {e2}"
                break
    print("%-24s m%d n%d k%d parts%d acc%d stats%d: %s" % (entry, m, n, k, parts, accumulate, stats, bad or "ok"), flush=True)
    return bad is None


def timing(entry, bm, nn, m, n, k, parts=1):
    a = torch.randn(m, k, device="cuda").half()
    b = torch.randn(*((k, n) if nn else (n, k)), device="cuda").half()
    c = torch.empty(parts * m * n, device="cuda")
    p = dict(m=m, n=n, k=k, lda=k, ldb=(n if nn else k), ldc=n, alpha=1.0, k_parts=parts,
             k_part=k_part_len(k, parts), c_part_stride=m * n)
    for _ in range(3):
        launch(entry, bm, dict(p), a, b, c, parts)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(10):
        launch(entry, bm, dict(p), a, b, c, parts)
    t1.record()
    torch.cuda.synchronize()
    ms = t0.elapsed_time(t1) / 10
    bt = b if nn else b.t()
    for _ in range(3):
        torch.matmul(a, bt)
    t0.record()
    for _ in range(10):
        torch.matmul(a, bt)
    t1.record()
    torch.cuda.synchronize()
    ref = t0.elapsed_time(t1) / 10
    flop = 2.0 * m * n * k
    print("time %-22s %d:%d:%d parts %d: %.3f ms %.0f TFLOP/s; cuBLAS f16 %.3f ms %.0f TFLOP/s" %
          (entry, m, n, k, parts, ms, flop / ms / 1e9, ref, flop / ref / 1e9), flush=True)


TILES = [(name, int(re.search(r"bm(\d+)", name).group(1))) for name in sys.argv[1:]] or [("bm64_bk32_s3", 64), ("bm64_bk64_s1", 64), ("bm128_bk32_s2", 128)]
good = True
for tile, bm in TILES:
    for layout, nn in (("logits", False), ("dx", True)):
        e = "wgmma_%s_%s" % (layout, tile)
        good &= case(e, bm, nn, 128, 128, 64)
        good &= case(e, bm, nn, 200, 336, 96)
        good &= case(e, bm, nn, 256, 384, 1040, parts=3, accumulate=True)
        good &= case(e, bm, nn, 272, 512, 512, stats=not nn, alpha=0.5)
        good &= case(e, bm, nn, 16, 16, 16)
print("cases:", "all passed" if good else "FAILED", flush=True)
for tile, bm in TILES:
    timing("wgmma_logits_" + tile, bm, False, 4096, 32768, 5120)
    timing("wgmma_dx_" + tile, bm, True, 4096, 5120, 32768, parts=1)
    timing("wgmma_logits_" + tile, bm, False, 8192, 32768, 896)
    timing("wgmma_dx_" + tile, bm, True, 8192, 896, 32768)
