"""Launch plans of the Gluon kernels: what one launch needs, computed without launching.

A :class:`LaunchPlan` fixes one kernel launch for a *call class* (warps, register cap,
constexprs, the rule of its grid) with its TMA descriptors as :class:`DescPlan` values
(column count, strides, block shape, shared-memory layout), touching no GPU and reading no
tensor data, so it is testable with CPU tensors. Nothing in it depends on the call's token
count ``B * T`` or sequence count ``N``: the grid (:class:`GridRule`) and every
descriptor's row count are plain integer arithmetic on those two numbers at each launch
(:func:`.launch.launch_planned`), so calls of any length share one plan, and with it the
compiled kernel kept on it. :class:`BoundLaunch` is a plan seen with one call's counts:
what a dry run reports (grid, descriptor shapes).

Each stage module has a planner ``plan_<stage>(problem, device) -> BoundLaunch``;
:mod:`.plan` composes the shared plans into the forward's plan, the forward launches
exactly these plans and ``kernels_for_aot`` compiles the same constexprs and signatures.

Descriptors view every ``[B, T, X, D]`` tensor as the 2-D ``[B * T, X * D]`` matrix it is in
memory (rows = tokens); a tile is addressed by (row, column) element coordinates (int32 in
the TMA unit: see :func:`index_limits_reason`). The kernels' own tensors are contiguous
(row stride ``X * D``); the inputs q, k, v are read in place in token rows (any row stride
TMA accepts, :func:`tma_rows_reason`), so their descriptors take the row stride of the
tensor at each launch (``DescPlan.token_rows``): a new stride never needs a new plan.

Host cost: the pure parts are memoized: shared-memory layouts per (tile, dtype), and (in
:mod:`.plan`) whole plans per call class. Cached plans are shared between calls: treat a
plan and its dicts as read-only.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from gdn_dispatch.contract import CHUNK_SIZE, GDNProblem, token_rows_stride
from gdn_dispatch.device import DeviceInfo, assumed_device
from gdn_dispatch.varlen import ChunkTable

#: Warps per program of every Gluon kernel: one warpgroup (wgmma M = 64 per warpgroup;
#: 128 threads reach the 128 TMEM lanes).
NUM_WARPS = 4
#: Largest fp32 state tile ``K * BV`` a program holds: 64 registers per thread at 4 warps
#: on sm_90a; on sm_100a the same cap keeps one tcgen05.ld of the state at 64 registers.
MAX_STATE_TILE = 8192
INT32_MAX = 2**31 - 1
#: Plans kept per cache (:func:`.plan.plan`). A server sees few distinct (shape, flags) keys; the bound
#: only matters when every call's batch differs (then the oldest keys are dropped).
PLAN_CACHE_SIZE = 256

_SIG_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
              torch.int64: "i64"}


def sig_dtype(dtype: torch.dtype) -> str:
    """Triton's signature spelling of a torch dtype ("bf16", "fp16", "fp32", "i32", "i64")."""
    return _SIG_DTYPE[dtype]


def gl_dtype(dtype: torch.dtype):
    from triton.experimental.gluon import language as gl

    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]


_ABSENT = object()


