"""With cu_seqlens_cpu given, a call never waits for the device (GPU only)."""

import pytest
import torch

from gdn_dispatch import chunk_gated_delta_rule
from gdn_dispatch.contract import make_problem
from gdn_dispatch.device import default_probe
from gdn_dispatch.registry import select
from gdn_dispatch.testing import random_call

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")]
#: Backends with a device-specific path to check besides the selected one.
GLUON = {"gluon_sm90": ((9, 0),), "gluon_sm100": ((10, 0), (10, 3))}


def _kernel_backend(call) -> str:
    device = default_probe().for_torch_device(call["q"].device)
    return select(device, make_problem(**call)).spec.name


@pytest.mark.parametrize("backend", [None, *GLUON], ids=["selected", *GLUON])
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_varlen_call_with_host_offsets_never_syncs(layout, backend):
    call = random_call(lengths=[1, 63, 0, 64, 65, 700], H=2, HV=4, K=64, V=64, dtype=torch.bfloat16,
                       device="cuda", seed=11, state_layout=layout)
    if backend is None and _kernel_backend(call) == "reference":
        pytest.skip("the reference backend walks sequences on the host by design")
    if backend is not None and torch.cuda.get_device_capability() not in GLUON[backend]:
        pytest.skip(f"{backend} does not run on this GPU")
    chunk_gated_delta_rule(**call, output_final_state=True, backend=backend)  # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        o, s = chunk_gated_delta_rule(**call, output_final_state=True, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(o.float()).all() and torch.isfinite(s).all()


def test_call_without_host_offsets_does_sync():
    """The check above can fail: without cu_seqlens_cpu the offsets are read back once."""
    call = random_call(lengths=[5, 70], H=1, HV=1, K=64, V=64, dtype=torch.bfloat16, device="cuda", seed=12)
    call.pop("cu_seqlens_cpu")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            chunk_gated_delta_rule(**call)
    finally:
        torch.cuda.set_sync_debug_mode("default")
