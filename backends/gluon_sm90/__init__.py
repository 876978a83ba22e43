"""gluon_sm90: the GDN chunked prefill in Triton Gluon for Hopper (sm_90a: H100 / H200):
asynchronous wgmma with register accumulators, TMA loads on mbarriers with next-chunk
prefetch; Hopper has no TMA scatter, so the rows of a sequence's last, partial chunk are
written with masked register stores (full chunks use one TMA store).

A thin package: the kernels, the orchestrator and the launch plans live in
:mod:`gdn_dispatch.backends.gluon_common` and are shared with gluon_sm100 (tcgen05 + TMEM on Blackwell);
this package binds them to the Hopper matrix engine and names its capability.
"""

from __future__ import annotations

from gdn_dispatch.aot import AotKernel
from gdn_dispatch.contract import GDNProblem
from gdn_dispatch.device import DeviceInfo

# One orchestrator for both Gluon backends: it reads the matrix engine off the device.
from gdn_dispatch.backends.gluon_common.forward import forward, unsupported_reason  # noqa: F401  (the backend surface)
from gdn_dispatch.backends.gluon_common import plan as _plan
from gdn_dispatch.backends.gluon_common.aot import backend_kernels_for_aot

BACKEND = "gluon_sm90"
#: Compute capabilities this backend compiles for (registry.toml's row says the same):
#: wgmma needs the sm_90a feature set, which later parts do not carry.
CAPABILITIES = ((9, 0),)


def plan(problem: GDNProblem, capability: tuple[int, int] = CAPABILITIES[0],
         device: DeviceInfo | None = None) -> _plan.ForwardPlan:
    """Dry run: every launch (grid, blocks, descriptors) ``forward`` would make on ``capability``."""
    return _plan.plan(problem, capability, device)


def kernels_for_aot(capability: tuple[int, int] | None = None) -> list[AotKernel]:
    """Every Gluon kernel specialization of the backend, for sm_90a."""
    return backend_kernels_for_aot(BACKEND, CAPABILITIES, capability)
