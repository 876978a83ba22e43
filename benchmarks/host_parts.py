"""Host microseconds of each piece of one gluon_sm90 call on a GPU host: real launches and
real allocations, what the CPU stub (``tests/test_gluon_host_path.py``) cannot show.

Usage (a CUDA machine, repository root): ``python benchmarks/host_parts.py``. Per case
(H = 16, HV = 32, K = V = 128, bf16, initial and final state; and the H2-HV4 segmented
call), each piece is called alone in 7 rounds of 100 back-to-back calls (the stream drained
between rounds) and the median round printed: the public call, the contract
(``make_problem``), the probe and the registry's choice, the forward, and inside the
forward the context-parallel plan, the launch plan, the call program (:mod:`.call_program`:
allocations and launches in one native call), and the Python path's pieces: the inputs' TMA
check, the one-call allocation and the two stage wrappers (each with its launch); then
three torch calls for scale. The segmented case prints its public call, contract, choice, forward and allocation,
then a cProfile of 300 forwards.
"""
import cProfile
import pstats
import statistics
import time

import torch

from gdn_dispatch import chunk_gated_delta_rule, native
from gdn_dispatch.backends import gluon_sm90 as sm90
from gdn_dispatch.backends.gluon_common import forward as F
from gdn_dispatch.backends.gluon_common.call_program import run_call
from gdn_dispatch.backends.gluon_common.plan import plan
from gdn_dispatch.backends.gluon_common.state_output import state_output_fwd
from gdn_dispatch.backends.gluon_common.wy import wy_fwd
from gdn_dispatch.bench_host import format_reference, host_reference_us, make_call
from gdn_dispatch.context_parallel import plan_for_problem
from gdn_dispatch.contract import make_problem
from gdn_dispatch.device import default_probe
from gdn_dispatch.registry import select

CASES = (("varlen-1x64", (64,), True, True, (16, 32)), ("uniform-1x64", (64,), False, True, (16, 32)),
         ("varlen-1x64-no-cpu", (64,), True, False, (16, 32)), ("H2-HV4-varlen-1x32768", (32768,), True, True, (2, 4)))


def us(fn, calls: int = 100, rounds: int = 7) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def pieces(call: dict, problem, selection) -> dict:
    device = selection.device
    cp = plan_for_problem(problem, device.sm_count)
    launches = plan(problem, device=device, engine=sm90.ENGINE, fused=not cp.enabled)
    rows = {
        "public": lambda: chunk_gated_delta_rule(**call, backend="gluon_sm90"),
        "make_problem": lambda: make_problem(**call, backend="gluon_sm90"),
        "probe+select": lambda: select(default_probe().for_torch_device(problem.device), problem),
        "forward": lambda: sm90.forward(problem, selection),
        "call_buffers": lambda: F.call_buffers(problem, launches, cp),
    }
    if cp.enabled or launches.fused:
        return rows
    w, u, g_cum, o, final = F.call_buffers(problem, launches, cp)
    wy, so = launches.stage("wy_fwd"), launches.stage("state_output_fwd")
    rows.update({
        "plan_for_problem": lambda: plan_for_problem(problem, device.sm_count),
        "plan": lambda: plan(problem, device=device, engine=sm90.ENGINE, fused=not cp.enabled),
        "call program": lambda: run_call(problem, launches, sm90.ENGINE),
        "tma_readable": lambda: F.tma_readable(problem),
        "wy_fwd": lambda: wy_fwd(problem.k, problem.v, problem.g, problem.beta, problem.chunks, wy,
                                 out=(w, u, g_cum)),
        "state_output_fwd": lambda: state_output_fwd(
            problem.q, problem.k, w, u, g_cum, problem.chunks, so, scale=problem.scale,
            initial_state=problem.initial_state, output_final_state=True, out=(o, final)),
        "current_device": torch.cuda.current_device,
        "is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "torch.empty": lambda: torch.empty(1, 64, 32, 128, dtype=torch.bfloat16, device=problem.device),
    })
    return rows


def main() -> None:
    device = torch.device("cuda")
    print(format_reference(host_reference_us(device)))
    print(f"native host layer: {native.status()}")
    for name, lengths, varlen, host_copy, heads in CASES:
        call = dict(make_call(lengths, varlen, host_copy, device, 0, heads), output_final_state=True)
        problem = make_problem(**call, backend="gluon_sm90")
        selection = select(default_probe().for_torch_device(problem.device), problem)
        rows = pieces(call, problem, selection)
        calls = 30 if heads == (2, 4) else 100
        print(f"## {name}: " + ", ".join(f"{k} {us(fn, calls):.1f}" for k, fn in rows.items()), flush=True)
        if heads == (2, 4):
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(300):
                sm90.forward(problem, selection)
            torch.cuda.synchronize()
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
