"""The ahead-of-time kernel list of a Gluon backend: every specialization it can launch."""

from __future__ import annotations

from gdn_dispatch.aot import AotKernel

from gdn_dispatch.backends.gluon_common.qk_norm import qk_norm_kernels_for_aot
from gdn_dispatch.backends.gluon_common.segment_map import segment_map_kernels_for_aot
from gdn_dispatch.backends.gluon_common.state_output import state_output_kernels_for_aot
from gdn_dispatch.backends.gluon_common.wy import wy_kernels_for_aot


def backend_kernels_for_aot(backend: str, capabilities: tuple[tuple[int, int], ...],
                            capability: tuple[int, int] | None, *, engine) -> list[AotKernel]:
    """The kernels the forward launches (wy, the qk norms, the fused state + output, and
    context parallelism's pass 1) at every specialization, for ``capability`` (default:
    the backend's first) on the backend's matrix ``engine``."""
    capability = tuple(capability or capabilities[0])
    if capability not in capabilities:
        raise ValueError(f"{backend} compiles for {capabilities}, got {capability}")
    return (wy_kernels_for_aot(capability, backend, engine=engine)
            + qk_norm_kernels_for_aot(capability, backend)
            + state_output_kernels_for_aot(capability, backend, engine=engine)
            + segment_map_kernels_for_aot(capability, backend, engine=engine))
