"""Times headkl's loss on CUDA tensors from PyTorch: forward and backward
of ``HeadKLLoss`` on bf16 hidden rows at the bench's shapes, with no byte
through the host (on the CUDA backend the engine runs on the tensors
themselves on torch's stream; on Vulkan its buffers are mapped into CUDA),
with CUDA events on torch's stream.

    python python/examples/bench_cuda.py --shapes S,A --iters 10 --backend cuda

Per shape it prints one line: the step's GPU milliseconds (median of the
iterations), the bytes headkl moved through the host during the timed
steps (0 on the zero-copy path), and the peak CUDA memory torch allocated
beyond the inputs and the device memory headkl's engine held beyond its
head (scratch and the buffers shared with CUDA). Compare with ``headkl bench --resident --shape X`` (the
Rust device-resident path) and the peers in the same device call.
"""

import argparse
import statistics
import time

import torch

import headkl.torch as ht

# ntok : V : hs : k, as `headkl bench --shape` names them.
SHAPES = {
    "A": (4096, 248320, 5120, 64),
    "B": (8192, 151936, 4096, 64),
    "S": (8192, 151936, 896, 64),
    "M": (8192, 128256, 2048, 64),
}


def parse_bytes(text):
    """`1536M`, `2G`, `1048576`: a byte count as `headkl bench --budget` reads it."""
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale > 1 else text
    try:
        value = int(digits) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 1536M)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be above zero")
    return value


def arguments():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="S,A", help="comma-separated shapes of A, B, S, M (default S,A)")
    p.add_argument("--ntok", type=int, default=None, help="tokens instead of the shape's (e.g. 32768)")
    p.add_argument("--iters", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--backend", default="auto", help="headkl backend: auto (cuda on NVIDIA), cuda or vulkan")
    p.add_argument(
        "--head-grad",
        action="store_true",
        help="the head is a trainable CUDA parameter: each step also gives its gradient (weight.grad)",
    )
    p.add_argument(
        "--refresh",
        action="store_true",
        help="each step first changes the head in place, as an optimizer step does, so it includes reading the head "
        "again (with --head-grad)",
    )
    p.add_argument(
        "--budget",
        type=parse_bytes,
        default=None,
        help="device scratch budget in bytes, with K, M or G (default: the package's, 2G)",
    )
    return p.parse_args()


def main():
    args = arguments()
    if args.refresh and not args.head_grad:
        raise SystemExit("bench_cuda.py: --refresh changes the head each step, which needs --head-grad (a CUDA parameter)")
    device = torch.device("cuda")
    for name in args.shapes.split(","):
        ntok, vocab, hs, k = SHAPES[name]
        ntok = args.ntok or ntok
        g = torch.Generator().manual_seed(1)
        weight = (torch.randn(vocab, hs, generator=g) / hs**0.5).to(torch.bfloat16)
        if args.head_grad:
            # As a trainer's lm_head: on the GPU, requiring grad.
            weight = torch.nn.Parameter(weight.to(device))
        started = time.perf_counter()
        loss_fn = ht.HeadKLLoss(weight, backend=args.backend, budget_bytes=args.budget)
        upload_s = time.perf_counter() - started
        hidden = torch.randn(ntok, hs, device=device).to(torch.bfloat16)
        # Distinct per row: k ids a stride of V/k apart from a random start.
        start = torch.randint(0, vocab, (ntok, 1), device=device)
        ids = (start + torch.arange(k, device=device) * (vocab // k)) % vocab
        probs = torch.softmax(torch.randn(ntok, k, device=device), -1)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        head_bytes, _ = loss_fn.head._engine.memory(reset_peak=True)
        base = torch.cuda.memory_allocated()
        times = []
        copied = 0
        peaks = [0, 0]
        for step in range(args.warmup + args.iters):
            x = hidden.detach().requires_grad_()
            weight.grad = None
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before = ht.host_copy_bytes()
            begin.record()
            if args.refresh:
                with torch.no_grad():
                    weight.mul_(1.0)  # a new version of the same values
            loss = loss_fn(x, ids, probs)
            # The allocator's own count (no wait): forward's peak, then
            # backward's, each beyond the inputs.
            peaks[0] = max(peaks[0], torch.cuda.max_memory_allocated() - base)
            torch.cuda.reset_peak_memory_stats()
            loss.backward()
            peaks[1] = max(peaks[1], torch.cuda.max_memory_allocated() - base)
            torch.cuda.reset_peak_memory_stats()
            end.record()
            if step >= args.warmup:
                copied += ht.host_copy_bytes() - before
                end.synchronize()
                times.append(begin.elapsed_time(end))
        loss_fn.synchronize()
        peak = max(peaks) / 2**30
        _, engine_peak = loss_fn.head._engine.memory()
        headkl_extra = (engine_peak - head_bytes) / 2**30
        budget = f" budget {args.budget / 2**20:.0f}M" if args.budget else ""
        # The gradient's own tensors: the engine's f32 [V][hs] and .grad.
        dw = f", of which dW {vocab * hs * 6 / 2**30:.2f} GiB (f32 + bf16 .grad)" if args.head_grad else ""
        print(
            f"torch {name}{budget} {ntok}:{vocab}:{hs}:{k} {'zero-copy' if loss_fn.zero_copy else 'host copies'}"
            f"{' with dW' if args.head_grad else ''}{' refreshed each step' if args.refresh else ''}: "
            f"step {statistics.median(times):.2f} ms (min {min(times):.2f}), host bytes {copied}, "
            f"peak extra: torch {peak:.2f} GiB (forward {peaks[0] / 2**30:.2f}, backward {peaks[1] / 2**30:.2f}){dw} + headkl {headkl_extra:.2f} GiB (beyond its {head_bytes / 2**30:.2f} GiB head), "
            f"head upload {upload_s:.1f} s, loss {loss.item():.4f}",
            flush=True,
        )
        del loss_fn


if __name__ == "__main__":
    main()
