"""The token stride each kernel is given for an input: inputs arrive in token rows (each
token's heads one contiguous run, any distance between tokens; see
:func:`gdn_dispatch.contract.token_rows_stride`), so views split out of a fused projection
are read in place."""

from __future__ import annotations

import torch

from gdn_dispatch.contract import token_rows_stride


def token_stride(name: str, t: torch.Tensor) -> int:
    """Elements between consecutive tokens of ``t`` ``[B, T, heads(, dim)]``."""
    stride = token_rows_stride(t)
    if stride is None:
        raise ValueError(f"{name}: expected token rows (heads packed, batch rows T tokens apart), "
                         f"got shape {tuple(t.shape)} with strides {tuple(t.stride())}")
    return stride