class LruCache:
    """A bounded least-recently-used map, safe across threads.

    ``functools.lru_cache`` needs hashable arguments; :func:`.plan.plan` computes its key from a
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
    shape : the 2-D global view ``(rows, cols)`` in elements. ``rows`` is None in a shared
        plan: each launch takes the row count of the tensor it is given (``B * T``); a
        :class:`BoundLaunch` fills it in for one call.
    strides : the 2-D strides of a contiguous tensor, ``(cols, 1)``.
    block_shape : the tile one TMA message moves ([1, BN] for a TMA scatter row descriptor).
    dtype : torch dtype of the tensor.
    layout_shape : the shared-memory tile whose NVMMASharedLayout the descriptor carries
        (the block shape, except for scatter descriptors: the staged [BT, BN] tile).
    token_rows : an input read in place: a launch takes the row stride of the tensor it is
        given (:meth:`view_of`).
    """

    arg: str
    tensor: str
    shape: tuple[int | None, int]
    strides: tuple[int, int]
    block_shape: tuple[int, int]
    dtype: torch.dtype
    layout_shape: tuple[int, int] | None = None
    token_rows: bool = False

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
        """``tensordesc<bf16[64, 128],NVMMASharedLayout(...)>``, as a launch would specialize
        (the global shape is not part of it: a new row count compiles nothing)."""
        b0, b1 = self.block_shape
        return f"tensordesc<{sig_dtype(self.dtype)}[{b0}, {b1}],{self.layout!r}>"

    def with_rows(self, rows: int) -> DescPlan:
        """This descriptor over a tensor of ``rows`` token rows (a dry run's view)."""
        return dataclasses.replace(self, shape=(rows, self.shape[1]))

    def view_of(self, tensor: torch.Tensor) -> tuple[list[int], list[int]]:
        """``([rows, cols], [row stride, 1])`` of the descriptor over ``tensor``, in elements:
        rows from the tensor (``numel / cols``: ``B * T`` for a ``[B, T, X, D]`` tensor),
        the plan's strides for a contiguous tensor, ``[token stride, 1]`` for a
        ``token_rows`` input in token rows.

        ValueError unless ``tensor`` is what the plan describes: its dtype, whole rows of
        ``cols`` elements (the plan's row count when it fixes one), and contiguous (the 2-D
        view is then the tensor's memory) or, for a ``token_rows`` input, in token rows the
        TMA unit reads (:func:`tma_rows_reason`).
        """
        planned_rows, cols = self.shape
        numel = tensor.numel()
        contiguous = tensor.is_contiguous()
        rows = numel // cols
        if (tensor.dtype != self.dtype or rows * cols != numel or (planned_rows is not None and rows != planned_rows)
                or not (contiguous or self.token_rows)):
            raise ValueError(f"{self.arg}: planned {self.dtype} [{'rows' if planned_rows is None else planned_rows}, "
                             f"{cols}] contiguous, got {tensor.dtype} {tuple(tensor.shape)} contiguous={contiguous}")
        if contiguous:
            return [rows, cols], list(self.strides)
        reason = tma_rows_reason(self.tensor, tensor)
        if reason is not None:
            raise ValueError(f"{self.arg}: {reason}")
        if rows != tensor.shape[0] * tensor.shape[1]:
            raise ValueError(f"{self.arg}: planned rows of {cols} elements, got {tuple(tensor.shape)}")
        return [rows, cols], [token_rows_stride(tensor), 1]

    def strides_for(self, tensor: torch.Tensor) -> list[int]:
        """The strides of :meth:`view_of` (with its checks)."""
        return self.view_of(tensor)[1]

    def check(self, tensor: torch.Tensor) -> None:
        """:meth:`view_of`'s checks alone."""
        self.view_of(tensor)

    def build(self, tensor: torch.Tensor):
        """The gluon TensorDescriptor over ``tensor`` (checked against the plan: :meth:`view_of`).

        Triton's constructor validates every build (about 1.2 us); the JIT launch path
        builds one per descriptor, the direct path none (:class:`.launch.TmaArg`).
        """
        shape, strides = self.view_of(tensor)
        TensorDescriptor = _tensor_descriptor_class()
        return TensorDescriptor(tensor, shape, strides, list(self.block_shape), self.layout)


