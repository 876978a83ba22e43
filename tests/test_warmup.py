"""Warm-up: the enumerated calls cover every kernel specialization of a random ragged stream
(CPU: specialization keys from the backends' launch plans, no GPU), and on a GPU, after
warmup(), 60 random ragged batches compile nothing."""

import random

import pytest
import torch

from gdn_dispatch.device import assumed_device
from gdn_dispatch.testing import runnable_gpu_backends
from gdn_dispatch.warmup import (
    LAST_LENGTHS, WarmupCall, WarmupSpec, call_keys, candidate_calls, make_call, plan_warmup, warmup,
)

QWEN35 = dict(H=16, HV=32, K=128, V=128)
SMALL = dict(H=2, HV=4, K=64, V=128)


def random_stream(count: int, seed: int, max_num_seqs: int, max_len: int = 200) -> list[WarmupCall]:
    """Ragged batches as a server forms them: 1..max_num_seqs sequences of 0..max_len tokens
    (some whole chunks, some empty), a few uniform batches, any state flags."""
    rng = random.Random(seed)
    calls = []
    for _ in range(count):
        n = rng.randint(1, max_num_seqs)
        h0, ht = rng.random() < 0.5, rng.random() < 0.7
        if rng.random() < 0.2:
            calls.append(WarmupCall(None, (n, rng.choice([64, 128, rng.randint(1, max_len)])), h0, ht))
            continue
        lengths = [rng.choice([0, 64, 128, rng.randint(1, max_len)]) for _ in range(n)]
        lengths[0] = max(lengths[0], 1)
        calls.append(WarmupCall(tuple(lengths), None, h0, ht))
    return calls


CASES = [
    pytest.param("gluon_sm90", "sm_90", QWEN35, True, id="gluon_sm90-qwen35-l2"),
    pytest.param("gluon_sm90", "sm_90", SMALL, False, id="gluon_sm90-small"),
    pytest.param("gluon_sm100", "sm_100", QWEN35, True, id="gluon_sm100-qwen35-l2"),
    pytest.param("gluon_sm100", "sm_100", SMALL, True, id="gluon_sm100-small-l2"),
    pytest.param("triton_generic", "sm_90", QWEN35, True, id="triton_generic-sm90-qwen35-l2"),
    pytest.param("triton_generic", "sm_80", SMALL, False, id="triton_generic-sm80-small"),
]


@pytest.mark.parametrize("backend, arch, dims, l2", CASES)
def test_plan_covers_every_specialization_of_a_random_stream(backend, arch, dims, l2):
    device = assumed_device(arch)
    spec = WarmupSpec(**dims, use_qk_l2norm=l2, max_num_seqs=48)
    plan = plan_warmup(spec, backend, device)
    assert plan.keys and len(plan.calls) <= 64
    for i, call in enumerate(random_stream(60, seed=7, max_num_seqs=spec.max_num_seqs)):
        missing = call_keys(spec, call, backend, device) - plan.keys
        assert not missing, f"batch {i} ({call.label()}) would compile {sorted(map(str, missing))}"


def test_a_narrower_plan_misses_what_it_left_out():
    """Negative control: a plan for calls without a final state does not cover a stream that
    asks for one."""
    device = assumed_device("sm_90")
    spec = WarmupSpec(**SMALL, final_states=(False,), max_num_seqs=8)
    plan = plan_warmup(spec, "gluon_sm90", device)
    stream = [c for c in random_stream(20, seed=3, max_num_seqs=8) if c.output_final_state]
    assert any(call_keys(spec, c, "gluon_sm90", device) - plan.keys for c in stream)


def test_candidates_span_tails_layouts_and_state_flags():
    spec = WarmupSpec(**SMALL)
    calls = candidate_calls(spec, [1, 5])
    assert {c.lengths is None for c in calls} == {True, False}
    assert {(c.initial_state, c.output_final_state) for c in calls} == {(a, b) for a in (0, 1) for b in (0, 1)}
    tails = {c.tokens % 64 != 0 for c in calls}
    assert tails == {True, False} and {c.N for c in calls} == {1, 5}
    assert 64 in LAST_LENGTHS and any(n % 64 for n in LAST_LENGTHS)


