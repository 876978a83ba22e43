"""The call contract: every argument of ``chunk_gated_delta_rule`` checked and normalized.

A :class:`GDNProblem` is what every backend receives. Building one is the only place user
input is validated, so a backend may rely on everything stated here: shapes agree, tensors
share one device and are in token rows, and the chunk slots are sized (see
:mod:`gdn_dispatch.varlen`). ``cu_seqlens`` values are checked against the partition rules
on a host copy: the caller's (``cu_seqlens_cpu`` or a list), or ``cu_seqlens`` itself when
it lies in host memory (a CPU call). A device ``cu_seqlens`` without one is checked only
under ``GDN_DEBUG_CHECKS=1``: reading it back would cost a device sync on every call.

Derived dimensions, used with these meanings everywhere in the package:

``B``  batch size; ``T`` tokens per batch row; ``H`` query/key heads; ``HV`` value heads
(a multiple of ``H``; v-head ``j`` reads q/k head ``j // (HV // H)``); ``K`` query/key head
dim; ``V`` value head dim; ``N`` sequences (``B`` without ``cu_seqlens``, else
``len(cu_seqlens) - 1``); ``C`` = 64 the chunk length.
"""

from __future__ import annotations

import collections
import functools
import enum
import logging
import dataclasses
import math
import numbers
from dataclasses import dataclass

import torch

from gdn_dispatch.context_parallel import context_parallel_reason
from gdn_dispatch.envvars import flag
from gdn_dispatch.native import admission as native_admission
from gdn_dispatch.registry import backend_names
from gdn_dispatch.varlen import ChunkTable, build_chunk_table

MAX_HEAD_DIM = 256
CHUNK_SIZE = 64
#: Gates (log decays) below this count as this, in every backend. exp(g) rounds to 0 in
#: float32 for both, so the token recurrence is the same; but the chunked form takes
#: differences of chunk-local gate sums, and a gate of -1e30 would swallow every smaller
#: gate after it in its chunk's sum (their decays would all come out 1; past -2.4e38, the
#: log2 scaling overflows to -inf and the differences to NaN).
GATE_FLOOR = -110.0

QKV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
POOL_DTYPES = (torch.float32, torch.bfloat16)

#: Inputs copied by :func:`make_problem` to a layout the kernels read (see
#: :func:`token_rows_stride`), counted by argument name; each copy is also logged at DEBUG
#: level on the ``gdn_dispatch`` logger.
INPUT_COPIES: collections.Counter = collections.Counter()
_log = logging.getLogger("gdn_dispatch")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


class GDNInputError(ValueError):
    """A call argument breaks the contract; the message names it, what was expected and what came."""


class StateLayout(str, enum.Enum):
    """How a recurrent state of one sequence and v-head is stored.

    ``KV``: ``[K, V]`` (fla's default); ``VK``: ``[V, K]`` (fla's ``state_v_first=True``).
    """

    KV = "kv"
    VK = "vk"

    @classmethod
    def parse(cls, value: "str | StateLayout") -> "StateLayout":
        if isinstance(value, StateLayout):
            return value
        layout = _LAYOUT_NAMES.get(value) if isinstance(value, str) else None
        if layout is not None:  # "kv" / "vk" as callers spell them, without the Enum's lookup
            return layout
        try:
            return cls(str(value).lower())
        except ValueError:
            raise GDNInputError(
                f"state_layout: expected one of {[m.value for m in cls]}, got {value!r}"
            ) from None


_LAYOUT_NAMES = {"kv": StateLayout.KV, "vk": StateLayout.VK}


