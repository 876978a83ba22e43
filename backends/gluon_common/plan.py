"""The forward's launch plan: every Gluon launch of one call, computed without launching.

:func:`plan` is a dry run of :func:`gdn_dispatch.backends.gluon_common.forward.forward`: for
a validated call, the device and the matrix engine it returns the planned launches of
:mod:`.wy` (gate cumsum, T, w / u), :mod:`.qk_norm` (with the qk l2 norm only) and
:mod:`.state_output` (recurrence and output), in order. It touches no GPU and reads no
tensor data, so it is testable with CPU tensors.

Host cost: the forward calls :func:`plan` on every call, and a server calls with a new
token count (and often a new sequence count) nearly every time. So the launches are
planned once per *call class* (:func:`plan_key`: device, engine, head counts and dims,
dtype, the tail, state, pool and l2 flags; not ``B``, ``T`` or ``N``) into a
:class:`ClassPlan` (bounded LRU), whose launch plans hold no per-call integer: grids and
descriptor row counts follow from ``B * T`` and ``N`` at each launch. The one choice that
depends on ``N``, the fused kernel's V-block (:func:`.state_output.state_output_config`:
waves of ``N * HV`` programs), picks among that kernel's few configurations, all planned
with the class. A call's :func:`plan` is then a key, one cache lookup, one dict lookup by
``N`` and a small :class:`ForwardPlan` view. Cached plans are shared between calls: treat
a plan and its dicts as read-only.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field

from gdn_dispatch import routes
from gdn_dispatch.contract import GDNProblem, StateLayout
from gdn_dispatch.device import DeviceInfo, assumed_device, shared_memory_per_block

from gdn_dispatch.backends.gluon_common.launch_plan import (
    PLAN_CACHE_SIZE, BoundLaunch, LaunchPlan, LruCache, has_tails, resolve_engine)
from gdn_dispatch.backends.gluon_common.qk_norm import (
    clear_norm_plans, needs_norm_copies, plan_qk_l2norm, plan_qk_rnorm)
from gdn_dispatch.backends.gluon_common.segment_map import plan_segment_map, segment_map_supported
from gdn_dispatch.backends.gluon_common import warm_chain
from gdn_dispatch.backends.gluon_common.pick import picked_plan
from gdn_dispatch.backends.gluon_common.state_output import (
    chained_plan, plan_state_output, state_output_config, state_output_configs)
from gdn_dispatch.backends.gluon_common.wy import plan_wy
from gdn_dispatch.backends.gluon_common.wy_t import plan_wy_t


#: The launches whose rows are (token, head) rows of q and k.
NORM_KERNELS = frozenset({"qk_rnorm_fwd", "qk_l2norm_fwd"})


class ForwardPlan:
    """Every Gluon launch of one call, in order ([qk_l2norm with the qk l2 norm in fp16,]
    wy, [qk_rnorm with the qk l2 norm in bf16,] state_output), for one device and engine: the call class's shared launch plans
    (``launches``) with the call's token rows ``rows = B * T`` and sequence count
    ``num_seqs`` (``stages``: :class:`~.launch_plan.BoundLaunch` views, as a dry run shows them).
    """

    __slots__ = ("cls", "launches", "rows", "num_seqs", "_stages")

    def __init__(self, cls: ClassPlan, launches: tuple[LaunchPlan, ...], rows: int, num_seqs: int):
        self.cls, self.launches, self.rows, self.num_seqs = cls, launches, rows, num_seqs
        # Each stage bound once: a class plan keeps its ForwardPlans per counts, so a call
        # whose counts recur finds its stages here.
        self._stages: dict[str, BoundLaunch] = {}

    @property
    def capability(self) -> tuple[int, int]:
        return self.cls.capability

    @property
    def is_sm100(self) -> bool:
        return self.cls.is_sm100

    @property
    def state_layout(self) -> StateLayout:
        return self.cls.state_layout

    @property
    def has_tails(self) -> bool:
        return self.cls.has_tails

    @property
    def fused(self) -> bool:
        """Whether the call runs the warp-specialized path (wy_t_fwd, fused_fwd; the fused
        kernel alone where it forms the inverses itself, :attr:`inverses_on_chip`)."""
        return self.launches[-1].kernel == "fused_fwd"

    @property
    def inverses_on_chip(self) -> bool:
        """Whether the path's fused kernel forms the chunk inverses itself (no wy_t_fwd
        launch: :data:`gdn_dispatch.backends.gluon_sm90.fused.AUX_T`)."""
        return self.fused and all(launch.kernel != "wy_t_fwd" for launch in self.launches)

    @property
    def norm_copies(self) -> bool:
        """Whether the call runs on normalized copies of q and k (qk_l2norm_fwd first: the
        warp-specialized path's, and every fp16 call's with the qk l2 norm) rather than
        folding the qk l2 norm into its kernels (or running without it)."""
        return self.launches[0].kernel == "qk_l2norm_fwd"

    @property
    def stages(self) -> tuple[BoundLaunch, ...]:
        return tuple(self._bind(launch) for launch in self.launches)

    def _bind(self, launch: LaunchPlan) -> BoundLaunch:
        # The norm kernels count (token, head) rows; the others token rows.
        rows = self.rows * self.cls.H if launch.kernel in NORM_KERNELS else self.rows
        return launch.bind(rows, self.num_seqs)

    def stage(self, kernel: str) -> BoundLaunch:
        bound = self._stages.get(kernel)
        if bound is None:
            bound = self._stages[kernel] = self._bind(next(s for s in self.launches if s.kernel == kernel))
        return bound

    def __eq__(self, other):
        if not isinstance(other, ForwardPlan):
            return NotImplemented
        return (self.cls.flags, self.launches, self.rows, self.num_seqs) == \
            (other.cls.flags, other.launches, other.rows, other.num_seqs)

    def __hash__(self):
        return hash((self.rows, self.num_seqs, tuple(s.kernel for s in self.launches)))

    def __repr__(self):
        return f"ForwardPlan(rows={self.rows}, num_seqs={self.num_seqs}, stages={self.stages})"


@dataclass(frozen=True, eq=False)
class ClassPlan:
    """The launch plans of one call class (:func:`plan_key`), shared by its calls.

    Attributes
    ----------
    capability, is_sm100, state_layout, has_tails : the class's device, engine and flags.
    H, HV, K, V, elem : head counts, head dims and q's element size in bytes.
    sm_count, smem_per_block : the device figures the fused kernel's V-block is chosen on.
    front : the launches before the fused kernel (wy, and the norms with the qk l2 norm:
        the reciprocal norms after wy, or the normalized copies before it for fp16).
    state_outputs : the fused kernel's plan per configuration (BV, warps) it may run in.
    fused : the warp-specialized path's launches (wy_t, fused) where the engine offers one
        and the class can run it (``engine.fused.fused_reason``), else None.
    fused_min_programs : the ``N * HV`` from which a call takes ``fused``
        (``engine.fused.MIN_SM_SHARE`` of the SMs).
    segment_map : context parallelism's pass 1 (:mod:`.segment_map`), for the class's
        segmented calls; its grid follows from their segment slot count (None for head
        dims the kernel is not built for: dry runs outside the backends' own).
    segment_map_chain : the same for chained segments (``CHAIN``: N's blocks alone).
    """

    capability: tuple[int, int]
    is_sm100: bool
    state_layout: StateLayout
    has_tails: bool
    H: int
    HV: int
    K: int
    V: int
    elem: int
    sm_count: int
    smem_per_block: int
    front: tuple[LaunchPlan, ...]
    state_outputs: dict
    fused: tuple[LaunchPlan, ...] | None = None
    fused_min_programs: int = 0
    segment_map: LaunchPlan | None = None
    segment_map_chain: LaunchPlan | None = None
    #: ForwardPlans by (B * T, N, fused allowed), filled on use (bounded by COUNTS_KEPT).
    by_counts: dict = field(default_factory=dict, repr=False)
    #: The class's output allocators by form (the forward's ``call_buffers``), made on use.
    allocators: dict = field(default_factory=dict, repr=False)
    #: The class's native call programs by launch sequence and initial-state presence
    #: (:mod:`.call_program`), made on use.
    programs: dict = field(default_factory=dict, repr=False)
    #: The call class of a segmented call's pass 2 by whether a segment ends inside a
    #: chunk (``forward.segment_launches``), made on use.
    segment_classes: dict = field(default_factory=dict, repr=False)
    #: Chained segments' (pass 1, pass 2) by the fused kernel's configuration
    #: (:meth:`chained`), and the warm chain's launches (:meth:`warm_chain`), made on use.
    chain_plans: dict = field(default_factory=dict, repr=False)

    @property
    def flags(self) -> tuple:
        return (self.capability, self.is_sm100, self.state_layout, self.has_tails)

    def launches_for(self, num_seqs: int, fused: bool = True, busy_seqs: int | None = None) -> tuple[LaunchPlan, ...]:
        """The launches of a call of ``num_seqs`` sequences: the warp-specialized path
        where the class has one, ``fused`` allows it and the call's programs fill the SMs
        (:attr:`fused_min_programs`); else the front, then the fused kernel in the
        configuration :func:`.state_output.state_output_config` picks for the ``busy_seqs``
        sequences that hold tokens (None: all ``num_seqs``; a program of an empty one
        exits at once, so it takes no place in a wave)."""
        if fused and self.fused is not None and num_seqs * self.HV >= self.fused_min_programs:
            return self.fused
        busy = num_seqs if busy_seqs is None else busy_seqs
        config = state_output_config(self.K, self.V, busy * self.HV, self.sm_count, self.elem,
                                     smem_per_block=self.smem_per_block)
        return (*self.front, self.state_outputs[config])

    def chained(self, state_output: LaunchPlan) -> tuple[LaunchPlan, LaunchPlan]:
        """(pass 1, pass 2) of a chained call (:mod:`.segment_chain`) whose unsegmented
        fused kernel would run in ``state_output`` (one of :attr:`state_outputs`): pass 1
        with N's programs alone (``CHAIN``); pass 2 the same kernel in the same
        configuration, over the segment slots (the launch's ``num_seqs``), ``CHAIN`` on."""
        got = self.chain_plans.get(id(state_output))
        if got is None:
            got = self.chain_plans[id(state_output)] = (self.segment_map_chain, chained_plan(state_output))
        return got

    def warm_chain(self, rows: int, num_segments: int) -> ForwardPlan | None:
        """A chained call's launches on the class's one-kernel build (:mod:`.warm_chain`):
        the path's launches with its fused kernel over the ``num_segments`` segment slots
        (``CHAIN``), for ``rows = B * T`` tokens; None where the class has no one-kernel
        build (its chained calls run the pipeline's passes, :meth:`chained`) or
        :data:`.warm_chain.WARM_CHAIN` is off."""
        if not warm_chain.WARM_CHAIN or self.fused is None or self.fused[-1].constexprs.get("AUX_T") is not True:
            return None
        launches = self.chain_plans.get(WARM_KEY)
        if launches is None:
            launches = self.chain_plans[WARM_KEY] = (*self.fused[:-1], warm_chain.warm_chain_plan(self.fused[-1]))
        return ForwardPlan(self, launches, rows, num_segments)

    def picked(self, rows: int, num_seqs: int, num_segments: int) -> tuple[ForwardPlan, ForwardPlan] | None:
        """A picked call's launches (:mod:`.pick`, ``CPPlan.picked``): the warm chain's
        (:meth:`warm_chain`, the census before its fused kernel) and the unsegmented
        pipeline's, every one ``PICK`` but the qk l2 norm's normalized copies, which both
        read (run once). None where the class has no warm chain, or where its unsegmented
        call takes the warp-specialized path or reads other copies than the chain: then
        there is no pipeline to pick, and the call runs "off"."""
        warm = self.warm_chain(rows, num_segments)
        off = self.for_call(rows, num_seqs)
        if warm is None or off.fused or warm.norm_copies != off.norm_copies:
            return None
        key = (PICK_KEY, id(off.launches[-1]))
        got = self.chain_plans.get(key)
        if got is None:
            fused = warm.launches[-1]
            census = warm_chain.census_plan(self.K, self.HV, fused.constexprs["QK_NORM"])
            got = self.chain_plans[key] = (
                (*warm.launches[:-1], census, picked_plan(fused)),
                tuple(s if s.kernel == "qk_l2norm_fwd" else picked_plan(s) for s in off.launches))
        return ForwardPlan(self, got[0], rows, num_segments), ForwardPlan(self, got[1], rows, num_seqs)

    def for_call(self, rows: int, num_seqs: int, fused: bool = True, busy_seqs: int | None = None) -> ForwardPlan:
        """The ForwardPlan of a call of ``rows = B * T`` tokens in ``num_seqs`` sequences,
        ``busy_seqs`` of them holding tokens where the host knows it (memoized per counts,
        bounded: calls with the same counts get the same object); ``fused=False`` keeps it
        on the two-launch pipeline (context parallelism's passes)."""
        counts = (rows, num_seqs, fused, busy_seqs)
        fp = self.by_counts.get(counts)
        if fp is None:
            if len(self.by_counts) >= COUNTS_KEPT:
                self.by_counts.clear()
            fp = self.by_counts[counts] = ForwardPlan(self, self.launches_for(num_seqs, fused, busy_seqs), rows,
                                                      num_seqs)
        return fp


#: The key of a class's warm-chain launches in its ``chain_plans``; with the state
#: kernel's plan, of its picked launches.
WARM_KEY = "warm"
PICK_KEY = "pick"

#: (B * T, N) pairs a ClassPlan keeps the ForwardPlan of (one dict lookup per call; a
#: server's counts vary, so the dict is emptied when it fills).
COUNTS_KEPT = 4096


def plan_key(problem: GDNProblem, device: DeviceInfo, engine) -> tuple:
    """Everything the stage planners read from a call, a device and the engine, as a
    hashable key: the call class.

    Head counts and dims, dtype, the tail flag, the state, state-pool, write-back and
    l2-norm flags, the state layout, the compute capability, the SM count, the shared
    memory per block and the engine. Not ``B``, ``T`` or ``N``: grids and descriptor rows
    follow from ``B * T`` and ``N`` at each launch, and the fused kernel's configuration from
    ``N`` by a lookup (:meth:`ClassPlan.launches_for`). Tensor values are not in it either
    (the tail flag of a varlen call comes from its host copy of the offsets, when it has
    one). A stage planner that starts reading another attribute of the problem or device
    must add it.
    """
    q, v = problem.q.shape, problem.v.shape
    return (device.capability, device.sm_count, device.smem_optin, engine, q[2], q[3], v[2], v[3],
            problem.q.dtype, has_tails(problem), problem.initial_state is not None, problem.output_final_state,
            problem.state_layout, problem.use_qk_l2norm, problem.state_indices is not None,
            problem.inplace_final_state)


_PLANS = LruCache(PLAN_CACHE_SIZE)
#: How the class-plan cache answered: "computed" counts :func:`compute_class_plan` calls
#: (one per call class while it stays cached), "hits" the calls that found their class.
PLAN_COUNTS: Counter = Counter()


def clear_plan_cache() -> None:
    """Forget every memoized plan (the class plans, and the norm kernels' plans, which the
    forward shares with callers outside it, and the routes that lead to them) and reset
    :data:`PLAN_COUNTS` (tests, benchmarks
    that start afresh, or after editing a planner in a live session)."""
    _PLANS.clear()
    PLAN_COUNTS.clear()
    clear_norm_plans()
    routes.clear()  # a route holds its class plan


def plan(problem: GDNProblem, capability: tuple[int, int] | None = None, device: DeviceInfo | None = None,
         *, engine=None, fused: bool = True, busy_seqs: int | None = None) -> ForwardPlan:
    """Dry run of the Gluon forward for ``problem``.

    The launch plans are memoized per call class (:func:`plan_key`): every call of a class
    gets the same shared plans (read-only), equal to what :func:`compute_plan` returns.

    Parameters
    ----------
    problem : a validated call (its tensors may live on the CPU; none is read).
    capability : compute capability to plan for (a dry run); default ``device``'s.
    device : DeviceInfo the launches are sized for (SM count, shared memory). Default: the
        representative part of ``capability`` (gdn_dispatch.device.assumed_device), else
        the probed device of the problem's tensors. The forward passes the registry's.
    engine : the matrix engine, as the launching backend passes it (its ``ENGINE``);
        None takes the one registry.toml's Gluon row admits on the device (dry runs).
    fused : allow the engine's warp-specialized path (False: the two-launch pipeline).
    busy_seqs : how many of the call's sequences hold tokens, where the host knows it
        (context parallelism's pass 2: the segment slots with tokens,
        ``ChunkTable.nonempty_seqs`` of its segment table); None: all of them. The fused kernel's
        V-block is chosen on these.

    Returns
    -------
    ForwardPlan with the forward's Gluon launches, in order, for this call's ``B * T`` and
    ``N``: [qk_l2norm_fwd,] wy_fwd, [qk_rnorm_fwd,] state_output_fwd; or [qk_l2norm_fwd,] wy_t_fwd, fused_fwd
    (the norm kernel absent where the path's kernels reduce the norms themselves, the T
    kernel where the fused kernel forms the inverses: ``gluon_sm90.fused.AUX_T``).
    """
    if device is None:
        if capability is not None:
            device = assumed_device(f"sm_{capability[0]}{capability[1]}")
        else:
            from gdn_dispatch.device import default_probe

            device = default_probe().for_torch_device(problem.device)
    if capability is not None and tuple(capability) != tuple(device.capability):
        device = DeviceInfo(kind="cuda", index=device.index, name=device.name, capability=tuple(capability),
                            sm_count=device.sm_count, smem_optin=device.smem_optin)
    if engine is None:
        engine = resolve_engine(device)
    key = plan_key(problem, device, engine)
    cls = _PLANS.get(key)
    if cls is None:
        cls = _PLANS.put(key, compute_class_plan(problem, device, engine=engine))
    else:
        PLAN_COUNTS["hits"] += 1
    q = problem.q.shape
    return cls.for_call(q[0] * q[1], problem.chunks.num_seqs, fused, busy_seqs)


def compute_class_plan(problem: GDNProblem, device: DeviceInfo, *, engine=None) -> ClassPlan:
    """The launch plans of ``problem``'s call class for ``device`` and the engine (no cache):
    wy, the norms with the qk l2 norm, the fused kernel in every configuration it may run
    in, and context parallelism's pass 1."""
    PLAN_COUNTS["computed"] += 1
    engine = resolve_engine(device, engine)
    # With the qk l2 norm, q's and k's row norms are reduced once before the fused kernel;
    # fp16 calls run on normalized copies instead (qk_l2norm_fwd first, every later stage
    # seeing a call without the norm: :func:`.qk_norm.needs_norm_copies`).
    copies = needs_norm_copies(problem)
    # What the pipeline's stages and context parallelism's pass 1 are planned for (the
    # warp-specialized path below plans its own).
    staged = dataclasses.replace(problem, use_qk_l2norm=False) if copies else problem
    front = [plan_wy(staged, device, engine=engine).shared]
    if copies:
        front.insert(0, plan_qk_l2norm(problem, device, engine=engine).shared)
    elif problem.use_qk_l2norm:
        front.append(plan_qk_rnorm(problem, device, engine=engine).shared)
    elem = problem.q.element_size()
    state_outputs = {config: plan_state_output(staged, device, block_v=config[0], num_warps=config[1],
                                               engine=engine).shared
                     for config in state_output_configs(problem.K, problem.V)}
    fused, fused_min_programs = None, 0
    fused_path = getattr(engine, "fused", None)
    if fused_path is not None and fused_path.fused_reason(problem) is None:
        # With the qk l2 norm the path runs on normalized copies of q and k (qk_l2norm_fwd
        # first), its two kernels seeing a call without the norm, unless its kernels fold
        # the norm in themselves (the engine's norm_on_chip; never for fp16).
        on_chip = getattr(fused_path, "norm_on_chip", None)
        on_chip = on_chip is not None and not copies and on_chip(problem, engine)
        plain = dataclasses.replace(problem, use_qk_l2norm=False) if problem.use_qk_l2norm and not on_chip else problem
        fused_kernel = fused_path.plan_fused(plain, device, engine=engine).shared
        # The T kernel first, unless the fused kernel forms the inverses itself.
        fused = (fused_kernel,) if fused_kernel.constexprs.get("AUX_T") else (
            plan_wy_t(plain, device, engine=engine).shared, fused_kernel)
        if problem.use_qk_l2norm and not on_chip:
            fused = (plan_qk_l2norm(problem, device, engine=engine).shared, *fused)
        fused_min_programs = math.ceil(fused_path.MIN_SM_SHARE * device.sm_count)
    return ClassPlan(capability=tuple(device.capability), is_sm100=engine.is_sm100,
                     state_layout=problem.state_layout, has_tails=has_tails(problem), H=problem.H, HV=problem.HV,
                     K=problem.K, V=problem.V, elem=elem, sm_count=device.sm_count,
                     smem_per_block=shared_memory_per_block(device), front=tuple(front),
                     state_outputs=state_outputs, fused=fused, fused_min_programs=fused_min_programs,
                     **_segment_maps(staged, device, engine))


def _segment_maps(problem: GDNProblem, device: DeviceInfo, engine) -> dict:
    """The class's pass-1 plans, mapped and chained (none for head dims the kernel is not
    built for)."""
    if not segment_map_supported(problem.K, problem.V):
        return {}
    return dict(segment_map=plan_segment_map(problem, device, engine=engine),
                segment_map_chain=plan_segment_map(problem, device, engine=engine, chain=True))


def compute_plan(problem: GDNProblem, device: DeviceInfo, *, engine=None, fused: bool = True) -> ForwardPlan:
    """:func:`plan` without the cache: the call class planned anew, seen with ``problem``'s counts."""
    q = problem.q.shape
    return compute_class_plan(problem, device, engine=engine).for_call(q[0] * q[1], problem.chunks.num_seqs, fused)
