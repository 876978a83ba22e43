"""A varlen call never waits for the device, with or without cu_seqlens_cpu (GPU only).

``torch.cuda.set_sync_debug_mode("error")`` turns any synchronizing CUDA call (a
device-to-host copy, ``.item()``, a blocking wait) into a RuntimeError, so a call that
passes under it enqueued its work without reading device memory back.
"""

import pytest
import torch

from gdn_dispatch import chunk_gated_delta_rule
from gdn_dispatch.testing import random_call, runnable_gpu_backends

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")]

#: The kernel backends that run on this GPU (forced one by one); the reference backend
#: walks sequences on the host by design and is not among them.
BACKENDS = runnable_gpu_backends()


def _call(layout: str, host_copy: bool, cu_dtype: torch.dtype, seed: int) -> dict:
    call = random_call(lengths=[1, 63, 0, 64, 65, 700], H=2, HV=4, K=128, V=128, dtype=torch.bfloat16,
                       device="cuda", seed=seed, state_layout=layout)
    call["cu_seqlens"] = call["cu_seqlens"].to(cu_dtype)
    if not host_copy:
        call.pop("cu_seqlens_cpu")
    return call


def _checked(call: dict, backend: str, **extra):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return chunk_gated_delta_rule(**call, output_final_state=True, backend=backend, **extra)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("backend", BACKENDS or [pytest.param(None, marks=pytest.mark.skip(
    reason="no kernel backend runs on this GPU"))])
@pytest.mark.parametrize("host_copy", [True, False], ids=["with-cu_seqlens_cpu", "device-cu_seqlens-only"])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_varlen_call_never_syncs(layout, cu_dtype, host_copy, backend, monkeypatch):
    monkeypatch.delenv("GDN_DEBUG_CHECKS", raising=False)
    # Compile outside the checked region, then a call with other inputs of the same shapes.
    chunk_gated_delta_rule(**_call(layout, host_copy, cu_dtype, seed=10), output_final_state=True, backend=backend)
    o, s = _checked(_call(layout, host_copy, cu_dtype, seed=11), backend)
    torch.cuda.synchronize()
    assert torch.isfinite(o.float()).all() and torch.isfinite(s).all()


def test_the_check_can_fail(monkeypatch):
    """Negative control: GDN_DEBUG_CHECKS=1 reads cu_seqlens back on purpose, and the sync
    debug mode catches it."""
    call = _call("kv", False, torch.int32, seed=12)
    chunk_gated_delta_rule(**call)  # compile first
    monkeypatch.setenv("GDN_DEBUG_CHECKS", "1")
    with pytest.raises(RuntimeError, match="synchroniz"):
        _checked(call, None)
