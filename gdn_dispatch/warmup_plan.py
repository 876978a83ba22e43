"""The warm-up plan: which calls compile every kernel specialization a stream of ragged calls
with given head dims can hit on a device. Pure host work: no GPU needed.

A Triton kernel is compiled once per *specialization*: its constexpr arguments (flags such
as initial/final state, varlen tails, pools, tile sizes a planner picked, token strides
where a kernel takes them as constexprs), the dtype and 16-byte alignment of each pointer
argument, and the value class of each integer argument (``== 1``, divisible by 16) unless
the kernel marks it ``do_not_specialize`` (the per-call counts are: sequences, segments,
segment length, pool rows). For fixed dims and dtypes, what varies from call to call is

* the batch: the number of sequences ``N`` (tile and pipeline choices depend on how many
  programs fill the SMs), whether some sequence ends inside a chunk (tails), the token
  count ``T``, uniform batch or ``cu_seqlens`` (int32 or int64, with or without its
  host copy), and whether context parallelism cuts a long sequence into segments (then
  how many segments the pass over them has: its tile choice depends on them as on ``N``);
* the state: none, an initial state, or a state pool (its dtype, written back in place or
  not), and whether a final state is asked;
* the input layout: contiguous tensors, or views of one fused q|k|v projection (a token
  stride wider than each tensor's row).

:func:`candidate_calls` builds one representative call per combination (a representative
``N`` for every range of ``N`` in which the launches stay the same, up to
``max_num_seqs``). The backend of each is the registry's choice for it (a pool call may go
to another backend than a plain one). :func:`specialization_keys` reads a call's
specializations from the backend's own launch planner (the Gluon backends' ``plan``;
triton_generic's launch configs and constexpr flags) plus what Triton's binder specializes
on beyond any planner (argument dtypes, alignment, integer classes); :func:`plan_warmup`
keeps the fewest candidates that cover every key.
"""

from __future__ import annotations

import functools
import importlib
import random
from dataclasses import dataclass

import torch

from gdn_dispatch import context_parallel
from gdn_dispatch.context_parallel import COUNTED_BV, CPPlan, CPTuning, plan_context_parallel, plan_for_problem
from gdn_dispatch.contract import (
    CHUNK_SIZE, MAX_HEAD_DIM, GDNInputError, GDNProblem, StateLayout, make_problem, token_rows_stride,
)
from gdn_dispatch.device import DeviceInfo
from gdn_dispatch.registry import CallSpec, GDNDispatchError, explain, load_registry, select

#: Length of the last sequence of a candidate (the others are whole chunks): no tail (64),
#: and tails giving T = 0, 1, 8 (mod 16), and T == 1 for a single sequence.
LAST_LENGTHS = (64, 1, 8, 16, 17, 40)
#: The length of a long prompt in :func:`random_ragged_stream`: 33 chunks, the last one
#: partial, long enough for the context-parallel planner to cut segments where sequences
#: and heads leave SMs idle. The plan's segmented candidates force their segment counts
#: instead (:func:`segmented_lengths`).
LONG_LENGTH = 32 * CHUNK_SIZE + 17
#: Input layouts a spec may name: "contiguous" tensors, or "fused_qkv": q, k, v views of one
#: ``[B, T, 2 H K + HV V]`` projection in that order (g and beta contiguous), as servers
#: split their projection (or convolution) output.
INPUT_LAYOUTS = ("contiguous", "fused_qkv")
#: Dtypes a spec's ``cu_seqlens`` may have (the contract's): every kernel takes the offsets
#: as a pointer, and Triton compiles one variant per pointer dtype.
OFFSET_DTYPES = (torch.int32, torch.int64)
#: Pool row counts warmed when the spec names none. No kernel specializes on the row count
#: (``do_not_specialize``), so one stands for every size.
DEFAULT_POOL_SIZES = (17,)


