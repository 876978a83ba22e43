"""``python -m gdn_dispatch bench``: every backend side by side, against fla and the speed of light.

One run times, on one CUDA device, every gdn-dispatch backend that can run there (each
forced with ``backend=name``) and flash-linear-attention's ``chunk_gated_delta_rule``
when it is importable, over a table of Qwen3.5-shaped prefill calls. Each time is put
next to two yardsticks measured on the same device in the same run:

* the *speed of light* (SOL): ``max(min_bytes / copy bandwidth, flops / matmul rate)``,
  where ``min_bytes`` reads every input and writes every output exactly once and
  ``flops`` is fla's pipeline count (see :func:`flop_count`);
* fla's own time on the same inputs.

Timing protocol: a few warm-up calls (so Triton compiles and autotunes outside the
measurement), then ``--iters`` calls, each bracketed by a pair of CUDA events, with no
host synchronization in between; the median is reported. The calls rotate among enough
input sets that the sets together exceed the L2 cache several times over, so every call
reads its inputs from HBM as a real prefill would.

The pure parts (shape table, byte and FLOP counts, the bound, the rotation count, and in
:mod:`gdn_dispatch.bench_report` the results, the table, the JSON report and the plot) are
plain functions tested on the CPU; only the timers and :func:`run` need a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import importlib.metadata
import math
import os
import random
import statistics
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from gdn_dispatch.bench_report import (
    FLA,
    Measurement,
    ShapeResult,
    build_report,
    command_line,
    finish,
    format_columns,
    format_shape_block,
    from_times,
    write_json,
    write_plot,
)
from gdn_dispatch.contract import CHUNK_SIZE
from gdn_dispatch.registry import CallSpec, GDNDispatchError, backend_names, explain
from gdn_dispatch.testing import rel_rms_error

REFERENCE = "reference"

# What Qwen3-Next / Qwen3.5 pass: bf16 activations, the decay g in float32 (it comes out of
# a float32 softplus), beta in the activation dtype, and a float32 recurrent state.
QKV_DTYPE = torch.bfloat16
G_DTYPE = torch.float32
BETA_DTYPE = torch.bfloat16
STATE_DTYPE = torch.float32
HEAD_DIM = 128
HEAD_CONFIGS = ((16, 32), (16, 64))  # (H, HV): Qwen3.5's grouped value heads, 2x and 4x
UNIFORM_BATCHES = ((1, 8192), (1, 32768), (4, 8192), (8, 4096))  # (B, T)
RAGGED_COUNT = 16
RAGGED_MAX_LEN = 8192
# Fixed, not --seed: a shape name must mean the same lengths in every run and report.
RAGGED_SEED = 2025

# Rotation: the input sets of one shape together must exceed this many bytes (about 2.5x
# the H200's L2), or 3x the device's own L2 when that is larger, so no call finds its
# inputs still cached from an earlier one. More sets than MAX_INPUT_SETS buy nothing.
ROTATION_BUDGET_BYTES = 150 * 10**6
MAX_INPUT_SETS = 8

COPY_BYTES = 1 << 30
MATMUL_N = 8192
CEILING_ITERS = 10

FLOP_FORMULA = "per token and v-head: 6*K*V + C*(6*K + 4*V) + 2*C*C/3 (fla's pipeline count), C = 64"
BOUND_FORMULA = "bound = max(min_bytes / copy bandwidth, flops / bf16 matmul rate)"

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


# --------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class BenchShape:
    """One benchmarked call.

    A uniform batch is ``B`` rows of ``T`` tokens (no ``cu_seqlens``); a ragged one has
    ``seqlens`` and is packed as ``B = 1``, ``T = sum(seqlens)`` with ``cu_seqlens``.
    """

    name: str
    H: int
    HV: int
    B: int
    T: int
    K: int = HEAD_DIM
    V: int = HEAD_DIM
    seqlens: tuple[int, ...] | None = None

    @property
    def tokens(self) -> int:
        return self.B * self.T

    @property
    def N(self) -> int:
        """Number of sequences (and of initial/final states)."""
        return self.B if self.seqlens is None else len(self.seqlens)

    @property
    def is_varlen(self) -> bool:
        return self.seqlens is not None

    def describe(self) -> str:
        if self.is_varlen:
            rows = f"{self.N} seqs, {self.tokens} tokens (lengths {min(self.seqlens)}..{max(self.seqlens)})"
        else:
            rows = f"B={self.B} T={self.T}"
        return f"{rows}, H={self.H} HV={self.HV} K={self.K} V={self.V}"


def ragged_lengths(count: int = RAGGED_COUNT, max_len: int = RAGGED_MAX_LEN,
                   seed: int = RAGGED_SEED) -> tuple[int, ...]:
    """``count`` sequence lengths drawn uniformly from ``[1, max_len]``, reproducibly."""
    rng = random.Random(seed)
    return tuple(rng.randint(1, max_len) for _ in range(count))


def default_shapes() -> list[BenchShape]:
    """The default table: each (H, HV) with every uniform batch, then one ragged batch."""
    shapes = []
    lengths = ragged_lengths()
    for H, HV in HEAD_CONFIGS:
        for B, T in UNIFORM_BATCHES:
            shapes.append(BenchShape(name=f"H{H}-HV{HV}-{B}x{T}", H=H, HV=HV, B=B, T=T))
        shapes.append(BenchShape(name=f"H{H}-HV{HV}-ragged{len(lengths)}", H=H, HV=HV, B=1,
                                 T=sum(lengths), seqlens=lengths))
    return shapes


def select_shapes(shapes: list[BenchShape], patterns: str | None) -> list[BenchShape]:
    """The shapes named by a comma-separated list of names or glob patterns, in table order.

    Raises ValueError naming a pattern that matches nothing, with the valid names.
    """
    if not patterns:
        return list(shapes)
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    names = [s.name for s in shapes]
    for pattern in wanted:
        if not fnmatch.filter(names, pattern):
            raise ValueError(f"--shapes: {pattern!r} matches no shape; valid names: {', '.join(names)}")
    return [s for s in shapes if any(fnmatch.fnmatchcase(s.name, p) for p in wanted)]


# --------------------------------------------------------------------------- bytes, flops, bound


def io_bytes(shape: BenchShape) -> tuple[int, int]:
    """``(read, written)``: the least traffic any implementation needs, in bytes.

    Read once: q, k ``[B, T, H, K]`` and v ``[B, T, HV, V]`` (bf16), g (fp32), beta (bf16)
    ``[B, T, HV]``, the initial state ``[N, HV, K, V]`` (fp32). Written once: o
    ``[B, T, HV, V]`` (bf16) and the final state ``[N, HV, K, V]`` (fp32).
    """
    n, hv = shape.tokens, shape.HV
    qkv = QKV_DTYPE.itemsize
    state = shape.N * hv * shape.K * shape.V * STATE_DTYPE.itemsize
    read = (2 * n * shape.H * shape.K * qkv + n * hv * shape.V * qkv
            + n * hv * (G_DTYPE.itemsize + BETA_DTYPE.itemsize) + state)
    written = n * hv * shape.V * qkv + state
    return read, written


def min_bytes(shape: BenchShape) -> int:
    """Inputs read once plus outputs written once, in bytes (see :func:`io_bytes`)."""
    return sum(io_bytes(shape))


def flop_count(shape: BenchShape, chunk: int = CHUNK_SIZE) -> float:
    """fla's pipeline FLOPs: ``(6KV + C(6K + 4V) + 2C^2/3)`` per token and v-head.

    The terms: ``6KV`` for the state pass (``w h``, ``k^T v_new``) and ``q h``; ``C(6K + 4V)``
    for the intra-chunk ``k k^T``, ``q k^T`` and the ``T``-products forming w, u and the
    causal ``(q k^T) v_new``; ``2C^2/3`` for the triangular inverse. Partial chunks of ragged
    sequences are counted as if full-width per token, which is what the kernels compute.
    """
    K, V, C = shape.K, shape.V, chunk
    per_token = 6 * K * V + C * (6 * K + 4 * V) + 2 * C * C / 3
    return float(shape.tokens * shape.HV * per_token)


def sol_bound_s(nbytes: float, flops: float, bandwidth: float, matmul_rate: float) -> tuple[float, str]:
    """The speed-of-light time in seconds, and which ceiling sets it ("memory" or "compute").

    ``bandwidth`` in bytes/s (read + written), ``matmul_rate`` in FLOP/s.
    """
    memory, compute = nbytes / bandwidth, flops / matmul_rate
    return (memory, "memory") if memory >= compute else (compute, "compute")


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


def ours_caller(backend: str) -> Caller:
    """gdn-dispatch's op with ``backend`` forced; passes cu_seqlens_cpu so it never syncs."""
    from gdn_dispatch.api import chunk_gated_delta_rule

    def call(x: BenchInputs):
        return chunk_gated_delta_rule(
            x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.h0, output_final_state=True,
            cu_seqlens=x.cu_seqlens, cu_seqlens_cpu=x.cu_seqlens_cpu,
            use_qk_l2norm_in_kernel=x.qk_l2norm, backend=backend,
        )
    return call


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
    return fla_fn, _fla_version(), None


