"""Warm-up: compile, before serving, every kernel specialization a stream of ragged calls
with given head dims can hit on a device, so that no later call compiles.

A Triton kernel is compiled once per *specialization*: its constexpr arguments (flags such
as initial/final state, varlen tails, tile sizes a planner picked), the dtypes of its
pointer arguments, and the value class of each integer argument (``== 1``, divisible by 16).
For fixed dims, dtypes and state layout, what varies from call to call is the shape of the
batch: the number of sequences ``N`` (tile and pipeline choices depend on how many programs
fill the SMs), whether some sequence ends inside a chunk (tails), the token count ``T``
(integer arguments such as the qk-norm row count), uniform batch or ``cu_seqlens``, and
whether an initial state is given and a final state asked.

:func:`plan_warmup` enumerates that: it builds candidate calls (a representative ``N`` for
every ``N`` at which the backend's choice changes, up to ``max_num_seqs``; each with and
without tails and with several residues of ``T`` mod 16; uniform and varlen; every state
flag), computes each candidate's specialization keys without a GPU
(:func:`specialization_keys`: the Gluon backends' launch plans, triton_generic's launch
table), and keeps the fewest candidates that cover every key. :func:`warmup` then runs those
calls on the device (small inputs, a progress bar on stderr) and reports the time.

Inputs are assumed as :func:`gdn_dispatch.contract.make_problem` leaves them for the
kernels: contiguous, 16-byte aligned (any torch allocation). Row-strided views of a fused
projection have their own token stride: warm up with ``example`` calls of that layout
(:func:`warmup`'s ``example`` argument) to cover them.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from gdn_dispatch.contract import CHUNK_SIZE, GDNProblem, StateLayout, make_problem
from gdn_dispatch.device import DeviceInfo, default_probe
from gdn_dispatch.registry import select

#: Length of the last sequence of a candidate (the others are whole chunks): no tail (64),
#: and tails giving T = 0, 1, 8 (mod 16), and T == 1 for a single sequence.
LAST_LENGTHS = (64, 1, 8, 16, 17, 40)


@dataclass(frozen=True)
class WarmupSpec:
    """The fixed part of every call a model layer makes (its dims, dtypes, layout, flags).

    ``H`` q/k heads, ``HV`` v heads, ``K``/``V`` head dims; ``dtype`` of q, k, v; ``g_dtype``
    and ``beta_dtype`` (None: q's dtype) of the gate and beta; ``state_dtype`` of the
    initial state; ``max_num_seqs`` the most sequences in one call.
    """

    H: int
    HV: int
    K: int
    V: int
    dtype: torch.dtype = torch.bfloat16
    state_layout: str = "kv"
    use_qk_l2norm: bool = True
    g_dtype: torch.dtype = torch.float32
    beta_dtype: torch.dtype | None = None
    state_dtype: torch.dtype = torch.float32
    max_num_seqs: int = 64
    initial_states: tuple[bool, ...] = (False, True)
    final_states: tuple[bool, ...] = (False, True)


@dataclass(frozen=True)
class WarmupCall:
    """One representative call: ``lengths`` (varlen, B = 1) or ``batch`` = (B, T) (uniform)."""

    lengths: tuple[int, ...] | None
    batch: tuple[int, int] | None
    initial_state: bool
    output_final_state: bool

    @property
    def N(self) -> int:
        return len(self.lengths) if self.lengths is not None else self.batch[0]

    @property
    def tokens(self) -> int:
        return sum(self.lengths) if self.lengths is not None else self.batch[0] * self.batch[1]

    def label(self) -> str:
        shape = f"varlen N={self.N} T={self.tokens}" if self.lengths is not None else f"B={self.batch[0]} T={self.batch[1]}"
        return f"{shape}{' h0' if self.initial_state else ''}{' ht' if self.output_final_state else ''}"


def make_call(spec: WarmupSpec, call: WarmupCall, device: torch.device | str = "cpu", *,
              random: bool = False, seed: int = 0) -> dict:
    """Keyword arguments of ``chunk_gated_delta_rule`` for ``call`` (uninitialized tensors
    unless ``random``: specializations depend on shapes and dtypes only)."""
    gen = torch.Generator().manual_seed(seed)
    if call.lengths is not None:
        B, T = 1, sum(call.lengths)
    else:
        B, T = call.batch

    def tensor(*shape, dtype, kind="randn"):
        if not random:
            return torch.empty(shape, dtype=dtype, device=device)
        x = torch.randn(shape, generator=gen) if kind == "randn" else torch.rand(shape, generator=gen)
        if kind == "gate":
            x = torch.nn.functional.logsigmoid(torch.randn(shape, generator=gen))
        return x.to(device=device, dtype=dtype)

    kwargs = dict(
        q=tensor(B, T, spec.H, spec.K, dtype=spec.dtype), k=tensor(B, T, spec.H, spec.K, dtype=spec.dtype),
        v=tensor(B, T, spec.HV, spec.V, dtype=spec.dtype), g=tensor(B, T, spec.HV, dtype=spec.g_dtype, kind="gate"),
        beta=tensor(B, T, spec.HV, dtype=spec.beta_dtype or spec.dtype, kind="rand"),
        state_layout=spec.state_layout, use_qk_l2norm_in_kernel=spec.use_qk_l2norm,
        output_final_state=call.output_final_state,
    )
    if call.initial_state:
        per_head = (spec.K, spec.V) if spec.state_layout == StateLayout.KV.value else (spec.V, spec.K)
        kwargs["initial_state"] = tensor(call.N, spec.HV, *per_head, dtype=spec.state_dtype)
    if call.lengths is not None:
        offsets = torch.tensor([0, *torch.tensor(call.lengths).cumsum(0).tolist()], dtype=torch.int32)
        kwargs["cu_seqlens"] = offsets.to(device)
        kwargs["cu_seqlens_cpu"] = offsets
    return kwargs


# --- specialization keys, per backend ---------------------------------------------------

def _value_class(value):
    """What Triton's binder specializes an integer argument on."""
    if isinstance(value, bool) or not isinstance(value, int):
        return type(value).__name__
    return value == 1, value % 16 == 0, -2**31 <= value < 2**31


def _hashable(value):
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


def _gluon_keys(module, problem: GDNProblem, device: DeviceInfo) -> frozenset:
    """One key per launch of the Gluon forward's plan: kernel, warps, register cap,
    constexprs, descriptor signatures and the value class of each integer argument."""
    forward_plan = module.plan(problem, tuple(device.capability), device)
    keys = set()
    for launch in forward_plan.stages:
        keys.add((
            launch.kernel, launch.num_warps, launch.maxnreg,
            tuple(sorted((name, _hashable(v)) for name, v in launch.constexprs.items())),
            tuple(sorted(d.signature for d in launch.descriptors)),
            tuple(sorted((name, _value_class(v)) for name, v in launch.scalars.items())),
        ))
    return frozenset(keys)


def _triton_generic_keys(module, problem: GDNProblem, device: DeviceInfo) -> frozenset:
    """triton_generic's launch table: every stage's config is fixed by the dims except the
    state recurrence's (it depends on N * HV against the SM count); the flags are constexprs."""
    from gdn_dispatch.backends.triton_generic import configs

    elem = problem.q.element_size()
    capability = tuple(device.capability) if device.capability else None
    state_cfg = configs.state_config(problem.K, problem.V, problem.N * problem.HV, elem, capability,
                                     device.sm_count or 1)
    flags = (problem.initial_state is not None, problem.output_final_state, problem.state_layout.value,
             problem.use_qk_l2norm, problem.uses_state_pool, problem.inplace_final_state)
    return frozenset({("state_fwd", state_cfg, flags), ("fuse_solve_into_wu", configs.fuse_solve_into_wu(capability)),
                      ("wu_fwd", flags[3]), ("output_fwd", flags[3])})


#: Backends with kernels to warm up, and how to read a call's specialization keys.
KEY_FUNCTIONS = {
    "gluon_sm100": _gluon_keys,
    "gluon_sm90": _gluon_keys,
    "triton_generic": _triton_generic_keys,
}


def _backend_module(name: str):
    import importlib

    from gdn_dispatch.registry import load_registry

    spec = next(row for row in load_registry() if row.name == name)
    return importlib.import_module(spec.module)


def specialization_keys(backend: str, problem: GDNProblem, device: DeviceInfo) -> frozenset:
    """The kernel specializations ``problem`` launches on ``device`` with ``backend``
    (computed without a GPU); empty for a backend with nothing to compile."""
    key_fn = KEY_FUNCTIONS.get(backend)
    if key_fn is None:
        return frozenset()
    return key_fn(_backend_module(backend), problem, device)


def call_keys(spec: WarmupSpec, call: WarmupCall, backend: str, device: DeviceInfo) -> frozenset:
    """:func:`specialization_keys` of ``call`` (built from CPU tensors)."""
    problem = make_problem(**make_call(spec, call))
    return specialization_keys(backend, problem, device)


# --- enumeration ----------------------------------------------------------------------

def _seq_counts(spec: WarmupSpec, backend: str, device: DeviceInfo) -> list[int]:
    """1, 2, and every N <= max_num_seqs at which the backend's keys change (all flags on,
    whole chunks): one representative per range of N that launches the same kernels."""
    counts, previous = [], None
    for n in range(1, spec.max_num_seqs + 1):
        keys = call_keys(spec, WarmupCall((CHUNK_SIZE,) * n, None, True, True), backend, device)
        if keys != previous or n <= 2:
            counts.append(n)
        previous = keys
    return counts


def candidate_calls(spec: WarmupSpec, seq_counts: list[int]) -> list[WarmupCall]:
    """Every representative call: each N of ``seq_counts``, varlen and uniform, each last
    length of :data:`LAST_LENGTHS`, each state flag of ``spec``."""
    calls = []
    for n in seq_counts:
        for last in LAST_LENGTHS:
            shapes = [((CHUNK_SIZE,) * (n - 1) + (last,), None), (None, (n, last))]
            for lengths, batch in shapes:
                for h0 in spec.initial_states:
                    for ht in spec.final_states:
                        calls.append(WarmupCall(lengths, batch, h0, ht))
    return calls


@dataclass(frozen=True)
class WarmupPlan:
    """The calls to run (``calls``) and the specialization keys they cover (``keys``)."""

    backend: str
    device: DeviceInfo
    spec: WarmupSpec
    calls: tuple[WarmupCall, ...]
    keys: frozenset


def plan_warmup(spec: WarmupSpec, backend: str, device: DeviceInfo) -> WarmupPlan:
    """The fewest candidate calls (greedy set cover, small calls first) whose
    specialization keys cover those of every candidate; no GPU needed."""
    if backend not in KEY_FUNCTIONS:
        return WarmupPlan(backend, device, spec, (), frozenset())
    candidates = candidate_calls(spec, _seq_counts(spec, backend, device))
    keyed = sorted(((c, call_keys(spec, c, backend, device)) for c in candidates), key=lambda ck: ck[0].tokens)
    wanted = frozenset().union(*(keys for _, keys in keyed))
    chosen, covered = [], set()
    while covered != wanted:
        call, keys = max(keyed, key=lambda ck: len(ck[1] - covered))  # first of the smallest on ties
        chosen.append(call)
        covered |= keys
    return WarmupPlan(backend, device, spec, tuple(chosen), wanted)


# --- running it -------------------------------------------------------------------------

@dataclass(frozen=True)
class WarmupReport:
    backend: str
    device: str
    calls: int
    keys: int
    compiles: int
    seconds: float

    def format(self) -> str:
        return (f"warmup: {self.backend} on {self.device}: {self.calls} calls covering {self.keys} kernel "
                f"specializations, {self.compiles} compiled (or loaded from Triton's cache), {self.seconds:.1f} s")


class _CompileCounter:
    """Counts ``triton.compile`` runs (a compile or a load from Triton's disk cache) through
    ``triton.knobs.compilation.listener``, chaining any listener already set."""

    def __init__(self):
        self.count = 0
        self._previous = None

    def __enter__(self):
        from triton import knobs

        self._previous = knobs.compilation.listener
        knobs.compilation.listener = self
        return self

    def __call__(self, *args, **kwargs):
        self.count += 1
        if self._previous is not None:
            self._previous(*args, **kwargs)

    def __exit__(self, *exc):
        from triton import knobs

        knobs.compilation.listener = self._previous


def _progress(done: int, total: int, label: str, started: float, stream) -> None:
    width = 30
    filled = width * done // max(total, 1)
    stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {time.perf_counter() - started:6.1f} s  "
                 f"{label[:40]:<40}")
    if done == total:
        stream.write("\n")
    stream.flush()