@dataclass(frozen=True)
class WarmupSpec:
    """The fixed part of every call a model layer makes, and the variants a server uses.

    Attributes
    ----------
    H, HV, K, V : q/k heads, v heads, q/k and v head dims.
    dtype : dtype of q, k, v. ``g_dtype`` and ``beta_dtype`` (None: q's dtype): the gate's
        and beta's. ``state_dtype``: the initial state's (not a pool).
    state_layout : "kv" or "vk". ``use_qk_l2norm``: the calls' ``use_qk_l2norm_in_kernel``.
    max_num_seqs : the most sequences in one call.
    initial_states, final_states : the values of "an initial state is given" and
        ``output_final_state`` the calls use.
    pool_dtypes : dtypes of the state pools calls pass with ``state_indices`` (empty: no
        pool calls). ``pool_inplace``: their ``inplace_final_state`` values.
        ``pool_size``: the pool's row count P (None: :data:`DEFAULT_POOL_SIZES`).
        ``index_dtype``: dtype of ``state_indices``.
    input_layouts : names from :data:`INPUT_LAYOUTS`.
    host_offsets : with ``cu_seqlens``, whether ``cu_seqlens_cpu`` is passed too (True,
        False or both).
    offset_dtypes : dtypes of ``cu_seqlens`` (and of its host copy), from
        :data:`OFFSET_DTYPES`.

    Raises GDNInputError naming the field for dims outside the contract's ranges (``HV``
    a multiple of ``H``) and for a variant list that leaves no call to warm.
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
    pool_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    pool_inplace: tuple[bool, ...] = (True,)
    pool_size: int | None = None
    index_dtype: torch.dtype = torch.int32
    input_layouts: tuple[str, ...] = INPUT_LAYOUTS
    host_offsets: tuple[bool, ...] = (True, False)
    offset_dtypes: tuple[torch.dtype, ...] = OFFSET_DTYPES

    def __post_init__(self):
        # Checked here, not left to the calls made from the spec: a bad dim would fail deep
        # in the plan, and an empty variant list plans no calls (a warm-up that reports
        # success having compiled nothing).
        for name, value, high in (("H (num_heads)", self.H, None), ("HV (num_v_heads)", self.HV, None),
                                  ("K (head_k_dim)", self.K, MAX_HEAD_DIM), ("V (head_v_dim)", self.V, MAX_HEAD_DIM),
                                  ("max_num_seqs", self.max_num_seqs, None)):
            if not _is_int(value) or value < 1 or (high is not None and value > high):
                expected = "an int >= 1" if high is None else f"an int in [1, {high}]"
                raise GDNInputError(f"{name}: expected {expected}, got {value!r}")
        if self.HV % self.H:
            raise GDNInputError(f"HV (num_v_heads): expected a multiple of H (num_heads) = {self.H}, got {self.HV}")
        unknown = sorted(set(self.input_layouts) - set(INPUT_LAYOUTS))
        if unknown or not self.input_layouts:
            raise GDNInputError(f"input_layouts: expected names from {INPUT_LAYOUTS}, got {unknown or '()'}")
        if not self.offset_dtypes or not set(self.offset_dtypes) <= set(OFFSET_DTYPES):
            raise GDNInputError(f"offset_dtypes: expected dtypes from {OFFSET_DTYPES}, "
                                f"got {tuple(self.offset_dtypes)!r}")
        # Pools are a state source of their own: without them, calls need initial_states.
        needed = {"host_offsets": (True, ""), "final_states": (True, ""),
                  "initial_states": (not self.pool_dtypes, " where pool_dtypes is empty"),
                  "pool_inplace": (bool(self.pool_dtypes), " where pool_dtypes names pools")}
        for name, (required, where) in needed.items():
            values = getattr(self, name)
            if not set(values) <= {True, False} or (required and not values):
                raise GDNInputError(f"{name}: expected True, False or both{where}, got {tuple(values)!r}")
        if self.pool_size is not None and (not _is_int(self.pool_size) or self.pool_size < 1):
            raise GDNInputError(f"pool_size: expected a row count >= 1, got {self.pool_size}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class WarmupCall:
    """One representative call.

    ``lengths`` (varlen, B = 1) or ``batch`` = (B, T) (uniform); ``initial_state``: a state
    is given, which is a pool of ``pool_size`` rows of ``pool_dtype`` when that is set
    (row ``n`` for sequence ``n < pool_size``, -1 for the rest), written back when
    ``inplace``; ``host_offsets``: varlen with ``cu_seqlens_cpu``; ``offset_dtype``: the
    dtype of ``cu_seqlens`` (and its host copy); ``layout``: one of
    :data:`INPUT_LAYOUTS`; ``context_parallel``: the call's argument ("auto", or a forced
    segment count).
    """

    lengths: tuple[int, ...] | None
    batch: tuple[int, int] | None
    initial_state: bool
    output_final_state: bool
    pool_dtype: torch.dtype | None = None
    pool_size: int = 0
    inplace: bool = False
    host_offsets: bool = True
    offset_dtype: torch.dtype = torch.int32
    layout: str = "contiguous"
    context_parallel: str | int = "auto"

    @property
    def N(self) -> int:
        return len(self.lengths) if self.lengths is not None else self.batch[0]

    @property
    def tokens(self) -> int:
        return sum(self.lengths) if self.lengths is not None else self.batch[0] * self.batch[1]

    def label(self) -> str:
        if self.lengths is not None:
            offsets = "" if self.offset_dtype == torch.int32 else f" {str(self.offset_dtype).removeprefix('torch.')}"
            shape = f"varlen N={self.N} T={self.tokens}{offsets}{'' if self.host_offsets else ' (no host offsets)'}"
        else:
            shape = f"B={self.batch[0]} T={self.batch[1]}"
        state = " h0" if self.initial_state else ""
        if self.pool_dtype is not None:
            dtype = str(self.pool_dtype).removeprefix("torch.")
            state = f" pool {dtype}[{self.pool_size}]{' inplace' if self.inplace else ''}"
        layout = "" if self.layout == "contiguous" else f" {self.layout}"
        cp = "" if self.context_parallel == "auto" else f" cp={self.context_parallel}"
        return f"{shape}{state}{' ht' if self.output_final_state else ''}{layout}{cp}"


def make_call(spec: WarmupSpec, call: WarmupCall, device: torch.device | str = "cpu", *,
              random: bool = False, seed: int = 0) -> dict:
    """Keyword arguments of ``chunk_gated_delta_rule`` for ``call`` (uninitialized tensors
    unless ``random``: specializations depend on shapes, dtypes and strides only)."""
    gen = torch.Generator().manual_seed(seed)
    B, T = (1, sum(call.lengths)) if call.lengths is not None else call.batch

    def tensor(*shape, dtype, kind="randn"):
        if not random:
            return torch.empty(shape, dtype=dtype, device=device)
        if kind == "gate":
            x = torch.nn.functional.logsigmoid(torch.randn(shape, generator=gen))
        else:
            x = torch.randn(shape, generator=gen) if kind == "randn" else torch.rand(shape, generator=gen)
        return x.to(device=device, dtype=dtype)

    HK, HVV = spec.H * spec.K, spec.HV * spec.V
    if call.layout == "fused_qkv":
        fused = tensor(B, T, 2 * HK + HVV, dtype=spec.dtype)
        q, k, v = torch.split(fused, [HK, HK, HVV], dim=-1)
        q, k, v = q.view(B, T, spec.H, spec.K), k.view(B, T, spec.H, spec.K), v.view(B, T, spec.HV, spec.V)
    else:
        q, k = tensor(B, T, spec.H, spec.K, dtype=spec.dtype), tensor(B, T, spec.H, spec.K, dtype=spec.dtype)
        v = tensor(B, T, spec.HV, spec.V, dtype=spec.dtype)
    kwargs = dict(
        q=q, k=k, v=v, g=tensor(B, T, spec.HV, dtype=spec.g_dtype, kind="gate"),
        beta=tensor(B, T, spec.HV, dtype=spec.beta_dtype or spec.dtype, kind="rand"),
        state_layout=spec.state_layout, use_qk_l2norm_in_kernel=spec.use_qk_l2norm,
        output_final_state=call.output_final_state, context_parallel=call.context_parallel,
    )
    per_head = (spec.K, spec.V) if spec.state_layout == StateLayout.KV.value else (spec.V, spec.K)
    if call.pool_dtype is not None:
        rows = torch.arange(call.N)
        kwargs["initial_state"] = tensor(call.pool_size, spec.HV, *per_head, dtype=call.pool_dtype)
        kwargs["state_indices"] = torch.where(rows < call.pool_size, rows, -1).to(device=device, dtype=spec.index_dtype)
        kwargs["inplace_final_state"] = call.inplace
    elif call.initial_state:
        kwargs["initial_state"] = tensor(call.N, spec.HV, *per_head, dtype=spec.state_dtype)
    if call.lengths is not None:
        offsets = torch.tensor([0, *torch.tensor(call.lengths).cumsum(0).tolist()], dtype=call.offset_dtype)
        kwargs["cu_seqlens"] = offsets.to(device)
        if call.host_offsets:
            kwargs["cu_seqlens_cpu"] = offsets
    return kwargs


# --- specialization keys ----------------------------------------------------------------

def triton_arg_class(value, specialize: bool = True):
    """What Triton's binder specializes one kernel argument on: a tensor's pointer dtype
    and 16-byte alignment, an integer's type and (with ``specialize``, i.e. not
    ``do_not_specialize``) divisibility by 16 (1 is a constant)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    if value is None or isinstance(value, float):
        return type(value).__name__
    return native_specialize_impl(BaseBackend, value, False, specialize, True)