@dataclass(frozen=True)
class GridRule:
    """The launch grid of a call as plain integer arithmetic on its counts.

    ``grid[0] = max(minimum, rows // row_block (rounded up with ceil) + num_seqs * per_seq) * times``
    (no row term when ``row_block`` is 0), followed by the fixed axes ``more``. ``rows`` is
    what the stage counts (token rows ``B * T``, or (token, head) rows), ``num_seqs`` the
    call's ``N``.
    """

    row_block: int = 0
    ceil: bool = False
    per_seq: int = 0
    times: int = 1
    minimum: int = 0
    more: tuple[int, ...] = ()

    def __call__(self, rows: int, num_seqs: int) -> tuple[int, ...]:
        if self.row_block:
            units = -(-rows // self.row_block) if self.ceil else rows // self.row_block
        else:
            units = 0
        return (max(self.minimum, units + num_seqs * self.per_seq) * self.times, *self.more)

    def launch_grid(self, rows: int, num_seqs: int) -> tuple[int, int, int]:
        """:meth:`__call__` padded to the three axes a launcher takes."""
        grid = self(rows, num_seqs) + (1, 1)
        return grid[0], grid[1], grid[2]


@dataclass(frozen=True)
class LaunchPlan:
    """One kernel launch of a call class (shared by every call of the class, whatever its
    ``B * T`` and ``N``).

    Attributes
    ----------
    kernel : stage name ("wy_fwd", "qk_rnorm_fwd", "state_output_fwd").
    grid_rule : the launch grid from the call's counts (:meth:`grid_for`).
    num_warps : warps per program.
    maxnreg : register cap per thread passed to ptxas, or None (ptxas's own choice).
    compiled : the compiled kernels of this plan by launch specialization, filled by
        :func:`gdn_dispatch.backends.gluon_common.launch.launch_planned` (not part of the plan's value).
    blocks : block sizes by name ({"BT": 64, "BV": 64, ...}).
    constexprs : the kernel's constexpr arguments (what kernels_for_aot compiles).
    descriptors : TMA descriptor arguments (row count from the tensor at each launch), in
        no particular order (looked up by ``arg``).
    scalars : runtime integer arguments fixed by the class, by name ({"HV": 32, "GROUP": 2}).
    row_scalars : runtime integer arguments that are the launch's row count, by name (a
        dry run's :attr:`BoundLaunch.scalars` shows them).
    notes : why the blocks were chosen (for humans and `plan` tests).
    """

    kernel: str
    grid_rule: GridRule
    num_warps: int
    blocks: dict
    constexprs: dict
    descriptors: tuple[DescPlan, ...] = ()
    scalars: dict = field(default_factory=dict)
    notes: str = ""
    maxnreg: int | None = None
    row_scalars: tuple[str, ...] = ()
    compiled: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def shared(self) -> LaunchPlan:
        """The plan itself (a :class:`BoundLaunch` answers with the plan it views)."""
        return self

    def grid_for(self, rows: int, num_seqs: int) -> tuple[int, ...]:
        """The grid of a call of ``rows`` rows (as the stage counts them) in ``num_seqs`` sequences."""
        return self.grid_rule(rows, num_seqs)

    def desc(self, arg: str) -> DescPlan:
        return next(d for d in self.descriptors if d.arg == arg)

    def bind(self, rows: int, num_seqs: int) -> BoundLaunch:
        """This plan as one call of ``rows`` rows in ``num_seqs`` sequences launches it."""
        return BoundLaunch(self, rows, num_seqs)


class BoundLaunch:
    """A shared :class:`LaunchPlan` with one call's row and sequence counts: what a dry run of
    that call reports. ``grid``, ``descriptors`` (row counts filled in) and ``scalars`` (with
    the row scalars) are the call's; every other attribute is the plan's. Host wrappers
    launch ``shared`` with the counts of the tensors they are given.
    """

    __slots__ = ("shared", "rows", "num_seqs")

    def __init__(self, shared: LaunchPlan, rows: int, num_seqs: int):
        self.shared, self.rows, self.num_seqs = shared, rows, num_seqs

    def __getattr__(self, name):
        return getattr(self.shared, name)

    @property
    def grid(self) -> tuple[int, ...]:
        return self.shared.grid_rule(self.rows, self.num_seqs)

    @property
    def descriptors(self) -> tuple[DescPlan, ...]:
        return tuple(d.with_rows(self.rows) for d in self.shared.descriptors)

    @property
    def scalars(self) -> dict:
        return {**self.shared.scalars, **{name: self.rows for name in self.shared.row_scalars}}

    def desc(self, arg: str) -> DescPlan:
        return self.shared.desc(arg).with_rows(self.rows)

    def __eq__(self, other):
        if not isinstance(other, BoundLaunch):
            return NotImplemented
        return (self.shared, self.rows, self.num_seqs) == (other.shared, other.rows, other.num_seqs)

    def __hash__(self):
        return hash((self.shared.kernel, self.rows, self.num_seqs))

    def __repr__(self):
        return f"BoundLaunch({self.shared.kernel}, rows={self.rows}, num_seqs={self.num_seqs}, grid={self.grid})"


def drop_unused_scatter(descriptors: tuple[DescPlan, ...], constexprs: dict) -> tuple[tuple[DescPlan, ...], dict]:
    """(descriptors, constexprs) of a launch that stores through :func:`masks.store_chunk_tile`.

    Only tcgen05 with varlen tails (the constexprs' ``ENGINE`` and ``HAS_TAILS``) reads
    the TMA scatter row descriptors (sm_90a has no TMA scatter; without tails every chunk
    is a whole tile). Elsewhere they go to the kernel as None constexprs, so no launch
    builds or encodes them (each costs a host descriptor and a ``cuTensorMapEncodeTiled``
    per launch).
    """
    if constexprs["ENGINE"].is_sm100 and constexprs["HAS_TAILS"]:
        return descriptors, constexprs
    unused = {d.arg: None for d in descriptors if d.scatter}
    return tuple(d for d in descriptors if not d.scatter), {**constexprs, **unused}


def chunks_have_tails(chunks: ChunkTable, T: int) -> bool:
    """True when some sequence ends inside a chunk: the kernels then mask rows past a
    sequence's end and never write them (constexpr ``HAS_TAILS``).

    Uniform batch: ``T % 64 != 0``. Varlen: every length is a multiple of 64 exactly when
    every offset is, which only a host copy of ``cu_seqlens`` can show (read on the host,
    no sync); without one, True (the kernels then find each chunk's rows themselves, which
    is right for any lengths).
    """
    if chunks.uniform:
        return T % CHUNK_SIZE != 0
    if chunks.cu_seqlens_host is None:
        return True
    if chunks.chunk_size == CHUNK_SIZE:
        return not chunks.chunk_aligned()
    return any(offset % CHUNK_SIZE for offset in chunks.cu_seqlens_host.tolist())


def has_tails(problem: GDNProblem) -> bool:
    """:func:`chunks_have_tails` of ``problem``'s chunk table."""
    return chunks_have_tails(problem.chunks, problem.T)


#: What the TMA unit needs of a global tensor: a 16-byte-aligned base and row strides that
#: are multiples of 16 bytes.
TMA_ALIGN = 16


def tma_rows_reason(name: str, t: torch.Tensor) -> str | None:
    """Why the TMA unit cannot read ``t`` ``[B, T, heads, dim]`` in place as the 2-D
    ``[B * T, heads * dim]`` view of its token rows, or None.

    Token rows (:func:`gdn_dispatch.contract.token_rows_stride`: views split out of one
    fused projection) qualify when the base is 16-byte aligned and the token stride is a
    multiple of 16 bytes.
    """
    stride = math.prod(t.shape[2:]) if t.is_contiguous() else token_rows_stride(t)
    if stride is None:
        return f"{name}: not in token rows (strides {tuple(t.stride())} for shape {tuple(t.shape)})"
    misaligned = t.data_ptr() % TMA_ALIGN
    if misaligned:
        return f"{name}: TMA needs a {TMA_ALIGN}-byte-aligned base, got data_ptr() % {TMA_ALIGN} = {misaligned}"
    if stride * t.element_size() % TMA_ALIGN:
        return (f"{name}: TMA needs a token stride of a multiple of {TMA_ALIGN} bytes, got {stride} elements of "
                f"{t.element_size()} bytes")
    return None


def token_stride(t: torch.Tensor) -> int:
    """Elements between consecutive tokens of ``t`` ``[B, T, heads(, dim)]`` in token rows
    (what pointer kernels take for g, beta, q and k); ValueError for any other layout."""
    if t.is_contiguous():
        return math.prod(t.shape[2:])
    stride = token_rows_stride(t)
    if stride is None:
        raise ValueError(f"expected token rows (heads packed, batch rows T tokens apart), got shape "
                         f"{tuple(t.shape)} with strides {tuple(t.stride())}")
    return stride


def index_limits_reason(problem: GDNProblem) -> str | None:
    """TMA row coordinates are int32, and so are program ids: B*T and the w/u kernel's
    programs (chunk slots x v-heads) must stay below 2^31."""
    return counts_limits_reason(problem.B * problem.T, problem.chunks.num_slots, problem.HV)


def counts_limits_reason(rows: int, slots: int, HV: int) -> str | None:
    """:func:`index_limits_reason` of a call's token rows ``B * T``, chunk slots and v-heads."""
    programs = slots * HV
    if rows > INT32_MAX or programs > INT32_MAX:
        return (f"TMA row coordinates and program ids are int32: needs B*T = {rows} and chunk slots x HV = "
                f"{programs} below 2^31")
    return None


def tile_desc(arg: str, tensor: str, dtype: torch.dtype, cols: int, block, scatter: bool = False,
              token_rows: bool = False):
    """DescPlan of the row-major 2-D view ``[rows, cols]`` (rows from the tensor at each
    launch) with TMA box ``block``; a scatter descriptor (box ``[1, BN]``) carries the layout
    of the staged ``[64, BN]`` tile; an input read in place in ``token_rows`` takes its row
    stride from the tensor."""
    layout_shape = (CHUNK_SIZE, block[1]) if scatter else None
    return DescPlan(arg, tensor, (None, cols), (cols, 1), tuple(block), dtype, layout_shape, token_rows)


def pointer_attrs(fn, names) -> dict:
    """``tt.divisibility`` 16 on the named arguments, as a launch passes it for 16-byte-aligned
    tensors and for integers divisible by 16."""
    from gdn_dispatch.backends.gluon_common.compat import arg_names

    order = arg_names(fn)
    return {(order.index(n),): [["tt.divisibility", 16]] for n in names}


def as_device(device) -> DeviceInfo:
    """A DeviceInfo from a DeviceInfo or a bare capability (its representative part)."""
    if isinstance(device, DeviceInfo):
        return device
    return assumed_device(f"sm_{device[0]}{device[1]}")


def resolve_engine(device: DeviceInfo, engine=None):
    """The matrix engine a plan is for (the kernels' ``ENGINE`` constexpr): ``engine`` as
    the launching backend passes it (``gluon_sm100.ENGINE``: tcgen05 + TMEM;
    ``gluon_sm90.ENGINE``: wgmma). None, in a dry run outside a backend, takes the engine
    of the Gluon backend registry.toml admits on ``device``; ValueError where none does."""
    if engine is not None:
        return engine
    from gdn_dispatch.registry import device_reason, load_registry

    for row in load_registry():
        if row.module.startswith("gdn_dispatch.backends.gluon_") and device_reason(row, device) is None:
            return importlib.import_module(row.module).ENGINE
    raise ValueError(f"capability: the Gluon kernels need sm_90 or sm_100/sm_103, got {device.capability}")
