"""The PyTorch anchor (../shared/anchors/torch_head_kl.py) timed under sustained
load: each variant first runs for --warm-s seconds, then --reps timed calls,
each synchronised as the anchor's own timing does. The anchor's default
timing (2 warm-up calls, 5 timed) ends before the GPU reaches its power
limit; a training loop does not. Run it in the same device call as
`headkl bench --warmup W --iters N` with a comparable warm-up.

Usage: python3 scripts/anchor_sustained.py [--anchor PATH] [--shapes A]
       [--variants compiled,teacher_topk] [--warm-s 3] [--reps 20]
Prints a header line, then the anchor's own lines.
"""
import argparse
import importlib.util
import time

import torch

from cuda_timing import event_median_ms


def load_anchor(path):
    spec = importlib.util.spec_from_file_location("torch_head_kl", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sustained_timeit(warm_s, timed_reps):
    # The anchor calls timeit(fn, reps=..., warm=...): its reps are replaced.
    def timeit(fn, reps=7, warm=2):
        for _ in range(warm):
            fn()
        torch.cuda.synchronize()
        start = time.monotonic()
        while time.monotonic() - start < warm_s:
            fn()
            torch.cuda.synchronize()
        return event_median_ms(fn, timed_reps)

    return timeit


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--anchor", default="../shared/anchors/torch_head_kl.py")
    ap.add_argument("--shapes", default="A")
    ap.add_argument("--variants", default="compiled,teacher_topk")
    ap.add_argument("--warm-s", type=float, default=3.0)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    anchor = load_anchor(args.anchor)
    anchor.timeit = sustained_timeit(args.warm_s, args.reps)
    print(f"sustained: warm {args.warm_s} s, {args.reps} timed calls", flush=True)
    for shape in args.shapes.split(","):
        dims = anchor.SHAPES[shape] if shape in anchor.SHAPES else tuple(int(t) for t in shape.split(":"))
        anchor.case(*dims, torch.float16, args.variants.split(","))


if __name__ == "__main__":
    main()
