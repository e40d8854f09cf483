"""cuBLAS (through PyTorch) at the GEMM shapes `headkl tune` times, so the
two can be compared in one device call. Prints one line per GEMM:
    cublas logits M:N:K ms=... tflops=...
    cublas dx     M:N:K ms=... tflops=...
Usage: python3 scripts/cublas_gemm.py [--shape 4096:124160:5120] [--iters 10]
"""
import argparse

import torch

from cuda_timing import event_median_ms


def median_ms(fn, iters):
    fn()
    torch.cuda.synchronize()
    return event_median_ms(fn, iters)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4096:124160:5120")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    m, n, k = (int(v) for v in args.shape.split(":"))
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.rand(m, k, device=dev, generator=gen, dtype=torch.float16) * 2 - 1
    w = torch.rand(n, k, device=dev, generator=gen, dtype=torch.float16) * 2 - 1
    g = torch.rand(m, n, device=dev, generator=gen, dtype=torch.float16) * 2 - 1
    flops = 2.0 * m * n * k
    # f16 operands with f32 accumulation; cuBLAS writes f16 (headkl writes
    # f32 logits: 2 bytes more per output element).
    for name, fn in [("logits", lambda: torch.matmul(x, w.t())), ("dx", lambda: torch.matmul(g, w))]:
        ms = median_ms(fn, args.iters)
        print(f"cublas {name:6} {m}:{n}:{k} ms={ms:.2f} tflops={flops / ms / 1e9:.0f}", flush=True)


if __name__ == "__main__":
    main()
