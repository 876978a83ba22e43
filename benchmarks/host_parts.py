"""Host microseconds of each piece of one call on a GPU host: real launches and real
allocations, what the CPU stub (``tests/test_gluon_host_path.py``) cannot show.

Usage (a CUDA machine, repository root): ``python benchmarks/host_parts.py``. Per backend
(gluon_sm90, triton_generic) and case (H = 16, HV = 32, K = V = 128, bf16, initial and final
state; and the H2-HV4 segmented call), each piece is called alone in 7 rounds of 100
back-to-back calls (the stream drained between rounds) and the median round printed: the
public call, the contract (``make_problem``), the probe and the registry's choice, the
forward, the call program (allocations and launches in one native call, through the
backend's ``run_call``) and the same program with its launches left out (``launch=False``:
the difference is what the launches cost the host), and the program's own phases timed
inside the native layer, with how its TMA descriptors were had; for gluon_sm90 also the
context-parallel plan, the launch plan and the Python path's pieces (the inputs' TMA check,
the one-call allocation, the two stage wrappers, each with its launch); then three torch
calls for scale. The segmented case prints its public call, contract, choice, forward and
allocation, then a cProfile of 300 forwards.
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
from gdn_dispatch.backends.triton_generic import call_program as tg_programs
from gdn_dispatch.backends.triton_generic.call_program import run_call as tg_run_call
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


class _NoLaunch:
    """A kept call program run with ``launch=False``: its checks and allocations alone."""

    def __init__(self, program):
        self.program = program

    def __call__(self, *args):
        return self.program(*args, launch=False)


def _without_launches(programs: dict) -> None:
    for key, (call, has_final) in list(programs.items()):
        if not isinstance(call, _NoLaunch):
            programs[key] = (_NoLaunch(call), has_final)


def _with_launches(programs: dict) -> None:
    for key, (call, has_final) in list(programs.items()):
        if isinstance(call, _NoLaunch):
            programs[key] = (call.program, has_final)


def _program_rows(run, programs: dict) -> dict:
    """The call program with and without its launches (``run`` takes the call)."""
    if run() is None:
        return {}

    def dry():
        _without_launches(programs)
        try:
            return run()
        finally:
            _with_launches(programs)

    return {"call program": run, "program, no launches": dry}


def pieces(backend: str, call: dict, problem, selection) -> dict:
    device = selection.device
    rows = {
        "public": lambda: chunk_gated_delta_rule(**call, backend=backend),
        "make_problem": lambda: make_problem(**call, backend=backend),
        "probe+select": lambda: select(default_probe().for_torch_device(problem.device), problem),
        "forward": lambda: selection.module.forward(problem, selection),
    }
    cp = plan_for_problem(problem, device.sm_count)
    if backend == "triton_generic":
        if not cp.enabled:
            rows.update(_program_rows(lambda: tg_run_call(problem, device.sm_count), tg_programs._PROGRAMS))
        return rows
    launches = plan(problem, device=device, engine=sm90.ENGINE, fused=not cp.enabled)
    rows["call_buffers"] = lambda: F.call_buffers(problem, launches, cp)
    if cp.enabled or launches.fused:
        return rows
    w, u, g_cum, o, final = F.call_buffers(problem, launches, cp)
    wy, so = launches.stage("wy_fwd"), launches.stage("state_output_fwd")
    rows.update({
        "plan_for_problem": lambda: plan_for_problem(problem, device.sm_count),
        "plan": lambda: plan(problem, device=device, engine=sm90.ENGINE, fused=not cp.enabled),
        **_program_rows(lambda: run_call(problem, launches, sm90.ENGINE), launches.cls.programs),
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


def program_stats(public, calls: int = 200) -> str:
    """Per public call: the call programs' phases (µs, timed inside the native layer) and
    how each TMA descriptor was had (reused as the last call left it, found among the
    encoded ones, encoded)."""
    module = native.for_calls()
    if module is None:
        return "native layer off"
    torch.cuda.synchronize()
    module.reset_stats(timing=True)
    for _ in range(calls):
        public()
    torch.cuda.synchronize()
    stats = module.stats()
    module.reset_stats()
    phases = ", ".join(f"{name} {stats['ns_' + name] / calls / 1e3:.1f}"
                       for name in ("checks", "allocate", "arguments", "launches"))
    descs = ", ".join(f"{name} {stats['desc_' + name] / calls:.1f}" for name in ("reused", "found", "encoded"))
    return f"program phases (us per call): {phases}; programs {stats['programs'] / calls:.2f} per call; " \
           f"descriptors per call: {descs}"


def main() -> None:
    device = torch.device("cuda")
    print(format_reference(host_reference_us(device)))
    print(f"native host layer: {native.status()}")
    for backend in ("gluon_sm90", "triton_generic"):
        for name, lengths, varlen, host_copy, heads in CASES:
            call = dict(make_call(lengths, varlen, host_copy, device, 0, heads), output_final_state=True)
            problem = make_problem(**call, backend=backend)
            selection = select(default_probe().for_torch_device(problem.device), problem)
            for _ in range(3):  # the first calls plan, compile and make the launchers a program needs
                chunk_gated_delta_rule(**call, backend=backend)
            rows = pieces(backend, call, problem, selection)
            calls = 30 if heads == (2, 4) else 100
            print(f"## {backend} {name}: " + ", ".join(f"{k} {us(fn, calls):.1f}" for k, fn in rows.items()),
                  flush=True)
            print(f"   {program_stats(rows['public'])}", flush=True)
            if heads == (2, 4) and backend == "gluon_sm90":
                profile = cProfile.Profile()
                profile.enable()
                for _ in range(300):
                    sm90.forward(problem, selection)
                torch.cuda.synchronize()
                profile.disable()
                pstats.Stats(profile).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