def _hashable(value):
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


def call_facts(problem: GDNProblem) -> tuple:
    """What the binder specializes on that no launch planner states: the class
    (:func:`triton_arg_class`) of every tensor the call hands the kernels, the sequence
    offsets as the kernels get them (the caller's ``cu_seqlens``, or the int32 table of a
    uniform batch; without a pool they fill the ``state_indices`` slot too). (The pool's
    row count is a ``do_not_specialize`` argument of every kernel that takes one.)"""
    names = ("q", "k", "v", "g", "beta", "initial_state", "state_indices")
    facts = tuple((name, triton_arg_class(getattr(problem, name))) for name in names)
    return (*facts, ("cu_seqlens", triton_arg_class(problem.chunks.cu_seqlens)))


def _launch_key(launch) -> tuple:
    return (
        launch.kernel, launch.num_warps, launch.maxnreg,
        tuple(sorted((name, _hashable(v)) for name, v in launch.constexprs.items())),
        tuple(sorted(d.signature for d in launch.descriptors)),
        tuple(sorted((name, triton_arg_class(v)) for name, v in launch.scalars.items())),
    )


def _state_flags(problem: GDNProblem) -> tuple:
    return (problem.initial_state is not None, problem.output_final_state, problem.state_layout.value,
            problem.uses_state_pool, problem.inplace_final_state)


