"""triton_generic: the GDN chunked prefill as plain Triton kernels, for any CUDA GPU >= sm_80
(and, under TRITON_INTERPRET=1, for CPU tensors).

One module per stage of DESIGN.md, each a kernel ``_<stage>_fwd_kernel`` and its host
wrapper ``<stage>_fwd``; :mod:`.forward` chains them. The stage-1 and stage-2 wrappers are a
stable API for other backends (gluon_sm100 reuses them):

- ``chunk_cumsum_fwd(g, chunks, *, scale=1.0, out=None) -> g_cum`` (float32, g's shape)
- ``kkt_solve_fwd(k, g_cum, beta, chunks, *, use_qk_l2norm=False, out_dtype=None)
  -> A_inv`` (``[B, T, HV, 64]``, each row the row of its chunk's (I + A)^-1)

The module imports no device state; kernels compile on first launch (or ahead of time via
:func:`kernels_for_aot`).
"""

from gdn_dispatch.backends.triton_generic.aot import kernels_for_aot
from gdn_dispatch.backends.triton_generic.cumsum import chunk_cumsum_fwd
from gdn_dispatch.backends.triton_generic.forward import forward, route_runner, unsupported_reason
from gdn_dispatch.backends.triton_generic.kkt_solve import kkt_solve_fwd
from gdn_dispatch.backends.triton_generic.output import output_fwd
from gdn_dispatch.backends.triton_generic.state import state_fwd
from gdn_dispatch.backends.triton_generic.wu import wu_fwd

__all__ = [
    "chunk_cumsum_fwd",
    "forward",
    "kernels_for_aot",
    "kkt_solve_fwd",
    "output_fwd",
    "route_runner",
    "state_fwd",
    "unsupported_reason",
    "wu_fwd",
]
