"""triton_generic's interpreted launches resolve their ``@jit`` callees themselves: no triton
class is patched (``JITFunction.__call__`` stays triton's own during the launch), and both
our helpers and triton's library functions (``tl.sum``) run as interpreted Python."""

from __future__ import annotations

import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from gdn_dispatch.backends.triton_generic._jit import jit

TRITON_CALL = JITFunction.__call__
SEEN_DURING_LAUNCH: list[bool] = []


def _record_jit_call():
    """Plain Python, called from inside the interpreted kernel."""
    SEEN_DURING_LAUNCH.append(JITFunction.__call__ is TRITON_CALL)
    return 0


@jit
def _twice(x):
    return x * 2


@jit
def _probe_kernel(x_ptr, y_ptr, N: tl.constexpr):
    _record_jit_call()
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(y_ptr + offs, _twice(x) + tl.sum(x, axis=0))


def test_interpreted_launch_patches_no_triton_class(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    SEEN_DURING_LAUNCH.clear()
    x = torch.arange(8, dtype=torch.float32)
    y = torch.full_like(x, float("nan"))
    _probe_kernel[(2,)](x, y, N=8)
    assert SEEN_DURING_LAUNCH == [True, True]  # one per program
    assert JITFunction.__call__ is TRITON_CALL
    torch.testing.assert_close(y, 2 * x + x.sum())
