"""gluon_sm90: the GDN chunked prefill in Triton Gluon for Hopper (sm_90a: H100 / H200):
asynchronous wgmma with register accumulators, TMA loads on mbarriers with next-chunk
prefetch; Hopper has no TMA scatter, so the rows of a sequence's last, partial chunk are
written with masked register stores (full chunks use one TMA store).

The pipeline kernels, their orchestrator and launch plans live in
:mod:`gdn_dispatch.backends.gluon_common`, shared with gluon_sm100 (tcgen05 + TMEM on
Blackwell); this package holds the Hopper matrix engine (:mod:`.engine`: wgmma with
register accumulators, masked stores for partial chunks), hands it to the kernels as
their ``ENGINE`` constexpr, and hands them the device the registry chose. It also holds
the Hopper-only warp-specialized path (:mod:`.fused`: the state held transposed in
registers as wgmma's left operand), which the shared planner takes for calls whose
(sequence, v-head) programs fill the SMs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gdn_dispatch.aot import AotKernel
from gdn_dispatch.contract import GDNProblem
from gdn_dispatch.device import DeviceInfo, default_probe

from gdn_dispatch.backends.gluon_common import call_program as _call_program
from gdn_dispatch.backends.gluon_common import forward as _forward
from gdn_dispatch.backends.gluon_common import plan as _plan
from gdn_dispatch.backends.gluon_common.aot import backend_kernels_for_aot
from gdn_dispatch.backends.gluon_common.forward import unsupported_reason  # noqa: F401  (the backend surface)
from gdn_dispatch.backends.gluon_common.qk_norm import qk_norm_kernels_for_aot
from gdn_dispatch.backends.gluon_common.wy_t import wy_t_kernels_for_aot
from gdn_dispatch.backends.gluon_sm90 import fused as _fused_path
from gdn_dispatch.backends.gluon_sm90.engine import WGMMA

if TYPE_CHECKING:
    from gdn_dispatch.registry import Selection

BACKEND = "gluon_sm90"
#: Compute capabilities this backend compiles for (registry.toml's row says the same):
#: wgmma needs the sm_90a feature set, which later parts do not carry.
CAPABILITIES = ((9, 0),)
#: The matrix engine this backend hands the shared pipeline kernels (their ``ENGINE``).
ENGINE = WGMMA
#: Its warp-specialized path (:mod:`.fused`), which the shared planner offers on this
#: engine: one kernel for the chunk inverses, the recurrence and the output (a T launch
#: first with ``fused.AUX_T`` off).
ENGINE.fused = _fused_path


def describe_launches(problem: GDNProblem, device: DeviceInfo) -> str:
    """What this backend launches for ``problem`` on ``device``, in one line (a dry run;
    ``explain`` shows it)."""
    return _forward.describe_call(problem, device, engine=ENGINE)


def forward(problem: GDNProblem, selection: Selection | None = None):
    """Run ``problem`` on Hopper (see :func:`gdn_dispatch.backends.gluon_common.forward.forward`).

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
    """Every Gluon kernel specialization of the backend, for sm_90a: the shared pipeline's
    and the warp-specialized path's (the fused kernel, and the T kernel its two-launch
    build runs, ``fused.AUX_T`` off)."""
    shared = backend_kernels_for_aot(BACKEND, CAPABILITIES, capability, engine=ENGINE)  # checks the capability
    capability = tuple(capability or CAPABILITIES[0])
    return (shared + qk_norm_kernels_for_aot(capability, BACKEND, (("qk_l2norm_fwd", torch.bfloat16),))
            + wy_t_kernels_for_aot(capability, BACKEND, engine=ENGINE, l2_on_chip=_fused_path.qk_norm_on_chip(ENGINE),
                                   head_dims=_fused_path.head_dims())
            + _fused_path.fused_kernels_for_aot(capability, BACKEND, engine=ENGINE))