def _segment_kernel_keys(problem: GDNProblem, device: DeviceInfo, k_stride, *, k_rnorm: bool | None,
                         beta_stride=None) -> set:
    """The plain-Triton kernels of a segmented call (the forgetting starts and pass-1 maps
    with the segment table, scan): pass 1's config is fixed by the dims and the device, the
    scan's V-block by its (sequence, v-head) pairs against the SM count; the call's state
    flags go to the scan; pass 1 takes the k row norms of an earlier stage (``k_rnorm``) or
    reduces k's rows itself, and the forgetting starts read beta (token stride
    ``beta_stride``); None: the caller runs a pass 1 of its own (the scan's key alone)."""
    from gdn_dispatch.backends.triton_generic.segment_map import maps_dtype
    from gdn_dispatch.backends.triton_generic.segment_scan import segment_scan_config

    capability = tuple(device.capability) if device.capability else None
    bf16_maps = maps_dtype(problem.q.dtype) == torch.bfloat16
    scan = segment_scan_config(problem.K, problem.V, capability, problem.N * problem.HV, device.sm_count, bf16_maps)
    keys = {("segment_scan_fwd", _state_flags(problem), scan)}
    if k_rnorm is not None:
        keys.add(("segment_map_fwd", k_stride, beta_stride, problem.use_qk_l2norm, k_rnorm, bf16_maps))
    return keys


def _gluon_keys(module, problem: GDNProblem, device: DeviceInfo, cp: CPPlan | None) -> frozenset:
    """One key per launch of the Gluon forward's dry run (:func:`~gdn_dispatch.backends.
    gluon_common.forward.plan_call`): kernel, warps, register cap, constexprs, descriptor
    signatures and the class of each integer argument. A segmented call launches its
    front stages, pass 1, the scan and pass 2: the fused kernel over the segments (float32
    "kv" start states, no pool, no final state), configured by the segment slot count.
    (``cp`` is not read: the dry run makes the same context-parallel decision itself.)"""
    from gdn_dispatch.backends.gluon_common.forward import plan_call

    call = plan_call(problem, device, engine=module.ENGINE)
    if call.pipeline is not None:
        # Picked on the device: every launch of both plans runs (each leaves at once where
        # the census names the other), so both compile.
        return frozenset(_launch_key(launch) for launch in (*call.launches.stages, *call.pipeline.stages))
    if call.context_parallel.chained and not call.launches.fused:
        # Chained segments on the pipeline: the front stages, pass 1 with N's blocks alone
        # and the fused kernel over the segment slots with the call's flags (no scan). On
        # the one-kernel build (the warm chain) the call's own launches are its keys.
        keys = {_launch_key(launch) for launch in call.launches.stages if launch.kernel != "state_output_fwd"}
        return frozenset(keys | {_launch_key(call.segment_map), _launch_key(call.state_output)})
    if call.segments is None:
        return frozenset(_launch_key(launch) for launch in call.launches.stages)
    keys = {_launch_key(launch) for launch in call.launches.stages if launch.kernel != "state_output_fwd"}
    keys.add(_launch_key(call.segments.stage("state_output_fwd")))
    keys.add(_launch_key(call.segment_map))
    return frozenset(keys | _segment_kernel_keys(problem, device, token_rows_stride(problem.k), k_rnorm=None))


