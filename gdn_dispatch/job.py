"""The main job (``python -m gdn_dispatch run``): one Qwen3.5-shaped ragged prefill.

On a GPU: H = 16, HV = 32, K = V = 128, bf16, a ragged batch of sequences, with initial
and final state, run by the backend the registry selects, timed, and checked against the
float32 reference on the first sequences. On the CPU a smaller problem of the same kind
runs in seconds and is checked against the per-token recurrence.
"""

from __future__ import annotations

import time

import torch

from gdn_dispatch.api import chunk_gated_delta_rule
from gdn_dispatch.context_parallel import plan_for_problem
from gdn_dispatch.contract import make_problem
from gdn_dispatch.device import default_probe
from gdn_dispatch.registry import launches_of, select
from gdn_dispatch import reference
from gdn_dispatch.testing import random_call, rel_rms_error

GPU_SHAPE = dict(H=16, HV=32, K=128, V=128, dtype=torch.bfloat16)
GPU_LENGTHS = [4096, 1537, 8192, 31, 2048, 700, 3000, 1, 6143, 64]
GPU_CHECKED_SEQS = 3  # the reference walks these (about 14k tokens) in float32
CPU_SHAPE = dict(H=2, HV=4, K=32, V=32, dtype=torch.float32)
CPU_LENGTHS = [150, 37, 64, 1, 0, 90]
CPU_CHECKED_SEQS = 3
TOLERANCE = {torch.bfloat16: 5e-3, torch.float16: 5e-3, torch.float32: 1e-5}


def _slice_call(call: dict, num_seqs: int) -> dict:
    """The first ``num_seqs`` sequences of a packed call, as a call of their own."""
    cu = call["cu_seqlens_cpu"]
    end = int(cu[num_seqs])
    sliced = dict(call)
    for name in ("q", "k", "v", "g", "beta"):
        sliced[name] = call[name][:, :end]
    sliced["initial_state"] = call["initial_state"][:num_seqs]
    sliced["cu_seqlens_cpu"] = cu[: num_seqs + 1]
    sliced["cu_seqlens"] = call["cu_seqlens"][: num_seqs + 1]
    return sliced


def _timed(fn, device: torch.device, iters: int = 5) -> float:
    """Median milliseconds of ``fn()`` after one warm-up call."""
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def run_main_job(device: str | None = None, seed: int = 0) -> int:
    """Run, time and check the main job; returns 0 when the error is within tolerance."""
    probe = default_probe()
    if device is None:
        device = "cuda:0" if probe.count() > 0 else "cpu"
    dev = torch.device(device)
    on_gpu = dev.type == "cuda"
    shape, lengths, checked = (GPU_SHAPE, GPU_LENGTHS, GPU_CHECKED_SEQS) if on_gpu else (
        CPU_SHAPE, CPU_LENGTHS, CPU_CHECKED_SEQS)
    call = random_call(lengths=lengths, device=dev, seed=seed, **shape)
    info = probe.for_torch_device(dev)
    problem = make_problem(**call)
    selection = select(info, problem)
    chosen = selection.spec.name
    segments = plan_for_problem(problem, info.sm_count).describe()
    launches = launches_of(selection.module, problem, info)

    def step():
        return chunk_gated_delta_rule(**call, output_final_state=True)

    ms = _timed(step, dev)
    o, final = step()
    tokens = sum(lengths)

    # The oracle must differ from what ran: the chunked reference checks a kernel backend;
    # the per-token recurrence checks the chunked reference itself.
    part = _slice_call(call, checked)
    oracle = reference.forward_recurrent if chosen == "reference" else reference.forward
    o_ref, final_ref = oracle(make_problem(**part, output_final_state=True))
    end = int(call["cu_seqlens_cpu"][checked])
    err_o = rel_rms_error(o[:, :end], o_ref)
    err_s = rel_rms_error(final[:checked], final_ref)
    tol = TOLERANCE[shape["dtype"]]

    print(f"device     {info.label} ({info.name}, {info.arch})")
    print(f"backend    {chosen}")
    print(f"shape      {len(lengths)} sequences, {tokens} tokens (lengths {lengths}); "
          f"H={shape['H']} HV={shape['HV']} K={shape['K']} V={shape['V']} {str(shape['dtype']).removeprefix('torch.')}")
    print(f"context    parallel {segments}")
    if launches is not None:
        print(f"launches   {launches}")
    print(f"time       {ms:.3f} ms (median of 5)  {tokens / ms * 1e3:,.0f} tokens/s")
    print(f"checked    first {checked} sequences ({end} tokens) against reference."
          f"{oracle.__name__}: rel. RMS error o {err_o:.2e}, final state {err_s:.2e} (tolerance {tol:.0e})")
    ok = err_o <= tol and err_s <= tol
    print("result     " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1
