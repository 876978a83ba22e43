"""Timing one shape: rotating input sets larger together than the L2 cache
(:func:`rotation_count`, :func:`make_input_sets`), the callers of each library (ours with a
backend forced, fla's), the CUDA-event timer, and :func:`bench_shape`, which times every
caller on one shape and optionally checks their outputs against a baseline.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from gdn_dispatch.bench_report import FLA, Measurement, ShapeResult, finish, from_times
from gdn_dispatch.bench_shapes import (
    BETA_DTYPE,
    G_DTYPE,
    QKV_DTYPE,
    STATE_DTYPE,
    BenchShape,
    flop_count,
    min_bytes,
    sol_bound_s,
)
from gdn_dispatch.registry import GDNDispatchError
from gdn_dispatch.testing import rel_rms_error

# Rotation: the input sets of one shape together must exceed this many bytes (about 2.5x
# the H200's L2), or 3x the device's own L2 when that is larger, so no call finds its
# inputs still cached from an earlier one. More sets than MAX_INPUT_SETS buy nothing.
ROTATION_BUDGET_BYTES = 150 * 10**6
MAX_INPUT_SETS = 8


def rotation_count(set_bytes: int, l2_bytes: int = 0, budget: int = ROTATION_BUDGET_BYTES,
                   cap: int = MAX_INPUT_SETS) -> int:
    """How many input sets to rotate among: ``ceil(budget / set_bytes) + 1``, at most ``cap``.

    The ``+ 1`` keeps at least two sets even for huge shapes, so a call never reruns on
    the set the previous call just read. ``budget`` grows to ``3 * l2_bytes`` on devices
    with a larger L2 than the H200's.
    """
    budget = max(budget, 3 * l2_bytes)
    return min(cap, math.ceil(budget / max(set_bytes, 1)) + 1)


# --------------------------------------------------------------------------- inputs and callers


@dataclass(frozen=True)
class BenchInputs:
    """One input set, in the form each library takes it.

    q, k ``[B, T, H, K]`` bf16 (l2-normalized unless ``qk_l2norm``); v ``[B, T, HV, V]``
    bf16; g ``[B, T, HV]`` fp32 (logsigmoid, so <= 0); beta ``[B, T, HV]`` bf16 (sigmoid);
    h0 ``[N, HV, K, V]`` fp32 ("kv" layout). For ragged shapes ``cu_seqlens`` ``[N + 1]``
    int32 on the device with its CPU copy (ours), and ``cu_seqlens_long`` int64 (fla's
    LongTensor); all None for uniform batches.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    h0: torch.Tensor
    scale: float
    qk_l2norm: bool
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_cpu: torch.Tensor | None = None
    cu_seqlens_long: torch.Tensor | None = None


def make_input_sets(shape: BenchShape, count: int, device: torch.device | str, seed: int,
                    qk_l2norm: bool = False) -> list[BenchInputs]:
    """``count`` independent random input sets for ``shape`` on ``device``.

    With ``qk_l2norm`` q and k are left raw and both libraries normalize them in-kernel
    (as Qwen3.5 calls it); otherwise they are normalized here and the kernels skip it.
    The ``cu_seqlens`` tensors are shared by all sets: the lengths are the shape's.
    The distributions are those of :func:`gdn_dispatch.testing.random_call`, but drawn on
    ``device``: a set of the largest shapes is about a gigabyte, slow to draw on a host CPU.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    B, T, H, HV, K, V = shape.B, shape.T, shape.H, shape.HV, shape.K, shape.V
    cu = cu_cpu = cu_long = None
    if shape.is_varlen:
        offsets = [0]
        for length in shape.seqlens:
            offsets.append(offsets[-1] + length)
        cu_cpu = torch.tensor(offsets, dtype=torch.int32)
        cu = cu_cpu.to(device)
        cu_long = cu.long()

    def randn(*size, dtype):
        return torch.randn(*size, generator=gen, device=device, dtype=dtype)

    def qk():
        x = randn(B, T, H, K, dtype=torch.float32)
        if not qk_l2norm:
            x = torch.nn.functional.normalize(x, p=2.0, dim=-1)
        return x.to(QKV_DTYPE)

    sets = []
    for _ in range(count):
        sets.append(BenchInputs(
            q=qk(), k=qk(),
            v=randn(B, T, HV, V, dtype=QKV_DTYPE),
            g=torch.nn.functional.logsigmoid(randn(B, T, HV, dtype=torch.float32)).to(G_DTYPE),
            beta=torch.sigmoid(randn(B, T, HV, dtype=torch.float32)).to(BETA_DTYPE),
            # Small, like a state carried over from an earlier prefill chunk.
            h0=(0.05 * randn(shape.N, HV, K, V, dtype=torch.float32)).to(STATE_DTYPE),
            scale=K ** -0.5, qk_l2norm=qk_l2norm,
            cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, cu_seqlens_long=cu_long,
        ))
    return sets


Caller = Callable[[BenchInputs], tuple]


def ours_caller(backend: str, context_parallel: str | int = "auto") -> Caller:
    """gdn-dispatch's op with ``backend`` forced and ``context_parallel`` as given; passes
    cu_seqlens_cpu so it never syncs."""
    from gdn_dispatch.api import chunk_gated_delta_rule

    def call(x: BenchInputs):
        return chunk_gated_delta_rule(
            x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.h0, output_final_state=True,
            cu_seqlens=x.cu_seqlens, cu_seqlens_cpu=x.cu_seqlens_cpu,
            use_qk_l2norm_in_kernel=x.qk_l2norm, backend=backend, context_parallel=context_parallel,
        )
    return call


def launches_note(backend: str, x: BenchInputs, device, context_parallel: str | int = "auto") -> str:
    """What ``backend`` launches for the call :func:`ours_caller` makes on ``x`` with
    ``context_parallel`` (its kernels, as ``explain`` reads them from the backend's dry run;
    "" where the backend does not say), for ``device`` (a DeviceInfo)."""
    from gdn_dispatch.contract import make_problem
    from gdn_dispatch.registry import CallSpec, explain

    problem = make_problem(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.h0, output_final_state=True,
                           cu_seqlens=x.cu_seqlens, cu_seqlens_cpu=x.cu_seqlens_cpu,
                           use_qk_l2norm_in_kernel=x.qk_l2norm, context_parallel=context_parallel)
    launches = explain(device, CallSpec.from_problem(problem), problem=problem, backend=backend).launches
    # The kernels only: why the path is taken is explain's to say.
    return "" if launches is None else launches.split(" (")[0]


def fla_caller(fla_fn: Callable) -> Caller:
    """fla's ``chunk_gated_delta_rule`` on the same inputs (int64 cu_seqlens, as fla documents)."""
    def call(x: BenchInputs):
        return fla_fn(
            x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.h0, output_final_state=True,
            cu_seqlens=x.cu_seqlens_long, use_qk_l2norm_in_kernel=x.qk_l2norm,
        )
    return call