def _triton_generic_keys(module, problem: GDNProblem, device: DeviceInfo, cp: CPPlan | None) -> frozenset:
    """triton_generic's launches: every stage's config is fixed by the dims and the device
    except the state recurrence's (its programs against the SM count: ``N * HV``, or
    ``NSEG * HV`` when it runs over segments); the state and norm flags and the inputs'
    token strides are constexprs. Sequence, segment and pool-row counts and the segment
    length are runtime integers no kernel specializes on.

    With context parallelism (``cp.enabled``) the call's state flags go to the scan, and
    the state kernel runs over the segments from float32 start states ("kv", no final
    state, no pool), next to the segment maps (which write the segment table); chained
    segments (``cp.chained``) run no scan, and their state kernel takes the call's flags.
    """
    from gdn_dispatch.backends.triton_generic import configs
    from gdn_dispatch.backends.triton_generic.call_program import UNPICKED

    cp = None if cp is None else cp.unpicked(UNPICKED)
    elem = problem.q.element_size()
    capability = tuple(device.capability) if device.capability else None
    l2 = problem.use_qk_l2norm
    flags = _state_flags(problem)
    strides = {name: token_rows_stride(getattr(problem, name)) for name in ("q", "k", "v", "g", "beta")}
    fused = configs.fuse_solve_into_wu(capability)

    def state_key(sequences: int, state_flags: tuple) -> tuple:
        cfg = configs.state_config(problem.K, problem.V, sequences * problem.HV, elem, capability, device.sm_count)
        return ("state_fwd", cfg, state_flags, l2, strides["k"])

    keys = {
        ("kkt_solve_fwd", None if fused else (strides["k"], strides["g"], strides["beta"], l2)),
        ("wu_fwd", fused, strides["k"], strides["v"], strides["g"] if fused else None, strides["beta"], l2),
        ("output_fwd", strides["q"], strides["k"], l2),
    }
    if cp is None or not cp.enabled:
        return frozenset(keys | {state_key(problem.N, flags)})
    if cp.chained:
        # The forgetting starts zero the hand-over counts, pass 1 maps N alone, and the
        # chained state kernel takes the call's state flags (configured as the unsegmented one).
        return frozenset(keys | {
            ("forgetting_start", "chained", strides["k"], strides["beta"], l2),
            ("segment_map_fwd", "chained", strides["k"], l2),
            ("chained_state_fwd", *state_key(problem.N, flags)[1:]),
        })
    return frozenset(keys | _segment_kernel_keys(problem, device, strides["k"], k_rnorm=l2,
                                                 beta_stride=strides["beta"]) | {
        state_key(cp.num_segments, (True, False, StateLayout.KV.value, False, False)),
    })


#: Backends with kernels to warm up, and how to read a call's specialization keys.
KEY_FUNCTIONS = {
    "gluon_sm100": _gluon_keys,
    "gluon_sm90": _gluon_keys,
    "triton_generic": _triton_generic_keys,
}


def _row(name: str):
    return next(row for row in load_registry() if row.name == name)


def specialization_keys(backend: str, problem: GDNProblem, device: DeviceInfo) -> frozenset:
    """The kernel specializations ``problem`` launches on ``device`` with ``backend``
    (computed without a GPU); empty for a backend with nothing to compile.

    Each key of the backend's planner carries the call's :func:`call_facts`; where the
    backend runs context parallelism, its key function is handed the call's plan.
    """
    key_fn = KEY_FUNCTIONS.get(backend)
    if key_fn is None:
        return frozenset()
    row = _row(backend)
    cp = plan_for_problem(problem, device.sm_count) if "context_parallel" in row.features else None
    shared = (backend, call_facts(problem))
    return frozenset((shared, key) for key in key_fn(importlib.import_module(row.module), problem, device, cp))


