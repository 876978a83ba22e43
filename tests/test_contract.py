"""Every broken rule of the call contract raises GDNInputError naming what came."""

import fractions

import numpy as np
import pytest
import torch

from gdn_dispatch import GDNInputError, StateLayout, chunk_gated_delta_rule, contract
from gdn_dispatch.contract import make_problem
from gdn_dispatch.testing import fused_projection_views, random_call
from gdn_dispatch.varlen import build_chunk_table, slot_starts


def base_call(**over):
    call = random_call(batch=(2, 10), H=2, HV=4, K=8, V=12, dtype=torch.float32, seed=1)
    call.update(over)
    return call


def varlen_call(**over):
    call = random_call(lengths=[3, 0, 7], H=2, HV=4, K=8, V=12, dtype=torch.float32, seed=2)
    call.update(over)
    return call


def _int(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


def _offsets_stand_for_device_memory(monkeypatch):
    """Let this test's CPU cu_seqlens stand for a device tensor: the contract then treats it
    as it treats offsets in GPU memory (never read without GDN_DEBUG_CHECKS), so the
    device rules are tested without a GPU."""
    monkeypatch.setattr(contract, "_in_host_memory", lambda t: False)


BAD_CALLS = [
    pytest.param(lambda c: c.update(q=c["q"][0]), r"q: expected 4 dims \[B, T, H, K\], got shape \(10, 2, 8\)", id="q-rank"),
    pytest.param(lambda c: c.update(v=c["v"][..., 0]), r"v: expected 4 dims", id="v-rank"),
    pytest.param(lambda c: c.update(g=c["g"][..., None]), r"g: expected 3 dims \[B, T, HV\]", id="g-rank"),
    pytest.param(lambda c: c.update(q="q"), r"q: expected a torch.Tensor", id="q-not-tensor"),
    pytest.param(lambda c: c.update(k=c["k"][:, :9].contiguous()), r"k: expected the shape of q \(2, 10, 2, 8\)", id="k-T"),
    pytest.param(lambda c: c.update(v=c["v"][:1].contiguous()), r"v: expected \[B, T\] = \(2, 10\)", id="v-B"),
    pytest.param(lambda c: c.update(g=c["g"][:, :7].contiguous()), r"g: expected shape \[B, T, HV\] = \(2, 10, 4\), got shape \(2, 7, 4\)", id="g-T"),
    pytest.param(lambda c: c.update(beta=c["beta"][..., :3].contiguous()), r"beta: expected shape \[B, T, HV\]", id="beta-HV"),
    pytest.param(lambda c: c.update(k=torch.randn(2, 10, 1, 8)), r"k: expected the shape of q", id="qk-heads"),
    pytest.param(lambda c: c.update(k=torch.randn(2, 10, 2, 16)), r"k: expected the shape of q", id="qk-dims"),
    pytest.param(lambda c: c.update(v=torch.randn(2, 10, 3, 12), g=torch.randn(2, 10, 3), beta=torch.rand(2, 10, 3)),
                 r"v: expected HV \(v.shape\[2\]\) to be a multiple of H = 2, got HV = 3", id="HV-not-multiple"),
    pytest.param(lambda c: c.update(q=torch.randn(2, 10, 2, 320), k=torch.randn(2, 10, 2, 320)),
                 r"q: expected head dim K in \[1, 256\], got 320", id="K-too-large"),
    pytest.param(lambda c: c.update(v=torch.randn(2, 10, 4, 300)), r"v: expected head dim V in \[1, 256\], got 300", id="V-too-large"),
    pytest.param(lambda c: c.update(q=c["q"].double(), k=c["k"].double(), v=c["v"].double()),
                 r"q: expected dtype in .*got torch.float64", id="q-float64"),
    pytest.param(lambda c: c.update(v=c["v"].half()), r"v: expected q's dtype torch.float32, got torch.float16", id="v-dtype"),
    pytest.param(lambda c: c.update(g=c["g"].to(torch.int32)), r"g: expected dtype in", id="g-int"),
    pytest.param(lambda c: c.update(beta=c["beta"].to(torch.bool)), r"beta: expected dtype in", id="beta-bool"),
    pytest.param(lambda c: c.update(initial_state=torch.randn(2, 4, 12, 8)),
                 r"initial_state: expected \[N, HV, K, V\] = \(2, 4, 8, 12\) for state_layout='kv' and N = 2 sequences, got shape \(2, 4, 12, 8\)",
                 id="h0-kv-shape"),
    pytest.param(lambda c: c.update(initial_state=torch.randn(2, 4, 8, 12), state_layout="vk"),
                 r"initial_state: expected \[N, HV, V, K\] = \(2, 4, 12, 8\) for state_layout='vk'", id="h0-vk-shape"),
    pytest.param(lambda c: c.update(initial_state=torch.randn(3, 4, 8, 12)), r"initial_state: expected .* N = 2 sequences", id="h0-N"),
    pytest.param(lambda c: c.update(initial_state=torch.randn(2, 4, 8, 12).to(torch.int64)), r"initial_state: expected dtype in", id="h0-dtype"),
    pytest.param(lambda c: c.update(state_layout="kvv"), r"state_layout: expected one of \['kv', 'vk'\], got 'kvv'", id="layout-unknown"),
    pytest.param(lambda c: c.update(state_v_first=True, state_layout="kv"), r"state_v_first: True contradicts state_layout='kv'", id="layout-contradiction"),
    pytest.param(lambda c: c.update(backend="cutlass"), r"backend: expected one of \[.*'reference'\] or None, got 'cutlass'", id="backend-unknown"),
    pytest.param(lambda c: c.update(head_first=True), r"head_first: .* not supported; pass q, k as \[B, T, H, K\]", id="head-first"),
    pytest.param(lambda c: c.update(cu_seqlens=_int([0, 5, 20])), r"cu_seqlens: requires B == 1 .* got q with B = 2", id="cu-B"),
    pytest.param(lambda c: c.update(scale="1"), r"scale: expected a real number \(float, int, NumPy scalar\) or None, got str",
                 id="scale-type"),
    pytest.param(lambda c: c.update(scale=True), r"scale: expected a real number .* or None, got bool", id="scale-bool"),
    pytest.param(lambda c: c.update(scale=torch.tensor(0.5)),
                 r"scale: expected a real number .* got Tensor \(reading a tensor's value would synchronize", id="scale-tensor"),
    pytest.param(lambda c: c.update(scale=float("nan")), r"scale: expected a finite number, got nan", id="scale-nan"),
    pytest.param(lambda c: c.update(scale=np.float32("inf")), r"scale: expected a finite number, got inf", id="scale-inf"),
]

BAD_VARLEN = [
    pytest.param(lambda c: c.update(cu_seqlens=_int([[0, 10]]), cu_seqlens_cpu=None), r"cu_seqlens: expected 1 dims \[N \+ 1\]", id="cu-2d"),
    pytest.param(lambda c: c.update(cu_seqlens=torch.tensor([0.0, 10.0]), cu_seqlens_cpu=None), r"cu_seqlens: expected dtype in \['torch.int32', 'torch.int64'\], got torch.float32", id="cu-float"),
    pytest.param(lambda c: c.update(cu_seqlens=_int([0]), cu_seqlens_cpu=None), r"cu_seqlens: expected at least 2 entries", id="cu-short"),
    pytest.param(lambda c: c.update(cu_seqlens_cpu=_int([0, 10])), r"cu_seqlens_cpu: expected 4 entries like cu_seqlens, got 2", id="cu-cpu-len"),
    pytest.param(lambda c: c.update(cu_seqlens_cpu=_int([0, 3, 3, 11])), r"cu_seqlens_cpu: expected to end at T = 10 \(q.shape\[1\]\), got 11", id="cu-cpu-end"),
    pytest.param(lambda c: c.update(cu_seqlens_cpu=_int([2, 3, 3, 10])), r"cu_seqlens_cpu: expected to start at 0, got 2", id="cu-cpu-start"),
    pytest.param(lambda c: c.update(cu_seqlens_cpu=_int([0, 5, 3, 10])),
                 r"cu_seqlens_cpu: expected non-decreasing values, got 5 then 3 at positions 1, 2", id="cu-cpu-decreasing"),
    pytest.param(lambda c: c.update(cu_seqlens_cpu=_int([[0, 3, 3, 10]])), r"cu_seqlens_cpu: expected 1 dims", id="cu-cpu-2d"),
    pytest.param(lambda c: c.update(cu_seqlens_cpu=torch.tensor([0.0, 3.0, 3.0, 10.0])), r"cu_seqlens_cpu: expected dtype in", id="cu-cpu-float"),
    pytest.param(lambda c: c.update(cu_seqlens=[0, 3, 3, 10]), r"cu_seqlens_cpu: not needed when cu_seqlens is a list", id="cu-list-and-cpu"),
    pytest.param(lambda c: c.update(cu_seqlens=[0, 3.0, 3, 10], cu_seqlens_cpu=None),
                 r"cu_seqlens: expected a list of ints \[N \+ 1\], got elements of type \['float', 'int'\]", id="cu-list-float"),
    pytest.param(lambda c: c.update(cu_seqlens=[0, 3, 3, 9], cu_seqlens_cpu=None), r"cu_seqlens: expected to end at T = 10", id="cu-list-end"),
    pytest.param(lambda c: c.update(cu_seqlens=(0, 4, 3, 10), cu_seqlens_cpu=None),
                 r"cu_seqlens: expected non-decreasing values, got 4 then 3", id="cu-tuple-decreasing"),
    pytest.param(lambda c: c.update(cu_seqlens=None), r"cu_seqlens_cpu: given without cu_seqlens", id="cu-cpu-alone"),
    pytest.param(lambda c: c.update(initial_state=torch.randn(2, 4, 8, 12)), r"initial_state: expected .* = \(3, 4, 8, 12\) .* N = 3 sequences", id="h0-N-varlen"),
]


@pytest.mark.parametrize("mutate, message", BAD_CALLS)
def test_bad_call_raises(mutate, message):
    call = base_call()
    mutate(call)
    with pytest.raises(GDNInputError, match=message):
        chunk_gated_delta_rule(**call)


@pytest.mark.parametrize("mutate, message", BAD_VARLEN)
def test_bad_varlen_call_raises(mutate, message):
    call = varlen_call()
    mutate(call)
    with pytest.raises(GDNInputError, match=message):
        chunk_gated_delta_rule(**call)


@pytest.mark.parametrize("scale", [0.25, 1, np.float32(0.25), np.float64(0.25), np.int64(1), fractions.Fraction(1, 4)],
                         ids=["float", "int", "np-float32", "np-float64", "np-int64", "fraction"])
def test_scale_takes_any_real_number(scale):
    problem = make_problem(**base_call(scale=scale))
    assert type(problem.scale) is float and problem.scale == float(scale)


def test_input_error_is_value_error():
    assert issubclass(GDNInputError, ValueError)


def test_tensors_on_different_devices_are_rejected():
    call = base_call()
    call["g"] = call["g"].to("meta")
    with pytest.raises(GDNInputError, match=r"g: expected device cpu \(q's\), got meta"):
        chunk_gated_delta_rule(**call)


def test_normalized_problem():
    call = varlen_call(state_layout=None, state_v_first=True, initial_state=torch.randn(3, 4, 12, 8))
    problem = make_problem(**call, output_final_state=True)
    assert problem.state_layout is StateLayout.VK
    assert (problem.B, problem.T, problem.H, problem.HV, problem.K, problem.V, problem.N) == (1, 10, 2, 4, 8, 12, 3)
    assert problem.scale == pytest.approx(8 ** -0.5)
    assert problem.state_shape == (3, 4, 12, 8)
    assert problem.is_varlen


def test_chunk_table_varlen():
    call = random_call(lengths=[1, 0, 64, 65, 130], K=8, V=8, dtype=torch.float32)
    table = make_problem(**call).chunks
    assert table.num_seqs == 5
    assert table.cu_seqlens.dtype == torch.int32 and not table.uniform
    # Chunk slots: sequence n owns [cu[n] // 64 + n, cu[n + 1] // 64 + n + 1).
    assert table.num_slots == 260 // 64 + 5
    assert slot_starts(table.cu_seqlens_host.tolist(), 64) == [0, 1, 2, 4, 6, 9]


def test_chunk_table_uniform():
    call = random_call(batch=(3, 130), K=8, V=8, dtype=torch.float32)
    table = make_problem(**call).chunks
    assert table.num_seqs == 3 and table.uniform
    assert table.cu_seqlens.tolist() == [0, 130, 260, 390]
    assert table.num_slots == 390 // 64 + 3 and slot_starts(table.cu_seqlens_host.tolist(), 64) == [0, 3, 6, 9]


def test_uniform_chunk_tables_are_built_once_per_shape():
    # The tables of a uniform batch depend on (B, T, device) only: calls of one shape share
    # them (no per-call device launches), other shapes get their own.
    first = make_problem(**random_call(batch=(2, 100), K=8, V=8, dtype=torch.float32, seed=1)).chunks
    again = make_problem(**random_call(batch=(2, 100), K=8, V=8, dtype=torch.float32, seed=2)).chunks
    other = make_problem(**random_call(batch=(2, 129), K=8, V=8, dtype=torch.float32, seed=1)).chunks
    assert again is first and other is not first
    assert other.num_slots == 258 // 64 + 2 and other.cu_seqlens.tolist() == [0, 129, 258]


@pytest.mark.parametrize("container", [list, tuple])
def test_cu_seqlens_as_a_python_sequence_is_the_host_copy(container):
    call = varlen_call()
    expected_o, expected_ht = chunk_gated_delta_rule(**call, output_final_state=True)
    offsets = container(call["cu_seqlens_cpu"].tolist())
    o, ht = chunk_gated_delta_rule(**{**call, "cu_seqlens": offsets, "cu_seqlens_cpu": None},
                                   output_final_state=True)
    torch.testing.assert_close(o, expected_o, rtol=0, atol=0)
    torch.testing.assert_close(ht, expected_ht, rtol=0, atol=0)
    problem = make_problem(**{**call, "cu_seqlens": offsets, "cu_seqlens_cpu": None})
    assert problem.cu_seqlens.device == call["q"].device and problem.chunks.cu_seqlens_host.tolist() == list(offsets)


DEBUG_FAILURES = [
    # A device cu_seqlens without a host copy: its values are only read under debug checks.
    pytest.param(lambda c: c.update(cu_seqlens=_int([1, 3, 10]), cu_seqlens_cpu=None), r"cu_seqlens: expected to start at 0, got 1", id="cu-start"),
    pytest.param(lambda c: c.update(cu_seqlens=_int([0, 6, 3, 10]), cu_seqlens_cpu=None),
                 r"cu_seqlens: expected non-decreasing values, got 6 then 3 at positions 1, 2", id="cu-decreasing"),
    pytest.param(lambda c: c.update(cu_seqlens=_int([0, 3, 9]), cu_seqlens_cpu=None), r"cu_seqlens: expected to end at T = 10 \(q.shape\[1\]\), got 9", id="cu-end"),
    pytest.param(lambda c: c.update(cu_seqlens_cpu=_int([0, 2, 3, 10])),
                 r"cu_seqlens_cpu: expected the values of cu_seqlens, got 2 where cu_seqlens holds 3 \(position 1\)",
                 id="host-copy-differs"),
    pytest.param(lambda c: c["g"].view(-1)[5].fill_(float("nan")), r"g: expected finite values, got 1 NaN/inf entries", id="g-nan"),
    pytest.param(lambda c: c["beta"].view(-1)[0].fill_(float("inf")), r"beta: expected finite values, got 1", id="beta-inf"),
    pytest.param(lambda c: c["v"].view(-1)[7].fill_(float("-inf")), r"v: expected finite values, got 1", id="v-inf"),
    pytest.param(lambda c: c["q"].view(-1)[1].fill_(float("nan")), r"q: expected finite values", id="q-nan"),
    pytest.param(lambda c: c["k"].view(-1)[2].fill_(float("nan")), r"k: expected finite values", id="k-nan"),
    pytest.param(lambda c: c["initial_state"].view(-1)[3].fill_(float("nan")), r"initial_state: expected finite values", id="h0-nan"),
]


@pytest.mark.parametrize("mutate, message", DEBUG_FAILURES)
def test_debug_checks_catch_what_needs_a_sync(mutate, message, monkeypatch):
    _offsets_stand_for_device_memory(monkeypatch)
    call = varlen_call()
    mutate(call)
    monkeypatch.setenv("GDN_DEBUG_CHECKS", "1")
    with pytest.raises(GDNInputError, match=message):
        chunk_gated_delta_rule(**call)


@pytest.mark.parametrize("mutate", [
    pytest.param(lambda c: c.update(cu_seqlens_cpu=_int([0, 4, 4, 10])), id="host-copy-differs"),
    pytest.param(lambda c: c.update(cu_seqlens=_int([0, 3, 3, 9]), cu_seqlens_cpu=None), id="device-values-unchecked"),
    next(p.values[0] for p in DEBUG_FAILURES if p.id == "g-nan"),
])
def test_debug_checks_are_off_by_default(mutate, monkeypatch):
    # Without GDN_DEBUG_CHECKS the call trusts the host copy and reads no values back.
    _offsets_stand_for_device_memory(monkeypatch)
    call = varlen_call()
    mutate(call)
    monkeypatch.delenv("GDN_DEBUG_CHECKS", raising=False)
    make_problem(**call)


@pytest.mark.parametrize("debug", ["0", "1"])
def test_host_offsets_meet_their_copy_once(debug, monkeypatch):
    """CPU cu_seqlens with a host copy: one comparison per call, with or without the debug
    checks (which compare device offsets only); a differing copy still raises."""
    import gdn_dispatch.contract as contract

    calls = []
    check = contract._check_host_copy
    monkeypatch.setattr(contract, "_check_host_copy", lambda *a: calls.append(1) or check(*a))
    monkeypatch.setenv("GDN_DEBUG_CHECKS", debug)
    make_problem(**varlen_call())
    assert len(calls) == 1
    with pytest.raises(GDNInputError, match="cu_seqlens_cpu: expected the values of cu_seqlens"):
        make_problem(**varlen_call(cu_seqlens_cpu=_int([0, 4, 4, 10])))
    assert len(calls) == 2


class _NoReadBack(torch.Tensor):
    """A tensor whose values must not reach the host: every way of reading them raises."""

    READS = frozenset({"cpu", "item", "tolist", "numpy", "to", "__int__", "__index__", "__bool__", "__float__",
                       "__getitem__", "__array__", "__iter__", "equal", "__eq__", "__ne__", "__lt__", "__le__",
                       "__gt__", "__ge__", "__repr__", "__format__"})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in cls.READS:
            raise AssertionError(f"cu_seqlens read back through {name}")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_device_cu_seqlens_is_never_read_back(dtype, monkeypatch):
    monkeypatch.delenv("GDN_DEBUG_CHECKS", raising=False)
    _offsets_stand_for_device_memory(monkeypatch)
    call = varlen_call(cu_seqlens_cpu=None)
    guarded = call["cu_seqlens"].to(dtype).as_subclass(_NoReadBack)
    problem = make_problem(**{**call, "cu_seqlens": guarded})
    assert problem.cu_seqlens is guarded and problem.chunks.cu_seqlens_host is None
    assert (problem.N, problem.chunks.num_slots) == (3, 10 // 64 + 3)


def test_the_read_back_guard_can_fail(monkeypatch):
    """Negative control: the guard trips on a read; the contract reads a CPU cu_seqlens (host
    memory, its own host copy), so the test above trips it unless its offsets stand for
    device memory; and the debug checks (which read device values back on purpose) trip it."""
    guarded = _int([0, 3, 3, 10]).as_subclass(_NoReadBack)
    with pytest.raises(AssertionError, match="read back through cpu"):
        guarded.cpu()
    monkeypatch.delenv("GDN_DEBUG_CHECKS", raising=False)
    with pytest.raises(AssertionError, match="read back through tolist"):
        make_problem(**varlen_call(cu_seqlens=guarded, cu_seqlens_cpu=None))
    _offsets_stand_for_device_memory(monkeypatch)
    monkeypatch.setenv("GDN_DEBUG_CHECKS", "1")
    with pytest.raises(AssertionError, match="read back"):
        make_problem(**varlen_call(cu_seqlens=guarded, cu_seqlens_cpu=None))


def _broken_cpu_offsets(break_rule, seed):
    """A CPU call of random lengths (the last one non-empty) whose cu_seqlens tensor, with
    no host copy, breaks one partition rule; with the message that names it."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 80, (int(torch.randint(2, 7, (), generator=gen)),), generator=gen).tolist()
    lengths[-1] += 1
    call = random_call(lengths=lengths, H=1, HV=2, K=8, V=8, dtype=torch.float32, seed=seed)
    call.pop("cu_seqlens_cpu")
    offsets, message = break_rule(call["cu_seqlens"].tolist(), call["q"].shape[1])
    return call, offsets, message


CPU_OFFSET_BREAKS = [
    pytest.param(lambda cu, T: ([1, *cu[1:]], r"cu_seqlens: expected to start at 0, got 1"), id="start"),
    pytest.param(lambda cu, T: ([-3, *cu[1:]], r"cu_seqlens: expected to start at 0, got -3"), id="negative-start"),
    pytest.param(lambda cu, T: ([0, cu[2] + 1, *cu[2:]],
                                rf"cu_seqlens: expected non-decreasing values, got {cu[2] + 1} then {cu[2]} "
                                r"at positions 1, 2"), id="decreasing"),
    pytest.param(lambda cu, T: ([*cu[:-1], T - 1], rf"cu_seqlens: expected to end at T = {T} \(q.shape\[1\]\), "
                                rf"got {T - 1}$"), id="ends-before-T"),
    pytest.param(lambda cu, T: ([*cu[:-1], T + 5], rf"cu_seqlens: expected to end at T = {T} \(q.shape\[1\]\), "
                                rf"got {T + 5}$"), id="ends-past-T"),
]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("break_rule", CPU_OFFSET_BREAKS)
@pytest.mark.parametrize("seed", range(3))
def test_cpu_cu_seqlens_is_checked_without_debug_checks(break_rule, dtype, seed, monkeypatch):
    """On the CPU reading the offsets costs no sync: a cu_seqlens tensor there is its own
    host copy, checked on every call (unchecked offsets that end before T leave rows of the
    reference backend's o unwritten; past T, the interpreted Triton kernels write out of
    bounds)."""
    monkeypatch.delenv("GDN_DEBUG_CHECKS", raising=False)
    call, offsets, message = _broken_cpu_offsets(break_rule, seed)
    call["cu_seqlens"] = torch.tensor(offsets, dtype=dtype)
    with pytest.raises(GDNInputError, match=message):
        make_problem(**call)
    with pytest.raises(GDNInputError, match=message):
        chunk_gated_delta_rule(**call, output_final_state=True)
    strided = torch.tensor([x for offset in offsets for x in (offset, -1)], dtype=dtype)[::2]
    with pytest.raises(GDNInputError, match=message):
        make_problem(**{**call, "cu_seqlens": strided})


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("seed", range(3))
def test_cpu_cu_seqlens_is_its_own_host_copy(dtype, seed, monkeypatch):
    """A valid CPU cu_seqlens without cu_seqlens_cpu gives the chunk table the host facts a
    host copy gives, and the call the same results."""
    monkeypatch.delenv("GDN_DEBUG_CHECKS", raising=False)
    gen = torch.Generator().manual_seed(seed)
    lengths = (torch.randint(0, 3, (int(torch.randint(1, 6, (), generator=gen)),), generator=gen) * 64).tolist()
    if seed % 2:  # some sequence ends inside a chunk
        lengths[int(torch.randint(0, len(lengths), (), generator=gen))] += int(torch.randint(1, 64, (), generator=gen))
    with_copy = random_call(lengths=lengths, H=1, HV=2, K=8, V=8, dtype=torch.float32, seed=seed)
    with_copy["cu_seqlens"] = with_copy["cu_seqlens"].to(dtype)
    alone = {**with_copy, "cu_seqlens_cpu": None}
    chunks = make_problem(**alone).chunks
    assert chunks.cu_seqlens_host is alone["cu_seqlens"]
    assert (chunks.longest, chunks.aligned) == (max(lengths), all(length % 64 == 0 for length in lengths))
    assert chunks.nonempty_seqs() == sum(length > 0 for length in lengths)
    o, ht = chunk_gated_delta_rule(**alone, output_final_state=True)
    o_ref, ht_ref = chunk_gated_delta_rule(**with_copy, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(ht, ht_ref, rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(3))
def test_cpu_cu_seqlens_and_a_host_copy_that_differs(seed, monkeypatch):
    """Both offsets on the host (a CPU call): a cu_seqlens_cpu that is no copy of
    cu_seqlens is refused on every call, naming the first position they differ at; both
    copies keep the partition rules, so without the comparison the kernels would read the
    device offsets while the planners read the other."""
    monkeypatch.delenv("GDN_DEBUG_CHECKS", raising=False)
    gen = torch.Generator().manual_seed(seed)
    lengths = (torch.randint(1, 90, (3,), generator=gen)).tolist()
    call = random_call(lengths=lengths, H=1, HV=2, K=8, V=8, dtype=torch.float32, seed=seed)
    moved = call["cu_seqlens"].clone()
    moved[1] += 1 if lengths[1] > 1 else -1
    with pytest.raises(GDNInputError, match=rf"cu_seqlens_cpu: expected the values of cu_seqlens, got "
                                            rf"{int(moved[1])} where cu_seqlens holds {int(call['cu_seqlens'][1])} "
                                            r"\(position 1\)"):
        make_problem(**{**call, "cu_seqlens_cpu": moved})
    make_problem(**{**call, "cu_seqlens_cpu": call["cu_seqlens"].clone()})


def test_native_admission_gets_cpu_offsets_as_their_host_copy(monkeypatch):
    """The native admission checks the values of the host copy it is handed and no others:
    the contract hands it a CPU cu_seqlens as its own host copy (a device one, none)."""
    handed = []

    def admit(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, vk, state_indices):
        handed.append(cu_seqlens_cpu)
        return None  # refused: the Python contract decides

    monkeypatch.setattr(contract, "native_admission", lambda: admit)
    call = varlen_call(cu_seqlens_cpu=None)
    make_problem(**call)
    assert handed[-1] is call["cu_seqlens"]
    with pytest.raises(GDNInputError, match="cu_seqlens: expected to end at T = 10"):
        make_problem(**{**call, "cu_seqlens": _int([0, 3, 3, 9])})
    make_problem(**varlen_call())
    assert handed[-1] is not None and handed[-1] is not call["cu_seqlens"]
    _offsets_stand_for_device_memory(monkeypatch)
    make_problem(**call)
    assert handed[-1] is None


@pytest.mark.parametrize("make", [base_call, varlen_call], ids=["uniform", "varlen"])
def test_row_strided_views_are_read_without_a_copy(make):
    from gdn_dispatch.contract import INPUT_COPIES, token_rows_stride

    call = make()
    views = fused_projection_views(call)
    width = views["q"].stride(1)
    assert all(token_rows_stride(t) == width for t in views.values())
    dense = {name: t.contiguous() for name, t in views.items()}
    before = sum(INPUT_COPIES.values())
    problem = make_problem(**{**call, **views})
    assert sum(INPUT_COPIES.values()) == before
    assert all(getattr(problem, name) is views[name] for name in views)
    o, ht = chunk_gated_delta_rule(**{**call, **views}, output_final_state=True)
    o_ref, ht_ref = chunk_gated_delta_rule(**{**call, **dense}, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(ht, ht_ref, rtol=0, atol=0)


def test_other_strides_are_copied_once_and_counted(caplog):
    from gdn_dispatch.contract import INPUT_COPIES

    call = base_call()
    # v as transformers hands it in: the last dim not contiguous.
    v_t = call["v"].permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    assert v_t.stride(-1) != 1 and torch.equal(v_t, call["v"])
    before = INPUT_COPIES["v"]
    with caplog.at_level("DEBUG", logger="gdn_dispatch"):
        problem = make_problem(**{**call, "v": v_t})
    assert INPUT_COPIES["v"] == before + 1 and problem.v.is_contiguous()
    assert "copied v" in caplog.text
    o, _ = chunk_gated_delta_rule(**{**call, "v": v_t})
    torch.testing.assert_close(o, chunk_gated_delta_rule(**call)[0], rtol=0, atol=0)


def _pool(P=5, layout="kv", dtype=torch.float32):
    dims = (8, 12) if layout == "kv" else (12, 8)
    return torch.randn(P, 4, *dims).to(dtype)


BAD_POOLS = [
    pytest.param(dict(initial_state=None, state_indices=_int([0, 1, 2])),
                 r"state_indices: needs initial_state to be the state pool \[P, HV, K, V\]", id="no-pool"),
    pytest.param(dict(initial_state=_pool(), state_indices=_int([0, 1])),
                 r"state_indices: expected one index per sequence, N = 3, got 2", id="idx-count"),
    pytest.param(dict(initial_state=_pool(), state_indices=torch.tensor([0.0, 1.0, 2.0])),
                 r"state_indices: expected dtype in", id="idx-float"),
    pytest.param(dict(initial_state=_pool(), state_indices=_int([[0, 1, 2]])), r"state_indices: expected 1 dims", id="idx-2d"),
    pytest.param(dict(initial_state=_pool(), state_indices=_int([0, 1, 2]).to("meta")),
                 r"state_indices: expected device cpu \(q's\), got meta", id="idx-device"),
    pytest.param(dict(initial_state=_pool(dtype=torch.float16), state_indices=_int([0, 1, 2])),
                 r"initial_state: expected dtype in \['torch.float32', 'torch.bfloat16'\], got torch.float16", id="pool-fp16"),
    pytest.param(dict(initial_state=_pool(layout="vk"), state_indices=_int([0, 1, 2])),
                 r"initial_state: expected a state pool \[P, HV, K, V\] = \(P, 4, 8, 12\)", id="pool-layout"),
    pytest.param(dict(initial_state=_pool()[:, :, :, :6].contiguous(), state_indices=_int([0, 1, 2])),
                 r"initial_state: expected a state pool", id="pool-V"),
    pytest.param(dict(initial_state=_pool().transpose(0, 1).contiguous().transpose(0, 1), state_indices=_int([0, 1, 2])),
                 r"initial_state: expected a contiguous tensor", id="pool-strided"),
    pytest.param(dict(initial_state=_pool(P=0), state_indices=_int([-1, -1, -1])),
                 r"initial_state: expected a state pool .* with P >= 1", id="pool-empty"),
    pytest.param(dict(inplace_final_state=True), r"inplace_final_state: needs state_indices", id="inplace-no-idx"),
]


@pytest.mark.parametrize("over, message", BAD_POOLS)
def test_bad_state_pool_raises(over, message):
    with pytest.raises(GDNInputError, match=message):
        make_problem(**varlen_call(**over))


@pytest.mark.parametrize("idx, message", [
    pytest.param([0, 5, 1], r"state_indices: expected values in \[-1, 5\) \(P pool rows\), got 5 at position 1", id="past-end"),
    pytest.param([0, -2, 1], r"state_indices: expected values in \[-1, 5\).* got -2", id="below-minus-one"),
    pytest.param([3, -1, 3], r"state_indices: expected each pool row at most once", id="duplicate"),
])
def test_debug_checks_catch_bad_pool_indices(idx, message, monkeypatch):
    monkeypatch.setenv("GDN_DEBUG_CHECKS", "1")
    with pytest.raises(GDNInputError, match=message):
        make_problem(**varlen_call(initial_state=_pool(), state_indices=_int(idx)))


@pytest.mark.parametrize("seed", range(4))
def test_chunk_table_knows_the_longest_sequence_and_chunk_alignment_from_the_host_copy(seed, monkeypatch):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(10):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        lengths = (torch.randint(0, 4, (n,), generator=gen) * 64).tolist()
        if torch.rand(1, generator=gen).item() < 0.5:  # some sequence ends inside a chunk
            lengths[int(torch.randint(0, n, (1,), generator=gen))] += int(torch.randint(1, 64, (1,), generator=gen))
        call = random_call(lengths=lengths, H=1, HV=1, K=8, V=8, dtype=torch.float32, seed=seed)
        chunks = make_problem(**call).chunks
        assert chunks.longest == max(lengths)
        assert chunks.aligned == all(length % 64 == 0 for length in lengths)
        # A table built without them reads the host copy when asked.
        unread = build_chunk_table(1, chunks.cu_seqlens_host[-1].item(), chunks.cu_seqlens, chunks.cu_seqlens_host,
                                   64, chunks.cu_seqlens.device)
        assert unread.longest is None and unread.aligned is None
        assert (unread.longest_length(), unread.chunk_aligned()) == (chunks.longest, chunks.aligned)
        call.pop("cu_seqlens_cpu")
        chunks = make_problem(**call).chunks  # CPU offsets: their own host copy
        assert chunks.cu_seqlens_host is call["cu_seqlens"]
        assert (chunks.longest, chunks.aligned) == (max(lengths), all(length % 64 == 0 for length in lengths))
        with monkeypatch.context() as patch:
            _offsets_stand_for_device_memory(patch)
            chunks = make_problem(**call).chunks  # device offsets, no host copy: unknown, never read back
        assert chunks.cu_seqlens_host is None
        assert chunks.longest is None and chunks.aligned is None
        assert chunks.longest_length() is None and chunks.chunk_aligned() is None
    uniform = make_problem(**random_call(batch=(2, 100), H=1, HV=1, K=8, V=8, dtype=torch.float32)).chunks
    assert uniform.longest == 100 and uniform.aligned is False


@pytest.mark.parametrize("seed", range(3))
def test_validated_problems_are_whole_frozen_dataclasses(seed):
    """make_problem builds its GDNProblem and chunk table without the dataclass __init__;
    they must hold every field, equal what the constructors build, and stay frozen."""
    import dataclasses

    from gdn_dispatch.contract import GDNProblem
    from gdn_dispatch.varlen import ChunkTable

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 200, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
    for call in (random_call(lengths=lengths, H=2, HV=4, K=16, V=8, dtype=torch.float32, seed=seed),
                 random_call(batch=(2, 70), H=1, HV=2, K=8, V=8, dtype=torch.float32, seed=seed)):
        for state_layout in ("kv", "vk", "VK", StateLayout.VK):
            p = make_problem(**{**call, "initial_state": None, "state_layout": state_layout})
            assert p.state_layout is StateLayout(str(getattr(state_layout, "value", state_layout)).lower())
            for obj, cls in ((p, GDNProblem), (p.chunks, ChunkTable)):
                names = [f.name for f in dataclasses.fields(cls)]
                assert sorted(vars(obj)) == sorted(names)
                rebuilt = cls(**{name: getattr(obj, name) for name in names})
                assert all(getattr(rebuilt, name) is getattr(obj, name) for name in names)
                with pytest.raises(dataclasses.FrozenInstanceError):
                    setattr(obj, names[0], None)
            assert dataclasses.replace(p, backend="reference").backend == "reference"


def test_replace_fields_equals_dataclasses_replace():
    """The segmented path's cheap replace builds what dataclasses.replace builds, leaves the
    original as it was, and refuses a name that is not a field."""
    import dataclasses

    from gdn_dispatch.contract import GDNProblem, replace_fields

    p = make_problem(**random_call(lengths=[5, 0, 70], H=2, HV=4, K=16, V=8, dtype=torch.float32, seed=4))
    changes = dict(output_final_state=False, state_layout=StateLayout.VK, context_parallel="off", initial_state=None)
    fast, slow = replace_fields(p, **changes), dataclasses.replace(p, **changes)
    names = [f.name for f in dataclasses.fields(GDNProblem)]
    assert type(fast) is GDNProblem and sorted(vars(fast)) == sorted(names)
    assert all(getattr(fast, name) is getattr(slow, name) for name in names)
    assert p.context_parallel == "auto" and p.state_layout is StateLayout.KV
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.backend = "reference"
    with pytest.raises(TypeError, match="chunk_size"):
        replace_fields(p, chunk_size=32)


@pytest.mark.parametrize("name", ["output_final_state", "use_qk_l2norm_in_kernel", "inplace_final_state"])
@pytest.mark.parametrize("value", ["no", "false", "", 2, -1, 0.0, None])
def test_boolean_arguments_take_bools_alone(name, value):
    # A truthy string would silently mean on; a float, None or another int means nothing.
    call = varlen_call()
    if name == "inplace_final_state":
        call["state_indices"] = torch.randperm(5, generator=torch.Generator().manual_seed(3))[:3].to(torch.int32)
        call["initial_state"] = torch.randn(5, 4, 8, 12, generator=torch.Generator().manual_seed(4))
    with pytest.raises(GDNInputError, match=f"{name}: expected True or False, got {value!r}"):
        chunk_gated_delta_rule(**call, **{name: value})


@pytest.mark.parametrize("value", [0, 1, True, False, np.int64(1)])
def test_boolean_arguments_take_ints_zero_and_one(value):
    call = varlen_call()
    o, ht = chunk_gated_delta_rule(**call, output_final_state=value)
    assert (ht is not None) == bool(value)
    expected, _ = chunk_gated_delta_rule(**call, output_final_state=bool(value))
    torch.testing.assert_close(o, expected, rtol=0, atol=0)


def test_list_offsets_are_int32_unless_a_value_needs_int64():
    from gdn_dispatch.contract import host_offsets

    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(0, 500, (7,), generator=gen).tolist()
    offsets = [0] + torch.tensor(lengths).cumsum(0).tolist()
    assert host_offsets(offsets).dtype == torch.int32 and host_offsets(offsets).tolist() == offsets
    assert host_offsets(tuple(offsets)).dtype == torch.int32
    wide = offsets[:-1] + [2 ** 31]
    assert host_offsets(wide).dtype == torch.int64 and host_offsets(wide).tolist() == wide
    problem = make_problem(**varlen_call(cu_seqlens=[0, 3, 3, 10], cu_seqlens_cpu=None))
    assert problem.cu_seqlens.dtype == torch.int32
