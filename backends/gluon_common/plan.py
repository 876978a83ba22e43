"""Launch plans of the Gluon backends: what would be launched, computed without launching.

:func:`plan` is a dry run of :func:`gdn_dispatch.backends.gluon_common.forward.forward`: for a validated
call and a compute capability it returns every Gluon kernel's grid, block sizes, constexprs
and TMA descriptors (global shape, strides, block shape, shared-memory layout), touching no
GPU and reading no tensor data, so it is testable with CPU tensors. ``forward`` launches
exactly these plans; ``kernels_for_aot`` compiles the same constexprs and signatures.

The forward launches two Gluon kernels, planned by ``plan_wy`` (:mod:`.wy`: kkt, solve and
w/u) and ``plan_state_output`` (:mod:`.state_output`: recurrence and output). The split
stages they replaced keep their planners for the split kernels (``plan_wu`` in :mod:`.wu`,
``plan_state`` here, ``plan_output`` in :mod:`.output`). Convention: ``plan_<stage>(problem,
device: DeviceInfo) -> LaunchPlan`` (``device.capability`` picks the engine,
``device.sm_count`` may size blocks), with :class:`DescPlan` descriptors, so that one
``ForwardPlan`` describes every launch and ``kernels_for_aot`` compiles the same constexprs.

Descriptors view every ``[B, T, X, D]`` tensor as the 2-D ``[B * T, X * D]`` matrix it is in
memory (rows = tokens), and ``h`` ``[NT, HV, K, V]`` as ``[NT * HV * K, V]``; a tile is
addressed by (row, column) element coordinates (int32 in the TMA unit: see
:func:`index_limits_reason`).

Host cost: a forward calls :func:`plan` and builds 12 descriptors per call, so the pure
parts are memoized: plans per :func:`plan_key` (bounded LRU) and shared-memory layouts per
(tile, dtype). Cached plans are shared between calls: treat a plan and its dicts as
read-only.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from gdn_dispatch.contract import CHUNK_SIZE, GDNProblem, StateLayout
from gdn_dispatch.device import DeviceInfo, assumed_device
from gdn_dispatch.varlen import ChunkTable

#: Warps per program of every Gluon kernel: one warpgroup (wgmma M = 64 per warpgroup;
#: 128 threads reach the 128 TMEM lanes).
NUM_WARPS = 4
#: Largest fp32 state tile ``K * BV`` a program holds: 64 registers per thread at 4 warps
#: on sm_90a; on sm_100a the same cap keeps one tcgen05.ld of the state at 64 registers.
MAX_STATE_TILE = 8192
INT32_MAX = 2**31 - 1
#: Plans kept by :func:`plan`. A server sees few distinct (shape, flags) keys; the bound
#: only matters when every call's batch differs (then the oldest keys are dropped).
PLAN_CACHE_SIZE = 256

_SIG_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def sig_dtype(dtype: torch.dtype) -> str:
    """Triton's signature spelling of a torch dtype ("bf16", "fp16", "fp32")."""
    return _SIG_DTYPE[dtype]


def gl_dtype(dtype: torch.dtype):
    from triton.experimental.gluon import language as gl

    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]


_ABSENT = object()


class LruCache:
    """A bounded least-recently-used map, safe across threads.

    ``functools.lru_cache`` needs hashable arguments; :func:`plan` computes its key from a
    GDNProblem (which holds tensors, hashed by identity and compared elementwise).
    """

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._data: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key, default=None):
        with self._lock:
            value = self._data.get(key, _ABSENT)
            if value is _ABSENT:
                return default
            self._data.move_to_end(key)
            return value

    def put(self, key, value):
        """Store ``value`` under ``key`` (dropping the least recently used beyond ``maxsize``); returns it."""
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def __len__(self) -> int:
        return len(self._data)