def choose_backend(problem: GDNProblem, device: DeviceInfo, backend: str | None = None) -> str | None:
    """The backend that runs ``problem`` on ``device`` (None: no backend admits it).

    On the device itself the registry's full choice (:func:`gdn_dispatch.registry.select`,
    which also asks the backend about this call's tensors); for a device planned from CPU
    tensors, the choice from the device and the call's features alone.
    """
    if problem.device.type == device.kind == "cuda":
        try:
            return select(device, problem).spec.name
        except GDNDispatchError:
            return None
    return explain(device, CallSpec.from_problem(problem), backend=backend).selected


def call_keys(spec: WarmupSpec, call: WarmupCall, device: DeviceInfo, backend: str | None = None, *,
              tensor_device: torch.device | str = "cpu") -> tuple[str | None, frozenset]:
    """(backend chosen for ``call``, its :func:`specialization_keys`), from uninitialized
    tensors on ``tensor_device``; ``backend`` forces one."""
    problem = make_problem(**make_call(spec, call, tensor_device), backend=backend)
    chosen = choose_backend(problem, device, backend)
    return chosen, (specialization_keys(chosen, problem, device) if chosen is not None else frozenset())


# --- enumeration ----------------------------------------------------------------------

def state_variants(spec: WarmupSpec) -> list[dict]:
    """Keyword arguments of :class:`WarmupCall` for each state source of ``spec``: none or
    an initial state (``spec.initial_states``), and each pool dtype x row count x in-place."""
    variants = [dict(initial_state=h0) for h0 in spec.initial_states]
    sizes = (spec.pool_size,) if spec.pool_size is not None else DEFAULT_POOL_SIZES
    variants += [dict(initial_state=True, pool_dtype=dtype, pool_size=size, inplace=inplace)
                 for dtype in spec.pool_dtypes for size in sizes for inplace in spec.pool_inplace]
    return variants


