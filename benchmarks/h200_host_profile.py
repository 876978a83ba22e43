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
import os
import pstats
import time

import torch


def host_us(fn, n=50):
    """Host microseconds per ``fn()`` over ``n`` calls (few enough that the launch queue never fills)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def breakdown(x):
    """Host cost of each step of a gluon_sm90 call, measured alone."""
    from gdn_dispatch.contract import make_problem
    from gdn_dispatch.device import default_probe
    from gdn_dispatch.registry import select

    from gdn_dispatch.backends.gluon_common import state_output as so
    from gdn_dispatch.backends.gluon_common import wy
    from gdn_dispatch.backends.gluon_common.launch import JIT_LAUNCH_ENV, launch_planned
    from gdn_dispatch.backends.gluon_common.plan import plan

    def problem():
        return make_problem(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.h0, output_final_state=True,
                            cu_seqlens=x.cu_seqlens, cu_seqlens_cpu=x.cu_seqlens_cpu, backend="gluon_sm90")

    p = problem()
    probe = default_probe()
    info = probe.for_torch_device(p.device)
    launches = plan(p, device=info)
    lw, ls = launches.stage("wy_fwd"), launches.stage("state_output_fwd")
    w, u, g_cum = wy.wy_fwd(p.k, p.v, p.g, p.beta, p.chunks, lw)
    o = torch.empty_like(p.v)
    ht = torch.empty(p.state_shape, dtype=torch.float32, device=p.device)
    tw = {"k": p.k, "v": p.v, "w": w, "u": u}
    ts = {"q": p.q, "k": p.k, "w": w, "u": u, "o": o}
    dw = {d.arg: d.build(tw[d.tensor]) for d in lw.descriptors}
    ds = {d.arg: d.build(ts[d.tensor]) for d in ls.descriptors}
    ch = p.chunks

    wy_args = dict(w_ptr=w, u_ptr=u, g=p.g, g_cum=g_cum, beta=p.beta, cu_seqlens=ch.cu_seqlens,
                   chunk_seq=ch.chunk_seq, chunk_local=ch.chunk_local, HV=lw.scalars["HV"], GROUP=lw.scalars["GROUP"])
    so_args = dict(o_ptr=o, g_cum=g_cum, h0=p.initial_state, ht=ht, cu_seqlens=ch.cu_seqlens, scale=p.scale,
                   HV=ls.scalars["HV"], GROUP=ls.scalars["GROUP"], V=ls.scalars["V"])

    def jit(fn, launch, descs, args):
        return lambda: fn[launch.grid](**descs, **args, **launch.constexprs, num_warps=launch.num_warps,
                                       maxnreg=launch.maxnreg)

    steps = {
        "make_problem": problem,
        "device probe": lambda: probe.for_torch_device(p.device),
        "registry select": lambda: select(info, p),
        "plan (memoized)": lambda: plan(p, device=info),
        f"{len(lw.descriptors) + len(ls.descriptors)} descriptors": lambda: (
            [d.build(tw[d.tensor]) for d in lw.descriptors], [d.build(ts[d.tensor]) for d in ls.descriptors]),
        "5 torch.empty": lambda: [torch.empty_like(p.v) for _ in range(5)],
        "wy launch, Triton JIT": jit(wy._wy_fwd_kernel, lw, dw, wy_args),
        "wy launch, planned": lambda: launch_planned(wy._wy_fwd_kernel, lw, tw, wy_args),
        "state_output launch, JIT": jit(so._state_output_fwd_kernel, ls, ds, so_args),
        "state_output, planned": lambda: launch_planned(so._state_output_fwd_kernel, ls, ts, so_args),
        "forward": lambda: select(info, p).module.forward(p),
    }
    for name, fn in steps.items():
        print(f"  {name:26s} {host_us(fn):8.1f} us", flush=True)
    os.environ[JIT_LAUNCH_ENV] = "1"
    print(f"  {'forward, JIT launches':26s} {host_us(steps['forward']):8.1f} us", flush=True)
    del os.environ[JIT_LAUNCH_ENV]


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

    print("gluon_sm90 host steps (each alone):", flush=True)
    breakdown(x)
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
