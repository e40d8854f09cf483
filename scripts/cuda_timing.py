"""CUDA-event timing the GPU scripts share (run as `python3 scripts/X.py`,
a script's folder is on sys.path, so they import this as a sibling)."""
import torch


def event_median_ms(fn, reps):
    """The median of `reps` calls of `fn`, each timed by CUDA events and
    synchronised, in ms."""
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]