def segmented_call(n: int, num_segments: int, tail: bool = True, **flags) -> WarmupCall:
    """A call of ``n`` sequences that runs over ``num_segments`` (> n) segment slots: the
    last sequence long, the others empty, cut by a forced segment count into one-chunk
    segments. With ``tail`` its length leaves a partial last chunk, as most prompts do;
    without, it is whole chunks (the segments then have no tails, and the slot past its
    end holds no tokens, which pass 2's configuration counts)."""
    long = CHUNK_SIZE * (num_segments - n) + (17 if tail else 0)
    return WarmupCall((0,) * (n - 1) + (long,), None, context_parallel=-(-long // CHUNK_SIZE), **flags)


def picked_calls(spec: WarmupSpec, n: int, device: DeviceInfo, **flags) -> list[WarmupCall]:
    """Calls of ``n`` sequences that "auto" runs picked on the device (``CPPlan.picked``:
    every launch of the warm chain and of the pipeline runs, so all compile), the last
    sequence long enough for two chained segments, with a tail and without; none where
    "auto" does not pick for ``n`` sequences."""
    calls = []
    for tail in (True, False):
        for chunks in (16, 32, 64, 128, 256, 512):
            long = CHUNK_SIZE * chunks + (17 if tail else 0)
            total = long + CHUNK_SIZE * (n - 1)
            if plan_context_parallel("auto", T_total=total, N=n, HV=spec.HV, V=spec.V, sm_count=device.sm_count,
                                     max_len=long).picked:
                calls.append(WarmupCall((CHUNK_SIZE,) * (n - 1) + (long,), None, **flags))
                break
    return calls


@functools.lru_cache(maxsize=256)
def segment_counts(spec: WarmupSpec, n: int, device: DeviceInfo, backend: str | None = None,
                   tensor_device: str = "cpu", tuning: CPTuning | None = None) -> tuple[int, ...]:
    """Segment-slot counts ``NSEG`` whose segmented calls of ``n`` sequences tell every
    launch a segmented call can make apart: () where the planner ("auto") never segments
    ``n`` sequences (they fill the SMs), else the smallest ``NSEG`` of each key set among
    ``NSEG = n + 1 ...`` (what "auto" can give), up to twice the SMs in the state kernel's
    programs (``NSEG * HV * ceil(V / 64)``): planners size their tiles by whether the
    programs fill the SMs, and beyond that nothing changes. ``tuning``: the planner's
    constants (None: ``context_parallel.TUNING``; callers pass it, so that the memo keeps
    a tuning's counts apart)."""
    longest = 1 << 30
    auto = plan_context_parallel("auto", T_total=longest, N=n, HV=spec.HV, V=spec.V, sm_count=device.sm_count,
                                 max_len=longest, tuning=tuning)
    if not auto.enabled or auto.picked:
        return ()  # picked calls: :func:`picked_calls`
    flags = dict(output_final_state=True, **state_variants(spec)[0])
    counts, seen, nseg = [], set(), n + 1
    while True:
        keys = frozenset().union(*(call_keys(spec, segmented_call(n, nseg, tail, **flags), device, backend,
                                             tensor_device=tensor_device)[1] for tail in (True, False)))
        if keys not in seen:
            counts.append(nseg)
            seen.add(keys)
        if nseg * spec.HV * -(-spec.V // COUNTED_BV) >= 2 * device.sm_count:
            return tuple(counts)
        nseg += 1


def _seq_counts(spec: WarmupSpec, device: DeviceInfo, backend: str | None, tensor_device) -> list[int]:
    """1, 2, and every N <= max_num_seqs at which some backend's keys change (whole chunks,
    every state source, a final state; segmented where that can be): one representative
    per range of N that launches the same kernels."""
    counts, previous = [], None
    for n in range(1, spec.max_num_seqs + 1):
        calls = [WarmupCall((CHUNK_SIZE,) * n, None, output_final_state=True, **state) for state in state_variants(spec)]
        nsegs = segment_counts(spec, n, device, backend, str(tensor_device), context_parallel.TUNING)
        calls += [segmented_call(n, nseg, tail, output_final_state=True, **state_variants(spec)[0])
                  for nseg in nsegs for tail in (True, False)]
        calls += picked_calls(spec, n, device, output_final_state=True, **state_variants(spec)[0])
        keys = frozenset().union(*(call_keys(spec, call, device, backend, tensor_device=tensor_device)[1]
                                   for call in calls))
        if keys != previous or n <= 2:
            counts.append(n)
        previous = keys
    return counts


def candidate_calls(spec: WarmupSpec, seq_counts: list[int], device: DeviceInfo, backend: str | None = None,
                    tensor_device: torch.device | str = "cpu") -> list[WarmupCall]:
    """Every representative call: each N of ``seq_counts``; varlen (with and without host
    offsets, as ``spec.host_offsets`` says, in each of ``spec.offset_dtypes``) and uniform;
    each last length of :data:`LAST_LENGTHS`; each state source, final-state flag and input
    layout of ``spec``; and, where context parallelism can cut N sequences, the segmented calls of
    :func:`segment_counts` with each of those, their long sequence with and without a tail."""
    calls = []
    variants = [dict(**state, output_final_state=ht, layout=layout) for state in state_variants(spec)
                for ht in spec.final_states for layout in spec.input_layouts]
    for n in seq_counts:
        for last in LAST_LENGTHS:
            shapes = [dict(lengths=(CHUNK_SIZE,) * (n - 1) + (last,), batch=None, host_offsets=host, offset_dtype=dtype)
                      for host in spec.host_offsets for dtype in spec.offset_dtypes]
            shapes.append(dict(lengths=None, batch=(n, last)))
            calls += [WarmupCall(**shape, **flags) for shape in shapes for flags in variants]
        for nseg in segment_counts(spec, n, device, backend, str(tensor_device), context_parallel.TUNING):
            calls += [segmented_call(n, nseg, tail, host_offsets=spec.host_offsets[0], offset_dtype=dtype, **flags)
                      for tail in (True, False) for dtype in spec.offset_dtypes for flags in variants]
        calls += [call for dtype in spec.offset_dtypes for flags in variants
                  for call in picked_calls(spec, n, device, host_offsets=spec.host_offsets[0], offset_dtype=dtype,
                                           **flags)]
    return calls


@dataclass(frozen=True)
class WarmupPlan:
    """The calls to run, each with the backend the registry chooses for it (``calls``), the
    specialization keys they cover (``keys``), and the candidates no backend admits
    (``unadmitted``: such a call raises; nothing to compile for it)."""

    device: DeviceInfo
    spec: WarmupSpec
    calls: tuple[tuple[WarmupCall, str], ...]
    keys: frozenset
    unadmitted: tuple[WarmupCall, ...] = ()

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(sorted({backend for _, backend in self.calls}))


def plan_warmup(spec: WarmupSpec, device: DeviceInfo, backend: str | None = None, *,
                tensor_device: torch.device | str = "cpu") -> WarmupPlan:
    """The fewest candidate calls (greedy set cover, small calls first) whose
    specialization keys cover those of every candidate.

    ``backend`` forces one backend for every call (default: the registry's choice per
    call). ``tensor_device``: where the (uninitialized) candidate tensors are made; on
    ``device`` itself the registry also checks each call's tensors (see
    :func:`choose_backend`).
    """
    counts = _seq_counts(spec, device, backend, tensor_device)
    candidates = candidate_calls(spec, counts, device, backend, tensor_device)
    keyed, unadmitted = [], []
    for call in sorted(candidates, key=lambda c: c.tokens):
        chosen, keys = call_keys(spec, call, device, backend, tensor_device=tensor_device)
        if chosen is None:
            unadmitted.append(call)
        else:
            keyed.append((call, chosen, keys))
    wanted = frozenset().union(*(keys for _, _, keys in keyed))
    chosen_calls, covered = [], set()
    while covered != wanted:
        call, name, keys = max(keyed, key=lambda ck: len(ck[2] - covered))  # first of the smallest on ties
        chosen_calls.append((call, name))
        covered |= keys
    return WarmupPlan(device, spec, tuple(chosen_calls), wanted, tuple(unadmitted))


# --- a stream to check against -----------------------------------------------------------

#: Pool row counts :func:`random_ragged_stream` draws when the spec names none: both of
#: Triton's integer classes (16 and 48 divisible by 16).
STREAM_POOL_SIZES = (16, 17, 40, 48)


def random_ragged_stream(count: int, seed: int, spec: WarmupSpec, max_len: int = 200,
                         long_len: tuple[int, int] = (LONG_LENGTH, 2 * LONG_LENGTH),
                         long_share: float = 0.1) -> list[WarmupCall]:
    """Ragged batches as a server forms them, to check a warm-up against: 1..max_num_seqs
    sequences of 0..max_len tokens (some whole chunks, some empty; in a ``long_share`` of
    the ragged batches one long prompt of ``long_len[0]..long_len[1]`` tokens), a few
    uniform batches; any state source of ``spec`` (pools of a random size, -1 rows past it),
    final-state flag, input layout and varlen form (host copy or not, offsets' dtype)."""
    rng = random.Random(seed)
    calls = []
    for _ in range(count):
        n = rng.randint(1, spec.max_num_seqs)
        state = dict(rng.choice(state_variants(spec)))
        if state.get("pool_dtype") is not None and spec.pool_size is None:
            state["pool_size"] = rng.choice(STREAM_POOL_SIZES)
        flags = dict(output_final_state=rng.choice(spec.final_states), layout=rng.choice(spec.input_layouts), **state)
        if rng.random() < 0.2:
            calls.append(WarmupCall(None, (n, rng.choice([64, 128, rng.randint(1, max_len)])), **flags))
            continue
        lengths = [rng.choice([0, 64, 128, rng.randint(1, max_len)]) for _ in range(n)]
        lengths[0] = max(lengths[0], 1)
        if rng.random() < long_share:
            lengths[rng.randrange(n)] = rng.randint(*long_len)
        calls.append(WarmupCall(tuple(lengths), None, host_offsets=rng.choice(spec.host_offsets),
                                offset_dtype=rng.choice(spec.offset_dtypes), **flags))
    return calls


__all__ = ["DEFAULT_POOL_SIZES", "INPUT_LAYOUTS", "LAST_LENGTHS", "LONG_LENGTH", "OFFSET_DTYPES", "WarmupCall", "WarmupPlan",
           "WarmupSpec", "call_facts", "call_keys", "candidate_calls", "choose_backend", "make_call", "plan_warmup",
           "random_ragged_stream", "segment_counts", "segmented_call", "specialization_keys", "state_variants",
           "triton_arg_class"]
