"""Host cost of one public call, per backend, on the GPU machine.

Run from the repository root::

    PYTHONPATH=. python benchmarks/h200_host_profile.py [--shape H16-HV32-1x8192] [--calls 200]

For each backend: the wall time per call of ``chunk_gated_delta_rule(..., backend=name)``
when the host only enqueues (no synchronization inside the loop; one at the end), against
the GPU time per call (CUDA events around the same loop), then a cProfile of the host work
sorted by own time. A call is host-bound when the first exceeds the second.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="H16-HV32-1x8192")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--backends", default="gluon_sm90,triton_generic")
    args = parser.parse_args()
    from gdn_dispatch import chunk_gated_delta_rule
    from gdn_dispatch.bench import default_shapes, make_input_sets

    shape = next(s for s in default_shapes() if s.name == args.shape)
    x = make_input_sets(shape, 1, torch.device("cuda"), seed=3, qk_l2norm=False)[0]

    for name in args.backends.split(","):
        def call():
            return chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.h0,
                                          output_final_state=True, cu_seqlens=x.cu_seqlens,
                                          cu_seqlens_cpu=x.cu_seqlens_cpu, backend=name)
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(args.calls):
            call()
        end.record()
        host_us = (time.perf_counter() - t0) / args.calls * 1e6
        torch.cuda.synchronize()
        gpu_us = start.elapsed_time(end) / args.calls * 1e3
        print(f"{name}: host {host_us:.0f} us per call enqueued, GPU {gpu_us:.0f} us per call", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            call()
        prof.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:4000], flush=True)


if __name__ == "__main__":
    main()