def warmup(
    *,
    num_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    state_layout: str = "kv",
    device: torch.device | str | None = None,
    use_qk_l2norm: bool = True,
    backend: str | None = None,
    max_num_seqs: int = 64,
    g_dtype: torch.dtype = torch.float32,
    beta_dtype: torch.dtype | None = None,
    state_dtype: torch.dtype = torch.float32,
    example: dict | None = None,
    progress: bool = True,
) -> WarmupReport:
    """Compile every kernel specialization that calls with these dims can hit on ``device``.

    Parameters
    ----------
    num_heads, num_v_heads, head_k_dim, head_v_dim : ``H``, ``HV``, ``K``, ``V``.
    dtype : dtype of q, k, v. ``g_dtype``, ``beta_dtype`` (None: ``dtype``) and
        ``state_dtype``: the gate's, beta's and initial state's, as the model passes them.
    state_layout : "kv" or "vk". ``use_qk_l2norm``: the model's ``use_qk_l2norm_in_kernel``.
    device : the CUDA device (default: the current one); on a CPU device there is nothing
        to compile.
    backend : force a backend (default: the registry's choice for these calls).
    max_num_seqs : the most sequences one call will carry.
    example : optional keyword arguments of one real call (e.g. views of a fused projection):
        run once after the plan, for the specializations of its strides.
    progress : a progress bar on stderr.

    Returns
    -------
    WarmupReport : backend, device, calls run, specializations covered, compiles, seconds.
    """
    started = time.perf_counter()
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    spec = WarmupSpec(num_heads, num_v_heads, head_k_dim, head_v_dim, dtype, StateLayout.parse(state_layout).value,
                      use_qk_l2norm, g_dtype, beta_dtype, state_dtype, max_num_seqs)
    info = default_probe().for_torch_device(device)
    probe_call = WarmupCall((CHUNK_SIZE, 1), None, True, True)
    chosen = select(info, make_problem(**make_call(spec, probe_call, device), backend=backend)).spec.name
    if device.type != "cuda":
        return WarmupReport(chosen, str(device), 0, 0, 0, time.perf_counter() - started)
    plan = plan_warmup(spec, chosen, info)
    from gdn_dispatch.api import chunk_gated_delta_rule

    runs = [(call.label(), make_call(spec, call, device, random=True)) for call in plan.calls]
    if example is not None:
        runs.append(("example call", {**example, "backend": chosen}))
    stream = sys.stderr if progress else None
    with _CompileCounter() as counter:
        for i, (label, kwargs) in enumerate(runs):
            if stream:
                _progress(i, len(runs), label, started, stream)
            chunk_gated_delta_rule(**{"backend": chosen, **kwargs})
        torch.cuda.synchronize(device)
    if stream:
        _progress(len(runs), len(runs), "done", started, stream)
    return WarmupReport(chosen, str(device), len(runs), len(plan.keys), counter.count, time.perf_counter() - started)


