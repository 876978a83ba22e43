"""Stage 1: the gate's cumulative sum within each chunk, in log2 units.

Every later stage needs ``g_cum[t] = sum_{s <= t in t's chunk} g[s]`` (a decay from the chunk
start, inclusive); they take ``exp2`` of differences of it, so the sum is scaled by
``log2(e)`` here once. One program owns one chunk and a ``[BT, BH]`` tile of value heads:
rows of ``g`` are ``HV`` contiguous values, so the tile loads coalesced, and the scan runs
down the tile's rows.

The forward launches no kernel of this stage: the kernel that forms each chunk's T forms
the same sums for its (chunk, v-head) and stores them (``FORM_G_CUM`` of
:func:`.kkt_solve._kkt_solve_tile`). :func:`chunk_cumsum_fwd` stays as the stage on its own
(the stage-by-stage tests, and callers of the later stages).
"""

from __future__ import annotations

import torch
import triton.language as tl

from gdn_dispatch.varlen import ChunkTable

from gdn_dispatch.backends.triton_generic._jit import GATE_FLOOR, _slot_rows, jit
from gdn_dispatch.backends.triton_generic.strides import token_stride
from gdn_dispatch.backends.triton_generic.configs import cumsum_config, launch


@jit(do_not_specialize=("N",))
def _chunk_cumsum_fwd_kernel(
    g,
    g_cum,
    cu_seqlens,
    N,
    scale,
    s_g: tl.constexpr,
    HV: tl.constexpr,
    BT: tl.constexpr,
    BH: tl.constexpr,
):
    i_c, i_hb = tl.program_id(0), tl.program_id(1)
    t0, n_t = _slot_rows(cu_seqlens, i_c, N, BT)
    if n_t <= 0:  # an idle slot
        return
    o_i = tl.arange(0, BT)
    o_h = i_hb * BH + tl.arange(0, BH)
    m_g = (o_i < n_t)[:, None] & (o_h < HV)[None, :]
    b_g = tl.load(g + t0 * s_g + o_i[:, None] * s_g + o_h[None, :], mask=m_g, other=0.0).to(tl.float32)
    b_g = tl.cumsum(tl.maximum(b_g, GATE_FLOOR), axis=0) * scale
    tl.store(g_cum + t0 * HV + o_i[:, None] * HV + o_h[None, :], b_g, mask=m_g)


def chunk_cumsum_fwd(
    g: torch.Tensor,
    chunks: ChunkTable,
    *,
    scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunk-local inclusive cumulative sum of the gate, times ``scale``.

    Parameters
    ----------
    g : Tensor ``[B, T, HV]``, any float dtype, in token rows (any token stride): the
        per-token log-decay.
    chunks : ChunkTable of the call (``problem.chunks``): one program per chunk slot and
        block of heads (:mod:`gdn_dispatch.varlen`).
    scale : float, multiplies the sums; the orchestrator passes ``log2(e)`` so that later
        stages use ``exp2``.
    out : optional float32 Tensor shaped like ``g`` to write into.

    Returns
    -------
    g_cum : float32 Tensor shaped like ``g``: ``scale * sum of g over [chunk start, t]``.
        Rows of no chunk (there are none: chunks tile every sequence) are not written.
    """
    HV = g.shape[-1]
    g_cum = torch.empty(g.shape, dtype=torch.float32, device=g.device) if out is None else out
    if g.shape[0] * g.shape[1] == 0 or HV == 0:
        return g_cum
    cfg = cumsum_config(HV)
    grid = (chunks.num_slots, -(-HV // cfg.BH))  # host ceil-div (triton.cdiv is a slow constexpr function)
    launch(_chunk_cumsum_fwd_kernel, grid, cfg, **cumsum_launch_args(
        cfg, g, g_cum, chunks.cu_seqlens, chunks.num_seqs, float(scale), token_stride("g", g), HV, chunks.chunk_size))
    return g_cum


def cumsum_launch_args(cfg, g, g_cum, cu_seqlens, num_seqs, scale, s_g, HV, BT) -> dict:
    """Every argument of one ``_chunk_cumsum_fwd_kernel`` launch by name (what
    :func:`chunk_cumsum_fwd` launches with)."""
    return dict(g=g, g_cum=g_cum, cu_seqlens=cu_seqlens, N=num_seqs, scale=scale, s_g=s_g, HV=HV, BT=BT,
                BH=cfg.BH)
