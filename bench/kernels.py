"""The device time of each kernel a callable launches, from torch.profiler (shared by the benchmarks)."""
import torch


def kernel_table(fn, calls: int = 1) -> dict:
    """kernel name -> (launches, device microseconds), each per call of fn (the total over `calls`
    eager calls after one warm-up call, divided by `calls`). GPU kernels only (the profiler's host-side ranges repeat
    the device time of the kernels they launch)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    table = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            table[e.key] = (e.count // calls, us / calls)
    return table
