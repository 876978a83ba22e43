"""Calls on a device other than the current one, and on two devices at once.

Every backend must run on the device that holds the tensors, whatever device is current,
and leave the current device as it found it. Two threads calling on two devices at once,
each device routed to its own backend by a per-device ``GDN_BACKEND`` map, get what each
would get alone. Needs two CUDA GPUs (``pytest -m gpu tests/test_multi_gpu.py``).
"""

from __future__ import annotations

import threading

import pytest
import torch

from gdn_dispatch import chunk_gated_delta_rule
from gdn_dispatch.testing import random_call

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA GPUs")]


def _backends() -> list[str]:
    if not TWO_GPUS:
        return ["triton_generic"]
    names = ["triton_generic", "reference"]
    cap = torch.cuda.get_device_capability(1)
    if cap == (9, 0):
        names.append("gluon_sm90")
    if cap in ((10, 0), (10, 3)):
        names.append("gluon_sm100")
    return names


def _call(device: str, seed: int = 0) -> dict:
    return random_call(lengths=[1, 63, 65, 130, 0, 300], H=2, HV=4, K=128, V=64 if seed % 2 else 128,
                       dtype=torch.bfloat16, device=device, seed=seed)


def _run(call: dict, backend: str):
    return chunk_gated_delta_rule(**call, output_final_state=True, backend=backend)


@pytest.mark.parametrize("backend", _backends())
def test_tensors_on_cuda1_while_cuda0_is_current(backend, monkeypatch):
    monkeypatch.delenv("GDN_BACKEND", raising=False)
    torch.cuda.set_device(0)
    o1, ht1 = _run(_call("cuda:1"), backend)
    assert torch.cuda.current_device() == 0, "the call changed the current device"
    assert o1.device == torch.device("cuda:1") and ht1.device == torch.device("cuda:1")
    o0, ht0 = _run(_call("cuda:0"), backend)
    torch.testing.assert_close(o1.cpu(), o0.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(ht1.cpu(), ht0.cpu(), rtol=0, atol=0)


def test_two_threads_on_two_devices_with_a_per_device_map(monkeypatch):
    second = "gluon_sm90" if torch.cuda.get_device_capability(1) == (9, 0) else "triton_generic"
    monkeypatch.setenv("GDN_BACKEND", f"cuda:0=triton_generic,cuda:1={second}")
    torch.cuda.set_device(0)
    calls = {d: [_call(f"cuda:{d}", seed=s) for s in range(6)] for d in (0, 1)}
    alone = {d: [chunk_gated_delta_rule(**c, output_final_state=True) for c in calls[d]] for d in (0, 1)}
    for d in (0, 1):
        torch.cuda.synchronize(d)
    together: dict[int, list] = {}
    failures: list[BaseException] = []

    def worker(d: int) -> None:
        try:
            together[d] = [chunk_gated_delta_rule(**c, output_final_state=True) for _ in range(5) for c in calls[d]]
            torch.cuda.synchronize(d)
        except BaseException as exc:  # re-raised in the main thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(d,)) for d in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    for d in (0, 1):
        for i, (o, ht) in enumerate(together[d]):
            o_ref, ht_ref = alone[d][i % len(calls[d])]
            torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
            torch.testing.assert_close(ht, ht_ref, rtol=0, atol=0)
    assert torch.cuda.current_device() == 0