@dataclass(frozen=True)
class GDNProblem:
    """A validated ``chunk_gated_delta_rule`` call.

    Attributes
    ----------
    q, k : Tensor ``[B, T, H, K]``, bf16/fp16/fp32, in token rows (see
        :func:`token_rows_stride`: each token's heads one contiguous run, any token stride).
    v : Tensor ``[B, T, HV, V]``, same dtype as q, in token rows.
    g : Tensor ``[B, T, HV]``, any float dtype, log-space per-token decay (not cumulated), in
        token rows.
    beta : Tensor ``[B, T, HV]``, any float dtype, in token rows.
    scale : float, the output scale (default ``K ** -0.5``).
    initial_state : Tensor ``[N, HV, K, V]`` ("kv") or ``[N, HV, V, K]`` ("vk"), any float
        dtype, contiguous; or None (zero state). With ``state_indices``: the state pool
        ``[P, HV, K, V]`` / ``[P, HV, V, K]``, float32 or bfloat16, contiguous.
    state_indices : int32/int64 Tensor ``[N]`` on the tensors' device, or None: sequence ``n``
        starts from ``initial_state[state_indices[n]]``; ``-1`` (or any index outside
        ``[0, P)``) starts from zeros and writes nothing back.
    inplace_final_state : bool, with ``state_indices``: each final state is written back to
        its pool row, in the pool's dtype.
    output_final_state : bool
    state_layout : StateLayout, the layout of initial_state and of the returned final state.
    use_qk_l2norm : bool, l2-normalize q and k over K before use.
    cu_seqlens : int32/int64 Tensor ``[N + 1]`` on the tensors' device, or None.
    chunks : ChunkTable, the sequences and chunk slots of the call (always present; a
        uniform batch is described as ``B`` sequences of ``T`` tokens each).
    backend : str or None, a backend name forced for this call.
    context_parallel : "auto", "off" or int >= 1 (segments of the longest sequence): the
        request :func:`gdn_dispatch.context_parallel.plan_for_problem` decides from.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    scale: float
    initial_state: torch.Tensor | None
    output_final_state: bool
    state_layout: StateLayout
    use_qk_l2norm: bool
    cu_seqlens: torch.Tensor | None
    chunks: ChunkTable
    backend: str | None
    state_indices: torch.Tensor | None = None
    inplace_final_state: bool = False
    context_parallel: str | int = "auto"

    @property
    def B(self) -> int:
        return self.q.shape[0]

    @property
    def T(self) -> int:
        return self.q.shape[1]

    @property
    def H(self) -> int:
        return self.q.shape[2]

    @property
    def K(self) -> int:
        return self.q.shape[3]

    @property
    def HV(self) -> int:
        return self.v.shape[2]

    @property
    def V(self) -> int:
        return self.v.shape[3]

    @property
    def N(self) -> int:
        return self.chunks.num_seqs

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def uses_state_pool(self) -> bool:
        return self.state_indices is not None

    def with_contiguous_inputs(self) -> "GDNProblem":
        """This problem with q, k, v, g, beta contiguous, for a backend whose kernels take no
        token stride; each copy made is counted in INPUT_COPIES and logged."""
        moved = {name: _counted_copy(name, getattr(self, name))
                 for name in ("q", "k", "v", "g", "beta") if not getattr(self, name).is_contiguous()}
        return dataclasses.replace(self, **moved) if moved else self

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        """``[N, HV, K, V]`` for "kv", ``[N, HV, V, K]`` for "vk"."""
        return state_dims(self.N, self.HV, self.K, self.V, self.state_layout is StateLayout.VK)


def state_dims(n: int, HV: int, K: int, V: int, vk: bool) -> tuple[int, int, int, int]:
    """The dims of ``n`` states: ``(n, HV, K, V)``, or ``(n, HV, V, K)`` with ``vk``."""
    return (n, HV, V, K) if vk else (n, HV, K, V)


def empty_final_state(wanted: bool, n: int, HV: int, K: int, V: int, vk: bool,
                      device: torch.device) -> torch.Tensor | None:
    """The float32 final states of ``n`` sequences (:func:`state_dims`), uninitialized, or
    None unless ``wanted`` (``output_final_state``)."""
    return torch.empty(state_dims(n, HV, K, V, vk), dtype=torch.float32, device=device) if wanted else None


_PROBLEM_FIELDS = frozenset(f.name for f in dataclasses.fields(GDNProblem))


def _new_problem(**fields) -> GDNProblem:
    """``GDNProblem(**fields)`` with every field given, built without the frozen dataclass's
    per-field ``object.__setattr__`` (about 4 µs of a call's validation, where the whole
    host path is budgeted in tens of microseconds); the object is the same."""
    problem = object.__new__(GDNProblem)
    problem.__dict__.update(fields)
    return problem


def replace_fields(problem: GDNProblem, **changes) -> GDNProblem:
    """``dataclasses.replace(problem, **changes)`` built as :func:`_new_problem` builds a
    problem (a segmented call makes one per call, on its host path). ``changes`` name
    fields only; nothing is validated again, so the caller keeps the contract."""
    unknown = changes.keys() - _PROBLEM_FIELDS
    if unknown:
        raise TypeError(f"replace_fields: {sorted(unknown)} are not GDNProblem fields")
    return _new_problem(**{**problem.__dict__, **changes})


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _require_tensor(name: str, value, ndim: int, dims: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise GDNInputError(f"{name}: expected a torch.Tensor {dims}, got {type(value).__name__}")
    if value.ndim != ndim:
        raise GDNInputError(f"{name}: expected {ndim} dims {dims}, got {_describe(value)}")
    return value


def _require_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise GDNInputError(
            f"{name}: expected dtype in {[str(d) for d in allowed]}, got {t.dtype}"
        )


def _require_contiguous(name: str, t: torch.Tensor) -> None:
    # States are addressed as whole [K, V] blocks per (row, head).
    if not t.is_contiguous():
        raise GDNInputError(
            f"{name}: expected a contiguous tensor (call .contiguous() first), "
            f"got {_describe(t)} with strides {tuple(t.stride())}"
        )


def token_rows_stride(t: torch.Tensor) -> int | None:
    """The token stride (elements) of ``t`` ``[B, T, heads, dim]`` or ``[B, T, heads]`` when
    its layout is one the kernels read directly, else None.

    Readable: the dims after T packed (each token's heads one contiguous run), any token
    stride at least that run, and batch rows ``T`` token strides apart. Views split out of
    one fused projection (``proj[..., a:b].view(B, T, H, K)``) are; a transposed or
    permuted tensor is not.
    """
    shape = t.shape
    if t.is_contiguous():  # the common case, without walking the strides
        run = 1
        for size in shape[2:]:
            run *= size
        return run
    strides = t.stride()
    run = 1
    for size, stride in zip(reversed(shape[2:]), reversed(strides[2:])):
        if size != 1 and stride != run:
            return None
        run *= size
    B, T = shape[0], shape[1]
    token = strides[1] if T > 1 else (strides[0] if B > 1 else run)
    if token < run:
        return None
    if B > 1 and strides[0] != T * token:
        return None
    return token


def _counted_copy(name: str, t: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous copy of ``t``, counted and logged. Always a new allocation (the
    allocator's alignment): ``contiguous()`` would hand back a contiguous tensor whose base
    is what the kernels cannot read (a 16-byte-misaligned slice)."""
    INPUT_COPIES[name] += 1
    _log.debug("gdn_dispatch: copied %s (shape %s, strides %s, data_ptr %% 16 = %d) to a new contiguous tensor",
               name, tuple(t.shape), tuple(t.stride()), t.data_ptr() % 16)
    return t.clone(memory_format=torch.contiguous_format)


def _token_rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when the kernels read its layout (:func:`token_rows_stride`), else one
    counted contiguous copy."""
    if t.is_contiguous() or token_rows_stride(t) is not None:
        return t
    return _counted_copy(name, t)


def _check_cu_seqlens(cu_host: torch.Tensor, T: int, name: str = "cu_seqlens") -> tuple[int, bool]:
    """The partition rules of ``cu_seqlens``, checked on a host copy (no device sync).

    Returns what the planners read of the offsets, from the same pass: the longest
    sequence's length, and whether every offset is a multiple of the chunk length.

    The values are compared as a Python list: a handful of torch ops on a small CPU tensor
    would cost more host time than the whole kernel launch sequence.
    """
    values = cu_host.tolist()
    n = len(values)
    if n < 2:
        raise GDNInputError(f"{name}: expected at least 2 entries [N + 1], got {n}")
    if values[0] != 0:
        raise GDNInputError(f"{name}: expected to start at 0, got {values[0]}")
    longest, misaligned, previous = 0, 0, 0
    for i, value in enumerate(values):
        length = value - previous
        if length < 0:
            raise GDNInputError(
                f"{name}: expected non-decreasing values, got {previous} then "
                f"{value} at positions {i - 1}, {i}"
            )
        if length > longest:
            longest = length
        misaligned |= value % CHUNK_SIZE
        previous = value
    if values[-1] != T:
        raise GDNInputError(f"{name}: expected to end at T = {T} (q.shape[1]), got {values[-1]}")
    return longest, not misaligned


def _check_host_copy(values: torch.Tensor, cu_host: torch.Tensor) -> None:
    """``cu_seqlens_cpu`` (``cu_host``) holds ``values``, cu_seqlens's own (read on the host)."""
    values, host = values.to(torch.int64), cu_host.to(torch.int64)
    if not torch.equal(values, host):
        i = int(torch.nonzero(values != host)[0])
        raise GDNInputError(
            f"cu_seqlens_cpu: expected the values of cu_seqlens, got {int(cu_host[i])} where "
            f"cu_seqlens holds {int(values[i])} (position {i})"
        )


def _in_host_memory(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s values costs no device sync: a CPU tensor, which is then
    its own host copy."""
    return t.is_cpu


def host_offsets(value) -> torch.Tensor:
    """A Python list/tuple of ints as a CPU tensor, for ``cu_seqlens`` given on the host:
    int32 (the offsets' dtype servers pass, so that a list call runs the kernels a tensor
    call of int32 offsets runs) unless a value needs int64."""
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        kinds = sorted({type(x).__name__ for x in value})
        raise GDNInputError(f"cu_seqlens: expected a list of ints [N + 1], got elements of type {kinds}")
    values = list(value)
    wide = any(x > _INT32_MAX or x < -_INT32_MAX - 1 for x in values)
    return torch.tensor(values, dtype=torch.int64 if wide else torch.int32)


_INT32_MAX = 2 ** 31 - 1


def checked_flag(name: str, value) -> bool:
    """A boolean argument: True/False, or an int 0 / 1. GDNInputError for anything else: a
    string such as "no" is truthy and would silently mean on."""
    if type(value) is bool:
        return value
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise GDNInputError(f"{name}: expected True or False, got {value!r}")


@functools.cache
def _backend_name_set() -> frozenset:
    """registry.toml's backend names (a forced ``backend=`` is checked against them per call)."""
    return frozenset(backend_names())


def debug_checks_enabled() -> bool:
    """``GDN_DEBUG_CHECKS=1``: also run the checks that synchronize with the device (read
    at every call; a value other than 1, 0 or unset raises ValueError)."""
    return flag("GDN_DEBUG_CHECKS")


def _debug_checks(tensors: dict[str, torch.Tensor | None], cu_seqlens, cu_host, T: int) -> None:
    """The checks that read device memory back (one sync each): the device ``cu_seqlens``
    against its host copy (or, without one, against the partition rules), and every input
    finite. Offsets in host memory were compared with their copy already
    (:func:`_finish_problem`)."""
    if cu_seqlens is not None and cu_host is None:
        _check_cu_seqlens(cu_seqlens.cpu(), T)
    elif cu_seqlens is not None and not _in_host_memory(cu_seqlens):
        _check_host_copy(cu_seqlens.cpu(), cu_host)
    for name, t in tensors.items():
        if t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise GDNInputError(f"{name}: expected finite values, got {bad} NaN/inf entries")


def _check_pool(pool, state_indices, N: int, HV: int, K: int, V: int, layout: "StateLayout",
                device: torch.device) -> torch.Tensor:
    """A state pool ``[P, HV, K, V]`` ("kv") / ``[P, HV, V, K]`` ("vk") and its row indices ``[N]``."""
    dims = "[P, HV, K, V]" if layout is StateLayout.KV else "[P, HV, V, K]"
    if pool is None:
        raise GDNInputError(f"state_indices: needs initial_state to be the state pool {dims}")
    state_indices = _require_tensor("state_indices", state_indices, 1, "[N]")
    _require_dtype("state_indices", state_indices, INDEX_DTYPES)
    if state_indices.device != device:
        raise GDNInputError(f"state_indices: expected device {device} (q's), got {state_indices.device}")
    if state_indices.numel() != N:
        raise GDNInputError(f"state_indices: expected one index per sequence, N = {N}, got {state_indices.numel()}")
    if not state_indices.is_contiguous():  # the kernels read index n at state_indices + n
        state_indices = _counted_copy("state_indices", state_indices)
    pool = _require_tensor("initial_state", pool, 4, f"(the state pool) {dims}")
    _require_dtype("initial_state", pool, POOL_DTYPES)
    per_row = (HV, K, V) if layout is StateLayout.KV else (HV, V, K)
    if tuple(pool.shape[1:]) != per_row or pool.shape[0] < 1:
        raise GDNInputError(
            f"initial_state: expected a state pool {dims} = (P, {', '.join(map(str, per_row))}) with P >= 1 "
            f"for state_layout={layout.value!r}, got {_describe(pool)}"
        )
    _require_contiguous("initial_state", pool)
    return state_indices


def _debug_check_indices(state_indices: torch.Tensor, P: int) -> None:
    """Pool indices in [-1, P) and no pool row used twice (reads them back: a sync)."""
    idx = state_indices.cpu().to(torch.int64)
    bad = (idx < -1) | (idx >= P)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise GDNInputError(f"state_indices: expected values in [-1, {P}) (P pool rows), got {int(idx[i])} at position {i}")
    used = idx[idx >= 0]
    if used.numel() != used.unique().numel():
        raise GDNInputError("state_indices: expected each pool row at most once (two sequences would share a state)")


def _resolve_layout(state_layout, state_v_first) -> StateLayout:
    """``state_layout`` wins; fla's ``state_v_first=True`` means "vk"; both must agree."""
    if state_layout is None and state_v_first is None:  # the common call, without the enum lookup
        return StateLayout.KV
    if state_layout is None:
        return StateLayout.VK if state_v_first else StateLayout.KV
    layout = StateLayout.parse(state_layout)
    if state_v_first is not None and bool(state_v_first) != (layout is StateLayout.VK):
        raise GDNInputError(
            f"state_v_first: {state_v_first} contradicts state_layout={layout.value!r}; pass one of them"
        )
    return layout


def checked_scale(scale) -> float:
    """``scale`` as a float: any finite real number (float, int, NumPy scalar, Fraction);
    GDNInputError for anything else (bool, tensors, NaN, inf). The eager contract and the
    traced call (:mod:`gdn_dispatch.api`) both apply this rule."""
    if type(scale) is not float:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            hint = ""
            if isinstance(scale, torch.Tensor):
                hint = " (reading a tensor's value would synchronize with its device: pass float(scale))"
            elif torch.compiler.is_compiling() and type(scale).__name__ == "ndarray":
                # dynamo traces a NumPy scalar as a 0-d array: its value is unknown while tracing.
                hint = (" (torch.compile traces a NumPy scalar as an array whose value is unknown while tracing: "
                        "pass a Python float, converted outside the compiled function)")
            raise GDNInputError(f"scale: expected a real number (float, int, NumPy scalar) or None, "
                                f"got {type(scale).__name__}{hint}")
        scale = float(scale)
    # A comparison rather than math.isfinite: dynamo traces a float that changed between
    # compilations as a symbolic float, which math.isfinite does not take (NaN fails it too).
    if not abs(scale) < math.inf:
        raise GDNInputError(f"scale: expected a finite number, got {scale!r}")
    return scale


def make_problem(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    state_layout: str | StateLayout | None = None,
    backend: str | None = None,
    state_v_first: bool | None = None,
    head_first: bool | None = None,
    state_indices: torch.Tensor | None = None,
    inplace_final_state: bool = False,
    context_parallel: str | int = "auto",
) -> GDNProblem:
    """Validate a ``chunk_gated_delta_rule`` call and return it as a :class:`GDNProblem`.

    Raises :class:`GDNInputError` for the first broken rule. Nothing here synchronizes with
    the device or reads device memory (unless ``GDN_DEBUG_CHECKS=1``): a device
    ``cu_seqlens`` is checked for dtype, shape and device, its values only against the
    partition rules when a host copy (``cu_seqlens_cpu`` or a list) is given. Without one,
    no backend needs its values on the host (kernels map chunk slots from the device copy,
    :mod:`gdn_dispatch.varlen`). A ``cu_seqlens`` in host memory (a CPU call) is its own
    host copy: its values are always checked, as ``cu_seqlens``.

    Where the native host layer is loaded (:func:`gdn_dispatch.native.admission`), the
    tensor checks of the common call (contiguous inputs, a state pool or not) run there first, in
    one C++ call; a call it does not accept is checked here, so every error is this
    module's message either way.
    """
    if head_first is not None and head_first:
        raise GDNInputError(
            "head_first: [B, H, T, ...] inputs are not supported; pass q, k as [B, T, H, K] "
            "and v as [B, T, HV, V] (e.g. q.transpose(1, 2).contiguous())"
        )
    layout = _resolve_layout(state_layout, state_v_first)
    admit = native_admission()
    if admit is not None:
        cu_host = cu_seqlens_cpu
        if cu_host is None and isinstance(cu_seqlens, torch.Tensor) and _in_host_memory(cu_seqlens):
            # admit checks the values of a host copy only: given cu_seqlens as its own, it
            # refuses offsets that break a rule (the Python path below then names cu_seqlens).
            cu_host = cu_seqlens
        facts = admit(q, k, v, g, beta, initial_state, cu_seqlens, cu_host, layout is StateLayout.VK, state_indices)
        if facts is not None:
            # The native layer found every tensor rule of the common call kept (contiguous
            # inputs; a state pool and its indices, if any): the scalars are left to check.
            B, T, _, K, HV, V, _, longest, aligned = facts
            return _finish_problem(
                q, k, v, g, beta, B, T, K, HV, V, cu_seqlens, cu_seqlens_cpu, cu_host, longest, aligned,
                initial_state, state_indices, True, layout, scale, output_final_state, use_qk_l2norm_in_kernel,
                backend, inplace_final_state, context_parallel)
    q = _require_tensor("q", q, 4, "[B, T, H, K]")
    k = _require_tensor("k", k, 4, "[B, T, H, K]")
    v = _require_tensor("v", v, 4, "[B, T, HV, V]")
    g = _require_tensor("g", g, 3, "[B, T, HV]")
    beta = _require_tensor("beta", beta, 3, "[B, T, HV]")
    q_shape, v_shape = q.shape, v.shape
    B, T, H, K = q_shape
    _, _, HV, V = v_shape

    if k.shape != q_shape:
        raise GDNInputError(f"k: expected the shape of q {tuple(q_shape)} [B, T, H, K], got {_describe(k)}")
    if v_shape[0] != B or v_shape[1] != T:
        raise GDNInputError(f"v: expected [B, T] = {(B, T)} as q, got {_describe(v)}")
    gate_shape = (B, T, HV)
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != gate_shape:
            raise GDNInputError(f"{name}: expected shape [B, T, HV] = {gate_shape}, got {_describe(t)}")
    if H == 0 or HV % H != 0:
        raise GDNInputError(f"v: expected HV (v.shape[2]) to be a multiple of H = {H}, got HV = {HV}")
    for name, dim, size in (("q", "K", K), ("v", "V", V)):
        if not 1 <= size <= MAX_HEAD_DIM:
            raise GDNInputError(f"{name}: expected head dim {dim} in [1, {MAX_HEAD_DIM}], got {size}")

    dtype = q.dtype
    _require_dtype("q", q, QKV_DTYPES)
    for name, t in (("k", k), ("v", v)):
        if t.dtype is not dtype:
            raise GDNInputError(f"{name}: expected q's dtype {dtype}, got {t.dtype}")
    _require_dtype("g", g, FLOAT_DTYPES)
    _require_dtype("beta", beta, FLOAT_DTYPES)

    device = q.device
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if isinstance(t, torch.Tensor) and t.device != device:
            raise GDNInputError(f"{name}: expected device {device} (q's), got {t.device}")
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and g.is_contiguous()
            and beta.is_contiguous()):
        q, k, v, g, beta = (_token_rows(name, t) for name, t in
                            (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)))

    cu_host = None
    longest = aligned = None
    if isinstance(cu_seqlens, (list, tuple)):
        if cu_seqlens_cpu is not None:
            raise GDNInputError(
                "cu_seqlens_cpu: not needed when cu_seqlens is a list (the list is the host copy); "
                "pass one of them"
            )
        cu_host = host_offsets(cu_seqlens)
        cu_seqlens = cu_host.to(device)
    elif cu_seqlens is not None:
        cu_seqlens = _require_tensor("cu_seqlens", cu_seqlens, 1, "[N + 1]")
        _require_dtype("cu_seqlens", cu_seqlens, INDEX_DTYPES)
        if cu_seqlens.device != device:
            raise GDNInputError(f"cu_seqlens: expected device {device} (q's), got {cu_seqlens.device}")
        if cu_seqlens.shape[0] < 2:
            raise GDNInputError(f"cu_seqlens: expected at least 2 entries [N + 1], got {cu_seqlens.shape[0]}")
        if not cu_seqlens.is_contiguous():  # the kernels read offset n at cu_seqlens + n
            cu_seqlens = _counted_copy("cu_seqlens", cu_seqlens)
        if cu_seqlens_cpu is None and _in_host_memory(cu_seqlens):
            cu_host = cu_seqlens
    if cu_seqlens is not None:
        if B != 1:
            raise GDNInputError(
                f"cu_seqlens: requires B == 1 (sequences packed along T), got q with B = {B}"
            )
        if cu_seqlens_cpu is not None:
            cu_seqlens_cpu = _require_tensor("cu_seqlens_cpu", cu_seqlens_cpu, 1, "[N + 1]")
            _require_dtype("cu_seqlens_cpu", cu_seqlens_cpu, INDEX_DTYPES)
            if cu_seqlens_cpu.device.type != "cpu":
                raise GDNInputError(f"cu_seqlens_cpu: expected a CPU tensor, got device {cu_seqlens_cpu.device}")
            if cu_seqlens_cpu.numel() != cu_seqlens.numel():
                raise GDNInputError(
                    f"cu_seqlens_cpu: expected {cu_seqlens.numel()} entries like cu_seqlens, "
                    f"got {cu_seqlens_cpu.numel()}"
                )
            cu_host = cu_seqlens_cpu
            longest, aligned = _check_cu_seqlens(cu_host, T, "cu_seqlens_cpu")
        elif cu_host is not None:  # the offsets came as a list, or lie in host memory
            longest, aligned = _check_cu_seqlens(cu_host, T)
    elif cu_seqlens_cpu is not None:
        raise GDNInputError("cu_seqlens_cpu: given without cu_seqlens; pass both or neither")

    return _finish_problem(
        q, k, v, g, beta, B, T, K, HV, V, cu_seqlens, cu_seqlens_cpu, cu_host, longest, aligned, initial_state,
        state_indices, False, layout, scale, output_final_state, use_qk_l2norm_in_kernel, backend,
        inplace_final_state, context_parallel)


