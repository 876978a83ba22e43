"""The forward's launch plan: every Gluon launch of one call, computed without launching.

:func:`plan` is a dry run of :func:`gdn_dispatch.backends.gluon_common.forward.forward`: for
a validated call, the device and the matrix engine it returns the planned launches of
:mod:`.wy` (gate cumsum, T, w / u), :mod:`.qk_norm` (with the qk l2 norm only) and
:mod:`.state_output` (recurrence and output), in order, each a
:class:`~.launch_plan.LaunchPlan`. It touches no GPU and reads no tensor data, so it is
testable with CPU tensors.

Host cost: the forward calls :func:`plan` on every call, so plans are memoized per
:func:`plan_key` (bounded LRU). Cached plans are shared between calls: treat a plan and its
dicts as read-only.
"""

from __future__ import annotations

from dataclasses import dataclass

from gdn_dispatch.contract import GDNProblem, StateLayout
from gdn_dispatch.device import DeviceInfo, assumed_device

from gdn_dispatch.backends.gluon_common.launch_plan import (
    PLAN_CACHE_SIZE, LaunchPlan, LruCache, has_tails, resolve_engine)
from gdn_dispatch.backends.gluon_common.qk_norm import plan_qk_rnorm
from gdn_dispatch.backends.gluon_common.state_output import plan_state_output
from gdn_dispatch.backends.gluon_common.wy import plan_wy


@dataclass(frozen=True)
class ForwardPlan:
    """Every Gluon launch of one call, in order (wy, [qk_rnorm with the qk l2 norm,]
    state_output), for one device and engine."""

    capability: tuple[int, int]
    is_sm100: bool
    state_layout: StateLayout
    has_tails: bool
    stages: tuple[LaunchPlan, ...]

    def stage(self, kernel: str) -> LaunchPlan:
        return next(s for s in self.stages if s.kernel == kernel)


def plan_key(problem: GDNProblem, device: DeviceInfo, engine) -> tuple:
    """Everything the stage planners read from a call, a device and the engine, as a
    hashable key.

    Shapes, dtype, the sequence count, the tail flag, the state, state-pool,
    write-back and l2-norm flags, the compute capability, the SM count, the shared memory
    per block and the engine.
    Tensor values (cu_seqlens' lengths included) are not in it: plans read none (the w/u
    kernel's chunk count follows from ``B * T``, ``N`` and the tail flag; the tail flag of
    a varlen call from its host copy of the offsets, when it has one). A stage planner that
    starts reading another attribute of the problem or device must add it.
    """
    return (tuple(device.capability), device.sm_count, device.smem_optin, engine, tuple(problem.q.shape),
            tuple(problem.v.shape), problem.dtype, problem.N, has_tails(problem),
            problem.initial_state is not None, problem.output_final_state, problem.state_layout,
            problem.use_qk_l2norm, problem.uses_state_pool, problem.inplace_final_state)


_PLANS = LruCache(PLAN_CACHE_SIZE)


def clear_plan_cache() -> None:
    """Forget every memoized plan (tests, or after editing a planner in a live session)."""
    _PLANS.clear()


def plan(problem: GDNProblem, capability: tuple[int, int] | None = None, device: DeviceInfo | None = None,
         *, engine=None) -> ForwardPlan:
    """Dry run of the Gluon forward for ``problem``.

    Memoized per :func:`plan_key`: a call with the same key gets the same ForwardPlan
    object, equal to what :func:`compute_plan` would return (read-only: it is shared).

    Parameters
    ----------
    problem : a validated call (its tensors may live on the CPU; none is read).
    capability : compute capability to plan for (a dry run); default ``device``'s.
    device : DeviceInfo the launches are sized for (SM count, shared memory). Default: the
        representative part of ``capability`` (gdn_dispatch.device.assumed_device), else
        the probed device of the problem's tensors. The forward passes the registry's.
    engine : the matrix engine, as the launching backend passes it (its ``ENGINE``);
        None takes the one registry.toml's Gluon row admits on the device (dry runs).

    Returns
    -------
    ForwardPlan with the forward's Gluon launches (wy_fwd, [qk_rnorm_fwd,]
    state_output_fwd), in order.
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
    engine = resolve_engine(device, engine)
    key = plan_key(problem, device, engine)
    cached = _PLANS.get(key)
    if cached is not None:
        return cached
    return _PLANS.put(key, compute_plan(problem, device, engine=engine))


def compute_plan(problem: GDNProblem, device: DeviceInfo, *, engine=None) -> ForwardPlan:
    """:func:`plan` without the cache: every stage planned for ``device`` and the engine."""
    engine = resolve_engine(device, engine)
    # With the qk l2 norm, q's and k's row norms are reduced once before the fused kernel.
    planners = (plan_wy, plan_qk_rnorm, plan_state_output) if problem.use_qk_l2norm else (plan_wy, plan_state_output)
    stages = [planner(problem, device, engine=engine) for planner in planners]
    return ForwardPlan(capability=tuple(device.capability), is_sm100=engine.is_sm100, state_layout=problem.state_layout,
                       has_tails=has_tails(problem), stages=tuple(stages))
