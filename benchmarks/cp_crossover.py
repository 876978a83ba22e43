"""Context-parallelism crossover: GPU time of one call (a CUDA graph of it, replayed) with
``context_parallel="off"`` and ``"auto"`` per shape, the segments "auto" chose, and the
kernel split of two segmented calls (torch profiler). GPU time, not host time: a server
replays its layers in CUDA graphs, so the rule is fitted to what the GPU spends.

Usage (a CUDA machine, repository root): ``python benchmarks/cp_crossover.py [BACKEND]
[--gates crossover|bench|weak|model] [--segments 2,4,8]`` (default gluon_sm90). Inputs: bf16,
K = V = 128, l2-normalized q and k, an initial state and the final state, varlen with a
host copy of cu_seqlens. The gates decide how much of a segment the Gluon pass 1 walks
(it drops what a segment provably forgets): ``crossover`` (default, the table's)
``logsigmoid(randn) / 16``, about -4.6 bits a chunk, forgets a 2048-token segment's first
23 chunks; ``bench`` the bench's ``logsigmoid(randn)``, about -75 bits a chunk, all but
the last chunk; ``weak`` ``logsigmoid(randn) / 1024``, about -0.07 bits a chunk, nothing,
so every segment is walked whole (long-memory heads); ``model`` per-head decay rates drawn as
Qwen3-Next's gated delta layer initializes them, ``g = -A softplus(a + dt_bias)`` with ``A ~
U(0, 16)``, ``dt_bias`` the inverse softplus of ``dt ~ logU(1e-3, 1e-1)`` and ``a ~ N(0, 1)``
per token: most heads forget within a few chunks, a few (``A dt`` below about 0.014 a token)
keep their state for longer than 2048 tokens. ``--segments`` also times each
shape with each of those forced segment counts (a column per count). ``--chain-fill X``
runs "auto" under the planner's constants with ``chain_fill = X`` (chained segments
between a quarter of the SMs and ``X`` of them; a backend without them refuses the call).
``--picking`` runs "auto" under ``context_parallel.PICKING`` (picked plans on, a caller's
opt-in). ``--warm-chain`` runs chained plans on gluon_sm90's one-kernel build, warmed up from each
segment's forgetting suffix (``warm_chain.WARM_CHAIN`` on). ``--shapes 16/32/1/32768,...``
times those (H/HV/N/tokens) alone. Prints a markdown table last (median of 15 x 5 replays).
"""
import argparse
import dataclasses
import math
import time

import torch, torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity
from gdn_dispatch import chunk_gated_delta_rule
from gdn_dispatch.bench_host import graph_replay_us
from gdn_dispatch.contract import make_problem
from gdn_dispatch import context_parallel
from gdn_dispatch.context_parallel import plan_for_problem

#: Divisor of logsigmoid(randn) per --gates choice (``model``: :func:`model_gates`).
GATE_DIVISORS = {"crossover": 16.0, "bench": 1.0, "weak": 1024.0, "model": None}


def model_gates(T, HV, generator):
    """Gates ``[1, T, HV]`` of per-head decay rates as Qwen3-Next's layer initializes them
    (see the module docstring)."""
    A = torch.rand(HV, device="cuda", generator=generator) * 16.0
    log_dt = math.log(1e-3) + torch.rand(HV, device="cuda", generator=generator) * math.log(100.0)
    dt = log_dt.exp().clamp(min=1e-4)
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    a = torch.randn(1, T, HV, device="cuda", generator=generator)
    return -A * F.softplus(a + dt_bias)


def call_for(H, HV, N, L, gate_divisor=GATE_DIVISORS["crossover"]):
    T = N * L
    g = torch.Generator(device="cuda").manual_seed(0)
    q = F.normalize(torch.randn(1, T, H, 128, device="cuda", generator=g), dim=-1).bfloat16()
    k = F.normalize(torch.randn(1, T, H, 128, device="cuda", generator=g), dim=-1).bfloat16()
    v = torch.randn(1, T, HV, 128, device="cuda", generator=g).bfloat16()
    if gate_divisor is None:
        gate = model_gates(T, HV, g)
    else:
        gate = F.logsigmoid(torch.randn(1, T, HV, device="cuda", generator=g)) / gate_divisor
    beta = torch.rand(1, T, HV, device="cuda", generator=g).sigmoid()
    cu = torch.arange(0, T + 1, L, dtype=torch.int32)
    h0 = 0.1 * torch.randn(N, HV, 128, 128, device="cuda", generator=g)
    return dict(q=q, k=k, v=v, g=gate, beta=beta, initial_state=h0, output_final_state=True,
                cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu)


def graph_ms(call, cp, backend):
    return graph_replay_us(lambda: chunk_gated_delta_rule(**call, context_parallel=cp, backend=backend),
                           replays=5, windows=15) / 1e3