def _fla_version() -> str | None:
    for dist in ("flash-linear-attention", "fla-core"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    fla = sys.modules.get("fla")
    return getattr(fla, "__version__", None)


# --------------------------------------------------------------------------- timing (GPU)


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


def median_event_ms(fn: Callable[[], object], iters: int = CEILING_ITERS, warmup: int = 3) -> float:
    """Median CUDA-event ms of ``fn()`` over ``iters`` calls after ``warmup`` (one input)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def measure_copy_bandwidth(device: torch.device, nbytes: int = COPY_BYTES) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_event_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


def measure_matmul_rate(device: torch.device, n: int = MATMUL_N) -> float:
    """bf16 ``n^3`` torch.matmul rate in FLOP/s, on random data (zeros would run cooler)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    ms = median_event_ms(lambda: torch.matmul(a, b))
    del a, b
    return 2 * n ** 3 / (ms * 1e-3)


# --------------------------------------------------------------------------- one shape


def bench_shape(shape: BenchShape, sets: list[BenchInputs], callers: dict[str, Caller], *,
                bandwidth: float, matmul_rate: float, timer: Timer, warmup: int, iters: int,
                check_against: tuple[str, Caller] | None = None) -> ShapeResult:
    """Time every caller on ``sets``; with ``check_against`` also compare outputs on set 0.

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


# --------------------------------------------------------------------------- the subcommand


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``python -m gdn_dispatch bench``."""
    parser.add_argument("--backends", metavar="LIST",
                        help="comma-separated backends to time: registry names and 'fla' "
                             "(default: every registry backend that can run here except "
                             f"'{REFERENCE}', plus fla when importable)")
    parser.add_argument("--shapes", metavar="LIST",
                        help="comma-separated shape names or glob patterns (default: all; see --list-shapes)")
    parser.add_argument("--list-shapes", action="store_true", help="print the shape table and exit")
    parser.add_argument("--iters", type=_positive_int, default=30, help="timed calls per backend and shape (default 30)")
    parser.add_argument("--warmup", type=_non_negative_int, default=5,
                        help="untimed calls first, to compile and autotune (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument("--device", type=_cuda_index, default=0, metavar="cuda[:N]",
                        help="the CUDA device to bench (default cuda:0)")
    parser.add_argument("--qk-l2norm", action="store_true",
                        help="pass raw q, k with use_qk_l2norm_in_kernel=True (default: pre-normalized, False)")
    parser.add_argument("--check", action="store_true",
                        help="also report each backend's rel. RMS error of o and final state against fla "
                             f"(against '{REFERENCE}' when fla is unavailable)")
    parser.add_argument("--json", metavar="FILE", help="write every result to FILE as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="write a bar chart of fraction of SOL (needs matplotlib)")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def _cuda_index(text: str) -> int:
    """"cuda" -> 0, "cuda:N" or "N" -> N; the bench runs on CUDA devices only."""
    head, _, index = text.strip().partition(":")
    if head.isdigit() and not index:
        return int(head)
    if head == "cuda" and (not index or index.isdigit()):
        return int(index or 0)
    raise argparse.ArgumentTypeError(f"expected cuda or cuda:N, got {text!r}")


def requested_backends(text: str | None, names: list[str]) -> tuple[list[str], bool]:
    """Registry backends to try, in registry order, and whether fla is wanted.

    Default: every registry name but the reference, plus fla. Raises ValueError for an
    unknown name, listing the valid ones.
    """
    if not text:
        return [n for n in names if n != REFERENCE], True
    wanted = [w.strip() for w in text.split(",") if w.strip()]
    for w in wanted:
        if w != FLA and w not in names:
            raise ValueError(f"--backends: unknown backend {w!r}; valid names: {', '.join(names + [FLA])}")
    return [n for n in names if n in wanted], FLA in wanted


def no_device_reason(probe, index: int) -> str | None:
    """Why the benchmark cannot run on CUDA device ``index``, or None."""
    count = probe.count()
    if count == 0:
        return probe.unavailable_reason or "the CUDA driver reports 0 devices"
    if index >= count:
        return f"--device cuda:{index} asked, but only {count} CUDA device(s) present"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} was built without CUDA support"
    return None


# The least every shape asks of a backend. Varlen is left out on purpose: a backend
# without it still runs the uniform shapes, and the ragged one reports why it cannot.
_BENCH_CALL = CallSpec(dtype="bfloat16", K=HEAD_DIM, V=HEAD_DIM, varlen=False, grouped_value_heads=True,
                       initial_state=True, final_state=True)


def discover_backends(device_info, names: list[str], qk_l2norm: bool) -> tuple[list[str], dict[str, str]]:
    """Which of ``names`` can run on this device (each forced, as a call would), and why not."""
    call = dataclasses.replace(_BENCH_CALL, qk_l2norm=qk_l2norm)
    runnable, skipped = [], {}
    for name in names:
        exp = explain(device_info, call, backend=name)
        if exp.selected == name:
            runnable.append(name)
        else:
            skipped[name] = next(v.reason for v in exp.verdicts if v.name == name)
    return runnable, skipped


def run(args: argparse.Namespace, *, probe=None, out=None) -> int:
    """Run the benchmark; returns the exit code.

    0: done; 1: one of our backends raised on some shape, or nothing could run; 2: no CUDA
    device, or bad flags.
    ``probe`` (a DeviceProbe) and ``out`` (a text stream) are for tests.
    """
    out = out or sys.stdout
    try:
        shapes = select_shapes(default_shapes(), args.shapes)
        names, want_fla = requested_backends(args.backends, backend_names())
    except ValueError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.list_shapes:
        for s in shapes:
            print(f"{s.name:<22} {s.describe()}", file=out)
        return EXIT_OK

    if probe is None:
        from gdn_dispatch.device import default_probe
        probe = default_probe()
    reason = no_device_reason(probe, args.device)
    if reason is not None:
        print(f"bench needs a CUDA device; found none: {reason}", file=sys.stderr)
        return EXIT_USAGE

    with torch.inference_mode():
        return _run_on_device(args, shapes, names, want_fla, probe, out)


def _run_on_device(args, shapes, names, want_fla, probe, out) -> int:
    device = torch.device("cuda", args.device)
    torch.cuda.set_device(device)
    info = probe.for_torch_device(device)
    props = torch.cuda.get_device_properties(device)
    l2_bytes = int(getattr(props, "L2_cache_size", 0) or 0)

    runnable, skipped = discover_backends(info, names, args.qk_l2norm)
    callers: dict[str, Caller] = {name: ours_caller(name) for name in runnable}
    fla_fn, fla_version, fla_reason = load_fla() if want_fla else (None, None, "not requested")
    if fla_fn is not None:
        callers[FLA] = fla_caller(fla_fn)

    if not callers:
        reasons = "; ".join(f"{k}: {v}" for k, v in skipped.items()) or "none requested"
        print(f"bench: nothing to time on {info.label} ({info.arch}): {reasons}; fla: {fla_reason}",
              file=sys.stderr)
        return EXIT_FAILED

    versions = {"python": sys.version.split()[0], "torch": torch.__version__,
                "triton": _dist_version("triton"), "gdn_dispatch": _gdn_version(), "fla": fla_version}
    bandwidth, matmul_rate = measure_copy_bandwidth(device), measure_matmul_rate(device)
    ceilings = {"copy_bandwidth_GBps": bandwidth / 1e9, "copy_bytes": COPY_BYTES,
                "matmul_bf16_TFLOPs": matmul_rate / 1e12, "matmul_n": MATMUL_N,
                "chunk": CHUNK_SIZE, "flop_formula": FLOP_FORMULA, "bound_formula": BOUND_FORMULA}
    check_against = None
    if args.check:
        check_against = (FLA, callers[FLA]) if FLA in callers else (REFERENCE, ours_caller(REFERENCE))

    _print_header(out, info, versions, bandwidth, matmul_rate, args, skipped, want_fla, fla_reason,
                  check_against)
    results = bench_all(shapes, callers, device, bandwidth=bandwidth, matmul_rate=matmul_rate,
                        timer=cuda_event_timer, warmup=args.warmup, iters=args.iters, seed=args.seed,
                        qk_l2norm=args.qk_l2norm, l2_bytes=l2_bytes, check_against=check_against, out=out)
    report = build_report(
        results,
        device={"name": info.name, "capability": f"{info.capability[0]}.{info.capability[1]}",
                "arch": info.arch, "sm_count": info.sm_count, "l2_bytes": l2_bytes},
        versions=versions, ceilings=ceilings,
        settings={"iters": args.iters, "warmup": args.warmup, "seed": args.seed, "qk_l2norm": args.qk_l2norm,
                  "check_against": None if check_against is None else check_against[0],
                  "skipped": skipped, "fla_unavailable": fla_reason if fla_fn is None else None},
        command=command_line(sys.argv),
    )
    return finish_run(args, results, report, out)


def bench_all(shapes: list[BenchShape], callers: dict[str, Caller], device: torch.device | str, *,
              bandwidth: float, matmul_rate: float, timer: Timer, warmup: int, iters: int, seed: int,
              qk_l2norm: bool = False, l2_bytes: int = 0, check_against: tuple[str, Caller] | None = None,
              out=None) -> list[ShapeResult]:
    """Each shape in turn: fresh rotating input sets, every caller timed, its block printed.

    The table is printed as it grows, so a long run shows progress and a crash mid-run
    still leaves the finished shapes on screen.
    """
    out = out or sys.stdout
    check = check_against is not None
    print(format_columns(check), file=out)
    results = []
    for shape in shapes:
        count = rotation_count(io_bytes(shape)[0], l2_bytes)
        sets = make_input_sets(shape, count, device, seed, qk_l2norm)
        result = bench_shape(shape, sets, callers, bandwidth=bandwidth, matmul_rate=matmul_rate,
                             timer=timer, warmup=warmup, iters=iters, check_against=check_against)
        del sets
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()  # the next shape's sets may be larger; give the memory back
        results.append(result)
        print("\n".join(format_shape_block(result, check)), file=out, flush=True)
    return results


def finish_run(args: argparse.Namespace, results: list[ShapeResult], report: dict, out) -> int:
    """Write --json and --plot, and return the exit code: 1 when one of ours raised."""
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}", file=out)
    if args.plot:
        note = write_plot(args.plot, report)
        print(note or f"wrote {args.plot}", file=out)
    failed = [f"{r.shape.name}/{m.backend}" for r in results for m in r.measurements if m.failed]
    if failed:
        print(f"bench: failed: {', '.join(failed)}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _print_header(out, info, versions, bandwidth, matmul_rate, args, skipped, want_fla, fla_reason,
                  check_against) -> None:
    print(f"gdn-dispatch bench on {info.name} ({info.arch}, {info.sm_count} SMs); "
          + ", ".join(f"{k} {v}" for k, v in versions.items() if v is not None), file=out)
    print(f"ceilings: copy {bandwidth / 1e12:.2f} TB/s ({COPY_BYTES >> 20} MiB device-to-device, "
          f"read + written), bf16 matmul {matmul_rate / 1e12:.1f} TFLOP/s ({MATMUL_N}^3 torch.matmul)", file=out)
    print(f"FLOPs {FLOP_FORMULA}; {BOUND_FORMULA}", file=out)
    print("x SOL = time / bound, x fla = time / fla's time (both: lower is better); "
          f"ms = median of {args.iters} CUDA-event-timed calls after {args.warmup} warm-up calls, "
          "rotating input sets larger together than the L2 cache", file=out)
    for name, reason in skipped.items():
        print(f"skipping {name}: {reason}", file=out)
    if want_fla and fla_reason is not None:
        print(f"skipping fla: {fla_reason}", file=out)
    if check_against is not None:
        print(f"--check: err = ||x - {check_against[0]}|| / ||{check_against[0]}|| (float64) on input set 0",
              file=out)


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gdn_version() -> str:
    import gdn_dispatch
    return gdn_dispatch.__version__
