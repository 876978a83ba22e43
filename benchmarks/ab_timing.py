"""What the A/B scripts of this folder share: one public call timed two ways, each variant
in its own process (a kernel's constexpr globals are fixed at its first compile), and the
variants' outputs compared.

* :func:`time_call`: the call's ``triton.testing.do_bench`` median, each kernel's GPU
  time per call (:func:`kernel_ms`: torch.profiler over ``iters`` calls) and the host's
  enqueue time per call.
* :func:`run_variant` (in the variant's process) prints one table row per shape and keeps
  the outputs in ``/tmp``; :func:`compare_outputs` (in the parent) reads them back.
"""
from __future__ import annotations

from typing import Callable

import torch


def time_call(fn: Callable[[], object], iters: int = 20) -> tuple[float, dict[str, float], float]:
    """``(median ms, {kernel name: ms per call}, host enqueue µs per call)`` of ``fn`` on the
    current CUDA device (enqueue: ``iters`` back-to-back calls, timed on the host)."""
    import time

    import triton

    ms = triton.testing.do_bench(fn, warmup=10, rep=200)
    per = kernel_ms(fn, iters)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    enqueue = (time.perf_counter() - start) / iters * 1e6
    torch.cuda.synchronize()
    return ms, per, enqueue


def kernel_ms(fn: Callable[[], object], iters: int = 20) -> dict[str, float]:
    """``{kernel name: GPU ms per call}`` of ``fn``'s kernels (torch.profiler over ``iters``
    calls on the current CUDA device)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return {e.key.split("(")[0]: e.device_time_total / iters / 1e3 for e in prof.key_averages() if "kernel" in e.key}


def run_variant(study: str, tag: str, calls: dict[str, dict]) -> None:
    """Run, save and time each public call of ``calls`` (name -> ``chunk_gated_delta_rule``
    keyword arguments) as variant ``tag`` of ``study``; print a table row per call."""
    from gdn_dispatch import chunk_gated_delta_rule

    for name, call in calls.items():
        o, s = chunk_gated_delta_rule(**call)
        torch.save((o.cpu(), s.cpu()), f"/tmp/{study}_{name}_{tag}.pt")
        ms, per, enqueue = time_call(lambda: chunk_gated_delta_rule(**call))
        print(f"| {tag} | {name} | {ms:.4f} | {enqueue:.0f} | "
              + ", ".join(f"{k[:22]} {v:.4f}" for k, v in per.items()) + " |", flush=True)


def compare_outputs(study: str, names, base: str, other: str) -> None:
    """Print how far variant ``other``'s outputs are from ``base``'s (relative RMS)."""
    from gdn_dispatch.testing import rel_rms_error

    for name in names:
        a, b = (torch.load(f"/tmp/{study}_{name}_{tag}.pt") for tag in (base, other))
        print(f"{name}: o differs by {rel_rms_error(b[0].float(), a[0].float()):.2e}, "
              f"state by {rel_rms_error(b[1], a[1]):.2e}")