SHAPES = [(2, 4, 1, 32768), (4, 8, 1, 32768), (2, 8, 1, 32768), (8, 16, 1, 32768), (16, 32, 1, 32768),
          (2, 4, 8, 4096), (16, 32, 1, 8192), (4, 8, 2, 16384), (2, 4, 1, 8192), (2, 4, 1, 4096), (8, 16, 1, 8192),
          (2, 4, 2, 32768), (4, 8, 1, 65536),
          # where the chunks-per-program bound decides: 4 to 8 chunks per program
          (4, 8, 2, 8192), (2, 4, 4, 8192), (4, 8, 1, 4096), (2, 4, 2, 4096), (2, 4, 1, 2048), (8, 16, 1, 12288),
          (8, 16, 1, 4096), (2, 4, 1, 1024),
          # between a quarter and half of the SMs in 64-column programs: where chained segments
          # (--chain-fill) can gain; a full wave at BV = 32 (8/16 x 2) where they cannot
          (4, 8, 3, 16384), (2, 4, 6, 8192), (8, 16, 2, 16384)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("backend", nargs="?", default="gluon_sm90")
    parser.add_argument("--gates", choices=sorted(GATE_DIVISORS), default="crossover")
    parser.add_argument("--segments", type=lambda x: [int(n) for n in x.split(",")], default=[],
                        help="comma-separated forced segment counts to time beside off and auto")
    parser.add_argument("--chain-fill", type=float, default=None,
                        help="plan 'auto' with chained segments below this fraction of the SMs")
    parser.add_argument("--picking", action="store_true",
                        help="plan 'auto' with picked plans on (context_parallel.PICKING)")
    parser.add_argument("--warm-chain", action="store_true",
                        help="chained plans on the one-kernel build (warm_chain.WARM_CHAIN on)")
    parser.add_argument("--shapes", type=lambda x: [tuple(int(n) for n in s.split("/")) for s in x.split(",")],
                        default=None, help="comma-separated H/HV/N/tokens to time instead of the table's")
    return parser.parse_args(argv)


def main():
    args = parse_args()
    if args.picking:
        context_parallel.TUNING = context_parallel.PICKING
    if args.chain_fill is not None:
        context_parallel.TUNING = dataclasses.replace(context_parallel.TUNING, chain_fill=args.chain_fill)
    if args.warm_chain:
        from gdn_dispatch.backends.gluon_common import warm_chain

        warm_chain.WARM_CHAIN = True
    t0 = time.time()
    forced = "".join(f" {n} segs ms |" for n in args.segments)
    rows = [f"| H/HV | N x tokens | off ms | auto ms | off/auto | auto's segments |{forced}",
            "| --- | --- | ---: | ---: | ---: | --- |" + " ---: |" * len(args.segments)]
    divisor = GATE_DIVISORS[args.gates]
    gates = "per-head rates as the model initializes them" if divisor is None else f"logsigmoid(randn) / {divisor:g}"
    print(f"gates: {args.gates} ({gates}), backend {args.backend}, "
          f"{context_parallel.TUNING}{', warm chain' if args.warm_chain else ''}", flush=True)
    for H, HV, N, L in args.shapes or SHAPES:
        call = call_for(H, HV, N, L, GATE_DIVISORS[args.gates])
        plan = plan_for_problem(make_problem(**call), torch.cuda.get_device_properties(0).multi_processor_count)
        off, auto = graph_ms(call, "off", args.backend), graph_ms(call, "auto", args.backend)
        kind = ' picked' if plan.picked else ' chained' if plan.chained else ''
        seg = f"{plan.num_segments - N}{kind} of {plan.seg_len}" if plan.enabled \
            else "off"
        more = "".join(f" {graph_ms(call, n, args.backend):.3f} |" for n in args.segments)
        rows.append(f"| {H}/{HV} | {N} x {L} | {off:.3f} | {auto:.3f} | {off / auto:.2f} | {seg} |{more}")
        print(rows[-1], f"[{time.time() - t0:.0f}s]", flush=True)
        if (H, HV, N, L) in [(2, 4, 1, 32768), (8, 16, 1, 32768), (16, 32, 1, 32768)]:
            # auto's kernels; where auto is off, those of the middle forced count
            split_cp = "auto" if plan.enabled or not args.segments else args.segments[len(args.segments) // 2]
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    chunk_gated_delta_rule(**call, context_parallel=split_cp, backend=args.backend)
                torch.cuda.synchronize()
            split = [f"{e.key.replace('_fwd_kernel', '').strip('_')} {e.device_time_total / 5:.0f}"
                     for e in prof.key_averages() if e.device_time_total > 0 and "kernel" in e.key]
            print(f"   kernels (us, context_parallel={split_cp!r}):", ", ".join(split), flush=True)
        del call
        torch.cuda.empty_cache()
    print("\n".join(rows))


if __name__ == "__main__":
    main()