def load_fla() -> tuple[Callable | None, str | None, str | None]:
    """fla's op, its version, and why it is unavailable (None when it loaded)."""
    # fla's optional FlashQLA path would swap kernels under the comparison; the plain
    # Triton path is the baseline. setdefault: a caller's own choice still wins.
    os.environ.setdefault("FLA_FLASH_QLA", "0")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn
    except Exception as exc:  # any import failure means "skip fla", with its reason
        return None, None, f"not importable: {type(exc).__name__}: {exc}"
    return fla_fn, fla_version(), None


def fla_version() -> str | None:
    """The installed fla version (under either distribution name it ships as), or None."""
    for dist in ("flash-linear-attention", "fla-core"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    fla = sys.modules.get("fla")
    return getattr(fla, "__version__", None)


Timer = Callable[[Caller, list[BenchInputs], int, int], list[float]]


def cuda_event_timer(call: Caller, sets: list[BenchInputs], warmup: int, iters: int) -> list[float]:
    """Per-call times in ms: ``warmup`` untimed calls, then ``iters`` event-bracketed calls.

    Calls rotate over ``sets``. Nothing in the timed loop waits for the device; the one
    synchronize after it lets the events be read.
    """
    for i in range(warmup):
        call(sets[i % len(sets)])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        call(sets[i % len(sets)])
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def bench_shape(shape: BenchShape, sets: list[BenchInputs], callers: dict[str, Caller], *,
                bandwidth: float, matmul_rate: float, timer: Timer, warmup: int, iters: int,
                check_against: tuple[str, Caller] | None = None,
                describe: Callable[[str, BenchInputs], str] | None = None) -> ShapeResult:
    """Time every caller on ``sets``; with ``check_against`` also compare outputs on set 0;
    with ``describe``, each of our rows' note is ``describe(name, set 0)`` (its launches).

    A backend that cannot run the call (GDNDispatchError) gets a note; any other exception
    from one of ours marks its row failed. fla's exceptions are notes: it is a yardstick.
    """
    nbytes, flops = min_bytes(shape), flop_count(shape)
    bound_s, bound_by = sol_bound_s(nbytes, flops, bandwidth, matmul_rate)
    result = ShapeResult(shape=shape, min_bytes=nbytes, flops=flops, bound_ms=bound_s * 1e3,
                         bound_by=bound_by, input_sets=len(sets))
    for name, call in callers.items():
        try:
            m = from_times(name, timer(call, sets, warmup, iters))
        except GDNDispatchError as exc:
            m = Measurement(backend=name, note=f"cannot run: {exc}")
        except Exception as exc:  # report and go on to the next backend
            m = Measurement(backend=name, note=f"error: {type(exc).__name__}: {exc}", failed=name != FLA)
        if describe is not None and name != FLA and m.ms is not None:
            m.note = describe(name, sets[0])
        result.measurements.append(m)
    if check_against is not None:
        _check_outputs(result, sets[0], callers, check_against)
    return finish(result)


def _check_outputs(result: ShapeResult, inputs: BenchInputs, callers: dict[str, Caller],
                   check_against: tuple[str, Caller]) -> None:
    """Fill err_o / err_state of every timed row: rel. RMS error against the baseline's output."""
    base_name, base_call = check_against
    try:
        base_o, base_state = base_call(inputs)
    except Exception as exc:
        for m in result.measurements:
            m.note = (m.note + f"; check: {base_name} failed: {type(exc).__name__}").lstrip("; ")
        return
    for m in result.measurements:
        if m.ms is None:
            continue
        try:
            o, state = callers[m.backend](inputs)
        except Exception as exc:  # it ran when timed; say so rather than lose the table
            m.note = (m.note + f"; check: {type(exc).__name__}: {exc}").lstrip("; ")
            continue
        m.err_o, m.err_state = rel_rms_error(o, base_o), rel_rms_error(state, base_state)
        del o, state
