"""gluon_sm100: the GDN chunked prefill in Triton Gluon for datacenter Blackwell (sm_100 /
sm_103): tcgen05 MMAs into TMEM accumulators, TMA loads on mbarriers with next-chunk
prefetch, TMA scatter (row 0x7FFFFFFF) for rows past a varlen sequence's end.

The pipeline kernels, their orchestrator and launch plans live in
:mod:`gdn_dispatch.backends.gluon_common`, shared with gluon_sm90 (wgmma on Hopper); this
package holds the Blackwell matrix engine (:mod:`.engine`: tcgen05 MMAs, TMEM
accumulators, the TMA scatter store), hands it to the kernels as their ``ENGINE``
constexpr, and hands them the device the registry chose. :mod:`.fused` is the twin of
gluon_sm90's warp-specialized kernel, compiled and checked ahead of time only: ``ENGINE``
offers no fused path, so no call takes it until it has run on a Blackwell GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gdn_dispatch.aot import AotKernel
from gdn_dispatch.contract import GDNProblem
from gdn_dispatch.device import DeviceInfo, default_probe

from gdn_dispatch.backends.gluon_common import call_program as _call_program
from gdn_dispatch.backends.gluon_common import forward as _forward
from gdn_dispatch.backends.gluon_common import plan as _plan
from gdn_dispatch.backends.gluon_common.aot import backend_kernels_for_aot
from gdn_dispatch.backends.gluon_common.forward import unsupported_reason  # noqa: F401  (the backend surface)
from gdn_dispatch.backends.gluon_sm100.engine import TCGEN05

if TYPE_CHECKING:
    from gdn_dispatch.registry import Selection

BACKEND = "gluon_sm100"
#: Compute capabilities this backend compiles for (registry.toml's row says the same).
CAPABILITIES = ((10, 0), (10, 3))
#: The matrix engine this backend hands the shared pipeline kernels (their ``ENGINE``).
ENGINE = TCGEN05


def describe_launches(problem: GDNProblem, device: DeviceInfo) -> str:
    """What this backend launches for ``problem`` on ``device``, in one line (a dry run;
    ``explain`` shows it)."""
    return _forward.describe_call(problem, device, engine=ENGINE)


def forward(problem: GDNProblem, selection: Selection | None = None):
    """Run ``problem`` on Blackwell (see :func:`gdn_dispatch.backends.gluon_common.forward.forward`).

    ``selection`` is the registry's choice (its ``device`` sizes the launches); None probes
    the tensors' device once.
    """
    device = selection.device if selection is not None else default_probe().for_torch_device(problem.device)
    return _forward.forward(problem, device, engine=ENGINE)


def route_runner(problem: GDNProblem, selection: Selection):
    """The runner :mod:`gdn_dispatch.routes` keeps for calls of ``problem``'s form, or None
    (:func:`gdn_dispatch.backends.gluon_common.call_program.route_runner`)."""
    return _call_program.route_runner(problem, selection.device, ENGINE)


def plan(problem: GDNProblem, capability: tuple[int, int] = CAPABILITIES[0],
         device: DeviceInfo | None = None) -> _plan.ForwardPlan:
    """Dry run: every launch (grid, blocks, descriptors) ``forward`` would make on ``capability``."""
    return _plan.plan(problem, capability, device, engine=ENGINE)


def kernels_for_aot(capability: tuple[int, int] | None = None) -> list[AotKernel]:
    """Every Gluon kernel specialization of the backend, for ``capability`` (default sm_100)."""
    return backend_kernels_for_aot(BACKEND, CAPABILITIES, capability, engine=ENGINE)