def test_plan_runs_the_same_keys_with_fewer_calls():
    device = assumed_device("sm_90")
    spec = WarmupSpec(**QWEN35, max_num_seqs=16)
    plan = plan_warmup(spec, "gluon_sm90", device)
    covered = frozenset().union(*(call_keys(spec, c, "gluon_sm90", device) for c in plan.calls))
    assert covered == plan.keys
    # Tails and whole chunks, and both state flags, are separate specializations.
    flags = {(k[3]) for k in plan.keys if k[0] == "state_output_fwd"}
    has = {name: {dict(f)[name] for f in flags} for name in ("HAS_TAILS", "USE_H0", "STORE_HT")}
    assert all(values == {True, False} for values in has.values()), has


def test_make_call_builds_a_valid_call():
    from gdn_dispatch import chunk_gated_delta_rule

    spec = WarmupSpec(H=2, HV=4, K=8, V=12, dtype=torch.float32, state_layout="vk")
    call = WarmupCall((64, 17), None, True, True)
    o, ht = chunk_gated_delta_rule(**make_call(spec, call, random=True), backend="reference")
    assert o.shape == (1, 81, 4, 12) and ht.shape == (2, 4, 12, 8) and bool(torch.isfinite(o).all())


def test_warmup_on_cpu_has_nothing_to_compile():
    report = warmup(num_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=12, dtype=torch.float32, device="cpu")
    assert (report.backend, report.calls, report.compiles) == ("reference", 0, 0)


def test_cli_warmup_on_cpu(capsys):
    from gdn_dispatch.__main__ import main

    assert main(["warmup", "--heads", "2", "--v-heads", "4", "--head-k-dim", "8", "--head-v-dim", "12",
                 "--dtype", "fp32", "--device", "cpu", "--quiet"]) == 0
    assert "warmup: reference on cpu: 0 calls" in capsys.readouterr().out


# --- GPU tier ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", runnable_gpu_backends())
def test_after_warmup_a_random_ragged_stream_compiles_nothing(backend, capsys):
    from gdn_dispatch import chunk_gated_delta_rule
    from gdn_dispatch.warmup import _CompileCounter

    max_num_seqs = 32
    report = warmup(num_heads=QWEN35["H"], num_v_heads=QWEN35["HV"], head_k_dim=QWEN35["K"], head_v_dim=QWEN35["V"],
                    backend=backend, max_num_seqs=max_num_seqs)
    with capsys.disabled():
        print(f"\n{report.format()}")
    spec = WarmupSpec(**QWEN35, max_num_seqs=max_num_seqs)
    compiled = []
    with _CompileCounter() as counter:
        for i, call in enumerate(random_stream(60, seed=11, max_num_seqs=max_num_seqs, max_len=600)):
            before = counter.count
            chunk_gated_delta_rule(**make_call(spec, call, "cuda", random=True, seed=i), backend=backend)
            if counter.count != before:
                compiled.append(f"batch {i} ({call.label()}): {counter.count - before}")
        torch.cuda.synchronize()
    assert counter.count == 0, f"{counter.count} compiles after warm-up: {compiled}"


def test_compile_counter_sees_a_triton_compile():
    """The counter the GPU test relies on counts a real triton.compile (here ahead of time
    for sm_90, which needs no GPU): a compile after warm-up could not go unseen."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gdn_dispatch.warmup import _CompileCounter

    @triton.jit
    def _copy_kernel(src, dst, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs))

    source = ASTSource(_copy_kernel, signature={"src": "*fp32", "dst": "*fp32", "BLOCK": "constexpr"},
                       constexprs={"BLOCK": 16})
    with _CompileCounter() as counter:
        triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert counter.count == 1