def _finish_problem(q, k, v, g, beta, B: int, T: int, K: int, HV: int, V: int, cu_seqlens, cu_seqlens_cpu, cu_host,
                    longest, aligned, initial_state, state_indices, state_admitted: bool, layout: StateLayout,
                    scale, output_final_state, use_qk_l2norm_in_kernel, backend, inplace_final_state,
                    context_parallel) -> GDNProblem:
    """The rest of :func:`make_problem` once q, k, v, g, beta and the offsets are checked:
    the debug checks, the chunk table, the state or the state pool and its indices (unless
    ``state_admitted``: the native admission checked them), the scalars."""
    device = q.device
    if cu_seqlens_cpu is not None and _in_host_memory(cu_seqlens):
        # Both copies on the host (a CPU call): comparing them costs no sync.
        _check_host_copy(cu_seqlens, cu_seqlens_cpu)
    if debug_checks_enabled():
        _debug_checks({"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state if isinstance(initial_state, torch.Tensor) else None},
                      cu_seqlens, cu_seqlens_cpu, T)

    chunks = build_chunk_table(B, T, cu_seqlens, cu_host, CHUNK_SIZE, device, longest=longest, aligned=aligned)
    N = chunks.num_seqs

    if state_indices is not None:
        if not state_admitted:
            state_indices = _check_pool(initial_state, state_indices, N, HV, K, V, layout, device)
    elif inplace_final_state:
        raise GDNInputError("inplace_final_state: needs state_indices (the pool rows to write back)")
    elif initial_state is not None and not state_admitted:
        initial_state = _require_tensor("initial_state", initial_state, 4, "[N, HV, K, V] or [N, HV, V, K]")
        _require_dtype("initial_state", initial_state, FLOAT_DTYPES)
        expected = state_dims(N, HV, K, V, layout is StateLayout.VK)
        if initial_state.shape != expected:
            dims = "[N, HV, K, V]" if layout is StateLayout.KV else "[N, HV, V, K]"
            raise GDNInputError(
                f"initial_state: expected {dims} = {expected} for state_layout={layout.value!r} "
                f"and N = {N} sequences, got {_describe(initial_state)}"
            )
        _require_contiguous("initial_state", initial_state)
    if state_indices is not None and debug_checks_enabled():
        _debug_check_indices(state_indices, initial_state.shape[0])

    scale = K ** -0.5 if scale is None else checked_scale(scale)
    cp_reason = None if context_parallel == "auto" else context_parallel_reason(context_parallel)
    if cp_reason is not None:
        raise GDNInputError(f"context_parallel: {cp_reason}")
    if backend is not None and backend not in _backend_name_set():
        raise GDNInputError(f"backend: expected one of {backend_names()} or None, got {backend!r}")

    return _new_problem(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale,
        initial_state=initial_state, output_final_state=checked_flag("output_final_state", output_final_state),
        state_layout=layout, use_qk_l2norm=checked_flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel),
        cu_seqlens=cu_seqlens, chunks=chunks, backend=backend,
        state_indices=state_indices, inplace_final_state=checked_flag("inplace_final_state", inplace_final_state),
        context_parallel=context_parallel,
    )