# --- command line -----------------------------------------------------------------------

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def add_arguments(parser) -> None:
    from gdn_dispatch.registry import backend_names
    from gdn_dispatch.usage import backend_arg, device_arg

    parser.add_argument("--heads", type=int, required=True, help="H, q/k heads (per device)")
    parser.add_argument("--v-heads", type=int, required=True, help="HV, value heads (per device)")
    parser.add_argument("--head-k-dim", type=int, default=128, help="K (default 128)")
    parser.add_argument("--head-v-dim", type=int, default=128, help="V (default 128)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="q/k/v dtype (default bf16)")
    parser.add_argument("--g-dtype", choices=sorted(_DTYPES), default="fp32", help="gate dtype (default fp32)")
    parser.add_argument("--beta-dtype", choices=sorted(_DTYPES), default=None, help="beta dtype (default: --dtype)")
    parser.add_argument("--state-layout", choices=["kv", "vk"], default="kv")
    parser.add_argument("--no-qk-l2norm", action="store_true", help="calls pass use_qk_l2norm_in_kernel=False")
    parser.add_argument("--max-seqs", type=int, default=64, help="most sequences per call (default 64)")
    parser.add_argument("--device", type=device_arg, default=None,
                        help="cuda or cuda:N (default: the current CUDA device; cpu has nothing to compile)")
    parser.add_argument("--backend", type=backend_arg(backend_names), default=None,
                        help="force a backend (default: the registry's choice)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    report = warmup(
        num_heads=args.heads, num_v_heads=args.v_heads, head_k_dim=args.head_k_dim, head_v_dim=args.head_v_dim,
        dtype=_DTYPES[args.dtype], g_dtype=_DTYPES[args.g_dtype],
        beta_dtype=_DTYPES[args.beta_dtype] if args.beta_dtype else None, state_layout=args.state_layout,
        use_qk_l2norm=not args.no_qk_l2norm, max_num_seqs=args.max_seqs, device=args.device, backend=args.backend,
        progress=not args.quiet,
    )
    print(report.format())
    return 0


__all__ = ["WarmupCall", "WarmupPlan", "WarmupReport", "WarmupSpec", "call_keys", "candidate_calls", "make_call",
           "plan_warmup", "specialization_keys", "warmup"]