@functools.lru_cache(maxsize=64)
def nvmma_layout(shape: tuple[int, int], dtype: torch.dtype):
    """The NVMMASharedLayout of a ``shape`` tile of ``dtype`` (widest swizzle that fits).

    ``get_default_for`` costs about 5 us a call and a forward asks for 19 layouts of a
    handful of distinct tiles; the layout is a frozen value, so one instance is shared.
    """
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(shape), gl_dtype(dtype))


@functools.lru_cache(maxsize=1)
def _tensor_descriptor_class():
    """gluon's host TensorDescriptor (looked up once: an import statement per build costs ~0.5 us)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor


@dataclass(frozen=True)
class DescPlan:
    """One host-side TMA descriptor argument.

    Attributes
    ----------
    arg : kernel argument name ("w_desc").
    tensor : which tensor it views ("w", "u", "k", "h", "v_new", ...).
    shape, strides : the 2-D global view, in elements (last stride 1).
    block_shape : the tile one TMA message moves ([1, BN] for a TMA scatter row descriptor).
    dtype : torch dtype of the tensor.
    layout_shape : the shared-memory tile whose NVMMASharedLayout the descriptor carries
        (the block shape, except for scatter descriptors: the staged [BT, BN] tile).
    """

    arg: str
    tensor: str
    shape: tuple[int, int]
    strides: tuple[int, int]
    block_shape: tuple[int, int]
    dtype: torch.dtype
    layout_shape: tuple[int, int] | None = None

    @property
    def layout(self):
        """The NVMMASharedLayout of the shared tile (widest swizzle that fits)."""
        return nvmma_layout(self.layout_shape or self.block_shape, self.dtype)

    @property
    def scatter(self) -> bool:
        """A TMA scatter row descriptor (box ``[1, BN]``, the staged tile's layout)."""
        return self.layout_shape is not None

    @property
    def signature(self) -> str:
        """``tensordesc<bf16[64, 128],NVMMASharedLayout(...)>``, as a launch would specialize."""
        b0, b1 = self.block_shape
        return f"tensordesc<{sig_dtype(self.dtype)}[{b0}, {b1}],{self.layout!r}>"

    def check(self, tensor: torch.Tensor) -> None:
        """ValueError unless ``tensor`` is what the plan describes: its dtype, its element
        count, contiguous (the plan's 2-D view is then the tensor's memory)."""
        rows, cols = self.shape
        if tensor.dtype != self.dtype or tensor.numel() != rows * cols or not tensor.is_contiguous():
            raise ValueError(f"{self.arg}: planned {self.dtype} [{rows}, {cols}] contiguous, got "
                             f"{tensor.dtype} {tuple(tensor.shape)} contiguous={tensor.is_contiguous()}")

    def build(self, tensor: torch.Tensor):
        """The gluon TensorDescriptor over ``tensor`` (checked against the plan's shape).

        Triton's constructor validates every build (about 1.2 us). Skipping it for a plan
        validated once was measured: after the per-plan cache lookup it saved under 0.3 us
        a descriptor, too little to bypass triton's own checks.
        """
        self.check(tensor)
        TensorDescriptor = _tensor_descriptor_class()
        return TensorDescriptor(tensor, list(self.shape), list(self.strides), list(self.block_shape), self.layout)


@dataclass(frozen=True)
class LaunchPlan:
    """One kernel launch.

    Attributes
    ----------
    kernel : stage name ("wu_fwd", "state_fwd", "output_fwd").
    grid : launch grid.
    num_warps : warps per program.
    maxnreg : register cap per thread passed to ptxas, or None (ptxas's own choice).
    compiled : the compiled kernels of this plan by launch specialization, filled by
        :func:`gdn_dispatch.backends.gluon_common.launch.launch_planned` (not part of the plan's value).
    blocks : block sizes by name ({"BT": 64, "BV": 64, ...}).
    constexprs : the kernel's constexpr arguments (what kernels_for_aot compiles).
    descriptors : TMA descriptor arguments, in no particular order (looked up by ``arg``).
    scalars : runtime integer arguments by name ({"HV": 32, "GROUP": 2}).
    notes : why the blocks were chosen (for humans and `plan` tests).
    """

    kernel: str
    grid: tuple[int, ...]
    num_warps: int
    blocks: dict
    constexprs: dict
    descriptors: tuple[DescPlan, ...] = ()
    scalars: dict = field(default_factory=dict)
    notes: str = ""
    maxnreg: int | None = None
    compiled: dict = field(default_factory=dict, compare=False, repr=False)

    def desc(self, arg: str) -> DescPlan:
        return next(d for d in self.descriptors if d.arg == arg)


@dataclass(frozen=True)
class ForwardPlan:
    """Every Gluon launch of one call, in order (wy, [qk_rnorm with the qk l2 norm,]
    state_output), for one target."""

    capability: tuple[int, int]
    is_sm100: bool
    state_layout: StateLayout
    has_tails: bool
    stages: tuple[LaunchPlan, ...]

    def stage(self, kernel: str) -> LaunchPlan:
        return next(s for s in self.stages if s.kernel == kernel)


def drop_unused_scatter(descriptors: tuple[DescPlan, ...], constexprs: dict) -> tuple[tuple[DescPlan, ...], dict]:
    """(descriptors, constexprs) of a launch that stores through :func:`masks.store_chunk_tile`.

    Only sm_100a with varlen tails (the constexprs' ``IS_SM100`` and ``HAS_TAILS``) reads
    the TMA scatter row descriptors (sm_90a has no TMA scatter; without tails every chunk
    is a whole tile). Elsewhere they go to the kernel as None constexprs, so no launch
    builds or encodes them (each costs a host descriptor and a ``cuTensorMapEncodeTiled``
    per launch).
    """
    if constexprs["IS_SM100"] and constexprs["HAS_TAILS"]:
        return descriptors, constexprs
    unused = {d.arg: None for d in descriptors if d.scatter}
    return tuple(d for d in descriptors if not d.scatter), {**constexprs, **unused}


def chunks_have_tails(chunks: ChunkTable, T: int) -> bool:
    """True when some sequence ends inside a chunk: the kernels then mask rows past a
    sequence's end and never write them (constexpr ``HAS_TAILS``).

    Uniform batch: ``T % 64 != 0``. Varlen (one row of ``T`` tokens, lengths ``L_n``
    summing to ``T``): the ``NT = sum ceil(L_n / 64)`` chunks span ``64 * NT >= T`` rows,
    equal exactly when every ``L_n`` is a multiple of 64. So no length is read: O(1) per
    call, which :func:`plan_key` relies on (NT itself came from the host copy of cu_seqlens).
    """
    if chunks.uniform:
        return T % CHUNK_SIZE != 0
    return chunks.num_chunks * chunks.chunk_size != T


def has_tails(problem: GDNProblem) -> bool:
    """:func:`chunks_have_tails` of ``problem``'s chunk table."""
    return chunks_have_tails(problem.chunks, problem.T)


def index_limits_reason(problem: GDNProblem) -> str | None:
    """TMA coordinates are int32: rows B*T and NT*HV*K must stay below 2^31."""
    rows = problem.B * problem.T
    h_rows = problem.chunks.num_chunks * problem.HV * problem.K
    if rows > INT32_MAX or h_rows > INT32_MAX:
        return (f"TMA row coordinates are int32: needs B*T = {rows} and NT*HV*K = {h_rows} "
                f"below 2^31")
    return None


# ---------------------------------------------------------------------------------------
# Stage 4: the state recurrence


def choose_bv(K: int, V: int, num_heads: int, sm_count: int) -> int:
    """V-block of the state kernel: BV in {32, 64, 128}, BV <= V, K * BV <= 8192.

    One program walks all chunks of one (sequence, v-head, V-block) serially, so the only
    parallelism is ``num_heads * V / BV`` programs (``num_heads = N * HV``). Start from the
    widest block (fewest programs re-reading w and k) and halve while there are fewer than
    two programs per SM: few long sequences then still fill the part, and two resident
    programs per SM hide each other's per-chunk MMA -> register -> MMA latency.
    """
    bv = 128
    while bv > 32 and (bv > V or K * bv > MAX_STATE_TILE):
        bv //= 2
    while bv > 32 and num_heads * (V // bv) < 2 * max(sm_count, 1):
        bv //= 2
    return bv


def state_smem_bytes(K: int, BV: int, elem: int, BT: int = CHUNK_SIZE) -> int:
    """Shared memory of the state kernel: w/k/u double buffers, h, v_new and the scaled
    v_new tiles, barriers (the fp32 initial/final state tile is staged in the idle w/k ring;
    the compiler's layout-conversion scratch comes on top)."""
    rings = 2 * (BT * K * 2 + BT * BV) * elem
    tiles = (K * BV + 2 * BT * BV) * elem
    return rings + tiles + 8 * 8


def state_constexprs(problem: GDNProblem, is_sm100: bool) -> dict:
    """The constexpr flags of a kernel that walks the recurrence (state, state + output)."""
    return {
        "USE_H0": problem.initial_state is not None,
        "STORE_HT": problem.output_final_state,
        "STATE_VK": problem.state_layout is StateLayout.VK,
        "USE_L2NORM": problem.use_qk_l2norm,
        "HAS_TAILS": has_tails(problem),
        "IS_SM100": is_sm100,
    }


def plan_state(problem: GDNProblem, device: DeviceInfo, *, block_v: int | None = None) -> LaunchPlan:
    """Launch plan of :func:`gdn_dispatch.backends.gluon_common.state.state_fwd` for ``problem``.

    ``block_v`` overrides :func:`choose_bv` (AOT lists and benchmarks); it must divide V
    and keep ``K * BV <= 8192``.
    """
    B, T, H, K, HV, V = problem.B, problem.T, problem.H, problem.K, problem.HV, problem.V
    N, NT, dtype = problem.N, problem.chunks.num_chunks, problem.dtype
    BT = CHUNK_SIZE
    BV = block_v or choose_bv(K, V, N * HV, device.sm_count)
    if BV not in (32, 64, 128) or V % BV or K * BV > MAX_STATE_TILE:
        raise ValueError(f"block_v: expected 32, 64 or 128 dividing V = {V} with K * BV <= "
                         f"{MAX_STATE_TILE} (K = {K}), got {BV}")
    NV = V // BV
    rows = B * T
    descs = (
        DescPlan("w_desc", "w", (rows, HV * K), (HV * K, 1), (BT, K), dtype),
        DescPlan("u_desc", "u", (rows, HV * V), (HV * V, 1), (BT, BV), dtype),
        DescPlan("k_desc", "k", (rows, H * K), (H * K, 1), (BT, K), dtype),
        DescPlan("h_desc", "h", (NT * HV * K, V), (V, 1), (K, BV), dtype),
        DescPlan("vn_desc", "v_new", (rows, HV * V), (HV * V, 1), (BT, BV), dtype),
        DescPlan("vn_rows_desc", "v_new", (rows, HV * V), (HV * V, 1), (1, BV), dtype, (BT, BV)),
    )
    is_sm100 = device.capability[0] == 10
    descs, constexprs = drop_unused_scatter(descs, state_constexprs(problem, is_sm100))
    elem = torch.finfo(dtype).bits // 8
    return LaunchPlan(
        kernel="state_fwd",
        grid=(N * HV * NV,),
        num_warps=NUM_WARPS,
        blocks={"BT": BT, "K": K, "BV": BV, "NV": NV, "smem_bytes": state_smem_bytes(K, BV, elem)},
        constexprs=constexprs,
        descriptors=descs,
        scalars={"HV": HV, "GROUP": HV // H, "V": V},
        notes=f"BV={BV}: {N * HV} (sequence, v-head) pairs x {NV} V-blocks on {device.sm_count} SMs",
        # Without an explicit cap ptxas picked 80 registers and spilled 8 bytes for sm_100 at
        # K = 64, V = 128, BV = 64, fp16; with the cap at the hardware's 255 it takes 94 and
        # spills nothing (the other sm_100 specializations are unchanged or within 6
        # registers). sm_90 keeps the launch that was run and timed on the H200.
        maxnreg=255 if is_sm100 else None,
    )


# ---------------------------------------------------------------------------------------
# Composition


def resolve_device(problem: GDNProblem, capability: tuple[int, int] | None,
                   device: DeviceInfo | None) -> DeviceInfo:
    """The DeviceInfo block sizes come from: ``device`` if given, else the part assumed for
    ``capability`` (dry runs), else the device of the problem's tensors."""
    if device is not None:
        return device
    if capability is not None:
        return assumed_device(f"sm_{capability[0]}{capability[1]}")
    from gdn_dispatch.device import default_probe

    return default_probe().for_torch_device(problem.device)


def plan_key(problem: GDNProblem, capability: tuple[int, int], sm_count: int) -> tuple:
    """Everything the stage planners read from a call and a device, as a hashable key.

    Shapes, dtype, sequence and chunk counts, the tail flag, the state and l2-norm flags,
    the compute capability and the SM count. Tensor values (cu_seqlens' lengths included)
    are not in it: plans read none (:func:`chunks_have_tails` needs only NT). A stage
    planner that starts reading another attribute of the problem or device must add it.
    """
    return (capability, sm_count, tuple(problem.q.shape), tuple(problem.v.shape), problem.dtype,
            problem.N, problem.chunks.num_chunks, has_tails(problem), problem.initial_state is not None,
            problem.output_final_state, problem.state_layout, problem.use_qk_l2norm)


_PLANS = LruCache(PLAN_CACHE_SIZE)


def clear_plan_cache() -> None:
    """Forget every memoized plan (tests, or after editing a planner in a live session)."""
    _PLANS.clear()


def plan(problem: GDNProblem, capability: tuple[int, int] | None = None,
         device: DeviceInfo | None = None) -> ForwardPlan:
    """Dry run of the Gluon forward for ``problem`` on ``capability`` (e.g. ``(9, 0)``).

    Memoized per :func:`plan_key`: a call with the same key gets the same ForwardPlan
    object, equal to what :func:`compute_plan` would return (read-only: it is shared).

    Parameters
    ----------
    problem : a validated call (its tensors may live on the CPU; none is read).
    capability : compute capability to plan for; default: ``device``'s, else the tensors'.
    device : DeviceInfo to take ``sm_count`` from; default: a representative part of
        ``capability`` (gdn_dispatch.device.assumed_device).

    Returns
    -------
    ForwardPlan with the forward's Gluon launches (wy_fwd, state_output_fwd), in order.
    """
    info = resolve_device(problem, capability, device)
    cap = tuple(capability or info.capability)
    key = plan_key(problem, cap, info.sm_count)
    cached = _PLANS.get(key)
    if cached is not None:
        return cached
    if info.capability != cap:
        info = DeviceInfo(kind="cuda", index=info.index, name=info.name, capability=cap,
                          sm_count=info.sm_count, smem_optin=info.smem_optin)
    return _PLANS.put(key, compute_plan(problem, info))


def compute_plan(problem: GDNProblem, info: DeviceInfo) -> ForwardPlan:
    """:func:`plan` without the cache: every stage planned for ``info.capability``."""
    cap = tuple(info.capability)
    # The stage modules import this one (dataclasses, has_tails): import them here, not at the top.
    from gdn_dispatch.backends.gluon_common.qk_norm import plan_qk_rnorm
    from gdn_dispatch.backends.gluon_common.state_output import plan_state_output
    from gdn_dispatch.backends.gluon_common.wy import plan_wy

    # With the qk l2 norm, q's and k's row norms are reduced once before the fused kernel.
    planners = (plan_wy, plan_qk_rnorm, plan_state_output) if problem.use_qk_l2norm else (plan_wy, plan_state_output)
    stages = [planner(problem, info) for planner in planners]
    return ForwardPlan(capability=cap, is_sm100=cap[0] == 10, state_layout=problem.state_layout,
                       has_tails=has_tails(problem), stages=tuple(stages))
