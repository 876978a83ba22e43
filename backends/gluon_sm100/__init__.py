"""gluon_sm100: the GDN chunked prefill in Triton Gluon for datacenter Blackwell (sm_100 /
sm_103): tcgen05 MMAs into TMEM accumulators, TMA loads on mbarriers with next-chunk
prefetch, TMA scatter (row 0x7FFFFFFF) for rows past a varlen sequence's end.

A thin package: the kernels, the orchestrator and the launch plans live in
:mod:`gdn_dispatch.backends.gluon_common` and are shared with gluon_sm90 (wgmma on Hopper); this package
binds them to the Blackwell matrix engine and names its capabilities.
"""

from __future__ import annotations

from gdn_dispatch.aot import AotKernel
from gdn_dispatch.contract import GDNProblem
from gdn_dispatch.device import DeviceInfo

# One orchestrator for both Gluon backends: it reads the matrix engine off the device.
from gdn_dispatch.backends.gluon_common.forward import forward, unsupported_reason  # noqa: F401  (the backend surface)
from gdn_dispatch.backends.gluon_common import plan as _plan
from gdn_dispatch.backends.gluon_common.aot import backend_kernels_for_aot

BACKEND = "gluon_sm100"
#: Compute capabilities this backend compiles for (registry.toml's row says the same).
CAPABILITIES = ((10, 0), (10, 3))


def plan(problem: GDNProblem, capability: tuple[int, int] = CAPABILITIES[0],
         device: DeviceInfo | None = None) -> _plan.ForwardPlan:
    """Dry run: every launch (grid, blocks, descriptors) ``forward`` would make on ``capability``."""
    return _plan.plan(problem, capability, device)


def kernels_for_aot(capability: tuple[int, int] | None = None) -> list[AotKernel]:
    """Every Gluon kernel specialization of the backend, for ``capability`` (default sm_100)."""
    return backend_kernels_for_aot(BACKEND, CAPABILITIES, capability)
