"""Warm-up: the enumerated calls cover every kernel specialization of a random ragged stream
(plain, pooled and fused-projection calls, both varlen forms; CPU: specialization keys from
the backends' launch planners, no GPU); triton_generic's key model separates every pair of
calls its kernels specialize apart (its launches recorded on the CPU); and on a GPU, after
warmup(), 60 random ragged batches compile nothing."""

import dataclasses
import random
import re
import types

import pytest
import torch

from gdn_dispatch.contract import GDNInputError, make_problem
from gdn_dispatch.device import CPU, assumed_device
from gdn_dispatch.testing import runnable_gpu_backends
from gdn_dispatch.warmup import CompileCounter, warmup
from gdn_dispatch.context_parallel import plan_for_problem
from gdn_dispatch.warmup_plan import (
    LAST_LENGTHS, LONG_LENGTH, WarmupCall, WarmupSpec, call_keys, candidate_calls, choose_backend, make_call,
    plan_warmup, segment_counts, segmented_call, specialization_keys, state_variants,
)
from gdn_dispatch.warmup_plan import random_ragged_stream as random_stream

QWEN35 = dict(H=16, HV=32, K=128, V=128)
SMALL = dict(H=2, HV=4, K=64, V=128)
CASES = [
    pytest.param("sm_90", QWEN35, True, id="sm90-qwen35-l2"),
    pytest.param("sm_90", SMALL, False, id="sm90-small"),
    pytest.param("sm_100", QWEN35, True, id="sm100-qwen35-l2"),
    pytest.param("sm_80", SMALL, False, id="sm80-small"),
]


@pytest.mark.parametrize("arch, dims, l2", CASES)
def test_plan_covers_every_specialization_of_a_random_stream(arch, dims, l2):
    device = assumed_device(arch)
    spec = WarmupSpec(**dims, use_qk_l2norm=l2, max_num_seqs=48)
    plan = plan_warmup(spec, device)
    # Greedy cover: each chosen call adds at least one specialization.
    assert plan.keys and not plan.unadmitted and len(plan.calls) <= len(plan.keys)
    assert_plan_covers(plan, spec, device, random_stream(60, seed=7, spec=spec))


def test_plan_covers_the_picked_plans_where_the_tuning_picks(monkeypatch):
    """16/32 heads on one long prompt: no picked plan under the default tuning, so nothing of
    the census to warm; under ``PICKING`` the plan compiles the census and both plans' launches
    (every launch of a picked call runs), and a stream of long prompts compiles nothing more."""
    from gdn_dispatch import context_parallel
    from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache

    device = assumed_device("sm_90")
    spec = WarmupSpec(**QWEN35, use_qk_l2norm=True, max_num_seqs=3)
    long = [WarmupCall(lengths, None, output_final_state=final, **state)
            for lengths in ((8192 + 17,), (20000,), (32768,), (64, 16384 + 5))
            for final in (True, False) for state in state_variants(spec)]
    kernels = lambda plan: {key[1][0] for key in plan.keys}  # noqa: E731
    assert "warm_census" not in kernels(plan_warmup(spec, device))
    monkeypatch.setattr(context_parallel, "TUNING", context_parallel.PICKING)
    clear_plan_cache()
    try:
        assert all(call_keys(spec, call, device)[1] for call in long)
        plan = plan_warmup(spec, device)
        assert "warm_census" in kernels(plan)
        assert_plan_covers(plan, spec, device, long + random_stream(20, seed=3, spec=spec))
    finally:
        clear_plan_cache()


def assert_plan_covers(plan, spec: WarmupSpec, device, stream, backend: str | None = None) -> None:
    """Every call of ``stream`` runs on a backend of ``plan`` and compiles nothing it lacks."""
    for i, call in enumerate(stream):
        chosen, keys = call_keys(spec, call, device, backend)
        missing = keys - plan.keys
        assert chosen in plan.backends and keys, f"batch {i} ({call.label()}) ran on {chosen}"
        assert not missing, f"batch {i} ({call.label()}) would compile {sorted(map(str, missing))}"


def test_pool_calls_go_where_the_registry_sends_them():
    """A plan covers each call class on the backend the registry picks for it: on sm_90, pool
    calls run on a backend with state pools, plain calls on the fastest one."""
    from gdn_dispatch.registry import load_registry

    device = assumed_device("sm_90")
    spec = WarmupSpec(**SMALL, max_num_seqs=4)
    plan = plan_warmup(spec, device)
    with_pools = {row.name for row in load_registry() if "state_pool" in row.features}
    for call, backend in plan.calls:
        if call.pool_dtype is not None:
            assert backend in with_pools, f"{call.label()} planned on {backend}"
    plain = [backend for call, backend in plan.calls if call.pool_dtype is None]
    assert plain and set(plain) <= set(plan.backends)


def test_forced_backend_lists_what_it_cannot_run():
    """Forcing a backend without state pools leaves the pool classes unadmitted, named in
    the plan (such calls raise), not silently planned elsewhere."""
    from gdn_dispatch.registry import load_registry

    rows = {row.name: row for row in load_registry()}
    device = assumed_device("sm_90")
    spec = WarmupSpec(**SMALL, max_num_seqs=4)
    plan = plan_warmup(spec, device, backend="gluon_sm90")
    assert plan.backends == ("gluon_sm90",)
    if "state_pool" in rows["gluon_sm90"].features:
        assert not plan.unadmitted
    else:
        assert plan.unadmitted and all(c.pool_dtype is not None for c in plan.unadmitted)


@pytest.mark.parametrize("dropped, arch", [("final_state", "sm_90"), ("pool_bf16", "sm_90"), ("fused_qkv", "sm_80"),
                                           ("offsets_int64", "sm_90")])
def test_a_narrower_plan_misses_what_it_left_out(dropped, arch):
    """Negative control: a plan without one variant does not cover a stream that uses it
    (token strides on triton_generic, the backend sm_80 gets, whose kernels take them as
    constexprs)."""
    device = assumed_device(arch)
    full = WarmupSpec(**SMALL, max_num_seqs=8)
    narrow = {
        "final_state": dict(final_states=(False,)),
        "pool_bf16": dict(pool_dtypes=(torch.float32,)),
        "fused_qkv": dict(input_layouts=("contiguous",)),
        "offsets_int64": dict(offset_dtypes=(torch.int32,)),
    }[dropped]
    spec = WarmupSpec(**{**SMALL, "max_num_seqs": 8, **narrow})
    plan = plan_warmup(spec, device)
    stream = random_stream(40, seed=3, spec=full)
    uses = {
        "final_state": lambda c: c.output_final_state,
        "pool_bf16": lambda c: c.pool_dtype == torch.bfloat16,
        "fused_qkv": lambda c: c.layout == "fused_qkv",
        "offsets_int64": lambda c: c.lengths is not None and c.offset_dtype == torch.int64,
    }[dropped]
    stream = [c for c in stream if uses(c)]
    assert stream
    assert any(call_keys(full, c, device)[1] - plan.keys for c in stream)


def test_candidates_span_tails_layouts_and_state_sources():
    device = assumed_device("sm_90")
    spec = WarmupSpec(**SMALL)
    calls = candidate_calls(spec, [1, 5], device)
    assert {c.lengths is None for c in calls} == {True, False}
    assert {c.host_offsets for c in calls if c.lengths is not None} == {True, False}
    assert {c.offset_dtype for c in calls if c.lengths is not None} == {torch.int32, torch.int64}
    assert {(c.initial_state, c.output_final_state) for c in calls} == {(a, b) for a in (0, 1) for b in (0, 1)}
    assert {c.pool_dtype for c in calls} == {None, torch.float32, torch.bfloat16}
    # One pool size: no kernel specializes on the row count (test_no_kernel_specializes_on_per_call_counts).
    assert len({c.pool_size for c in calls if c.pool_dtype is not None}) == 1
    assert {c.layout for c in calls} == {"contiguous", "fused_qkv"}
    tails = {c.tokens % 64 != 0 for c in calls}
    assert tails == {True, False} and {c.N for c in calls} == {1, 5}
    assert 64 in LAST_LENGTHS and any(n % 64 for n in LAST_LENGTHS)


def test_segmented_candidates_only_where_context_parallel_cuts():
    """Segmented calls are candidates at the N where the context-parallel planner can segment
    (few sequences x heads on many SMs), and only there; each runs segmented, over as many
    segment slots as it was built for."""
    device = assumed_device("sm_90")
    spec = WarmupSpec(**SMALL, pool_dtypes=(), input_layouts=("contiguous",))
    segmented = [c for c in candidate_calls(spec, list(range(1, 65)), device) if c.context_parallel != "auto"]
    # N x 4 v-heads x 2 V blocks programs below a quarter of 132 SMs: N <= 4.
    assert {1, 4} <= {c.N for c in segmented} and 5 not in {c.N for c in segmented}
    for call in segmented[:4]:
        problem = make_problem(**make_call(spec, call))
        plan = plan_for_problem(problem, device.sm_count)
        assert plan.enabled and plan.seg_len == 64 and plan.num_segments > call.N


def test_segment_counts_span_the_state_kernels_tile_choices():
    """triton_generic's segmented calls of SMALL dims on sm_90 run the state kernel over few
    segments (BV 32), more (BV 64, three stages) and enough to fill the SMs (BV 64, two
    stages): one segment count per tile choice, each with a key set of its own."""
    device = assumed_device("sm_90")
    spec = WarmupSpec(**SMALL, pool_dtypes=(), input_layouts=("contiguous",))
    counts = segment_counts(spec, 1, device, "triton_generic")
    keys = [call_keys(spec, segmented_call(1, nseg, initial_state=False, output_final_state=True), device,
                      "triton_generic")[1] for nseg in counts]
    configs = {key[1] for keys_ in keys for _, key in keys_ if key[0] == "state_fwd"}
    assert len(counts) == 3 and len(set(keys)) == 3 and len(configs) == 3, configs


def test_plan_runs_the_same_keys_with_fewer_calls():
    device = assumed_device("sm_90")
    spec = WarmupSpec(**QWEN35, max_num_seqs=16)
    plan = plan_warmup(spec, device)
    covered = frozenset().union(*(call_keys(spec, c, device, b)[1] for c, b in plan.calls))
    assert covered == plan.keys
    # Tails and whole chunks, and both state flags, are separate specializations.
    flags = {key[3] for _, key in plan.keys if key[0] == "state_output_fwd"}
    has = {name: {dict(f)[name] for f in flags} for name in ("HAS_TAILS", "USE_H0", "STORE_HT")}
    assert all(values == {True, False} for values in has.values()), has


def test_make_call_builds_valid_calls():
    from gdn_dispatch import chunk_gated_delta_rule

    spec = WarmupSpec(H=2, HV=4, K=8, V=12, dtype=torch.float32, state_layout="vk")
    o, ht = chunk_gated_delta_rule(**make_call(spec, WarmupCall((64, 17), None, True, True), random=True),
                                   backend="reference")
    assert o.shape == (1, 81, 4, 12) and ht.shape == (2, 4, 12, 8) and bool(torch.isfinite(o).all())

    pooled = WarmupCall((5, 0, 70), None, True, False, pool_dtype=torch.bfloat16, pool_size=2, inplace=True,
                        host_offsets=False, layout="fused_qkv")
    kwargs = make_call(spec, pooled, random=True)
    assert "cu_seqlens_cpu" not in kwargs and kwargs["state_indices"].tolist() == [0, 1, -1]
    assert kwargs["q"].stride()[1] == 2 * 2 * 8 + 4 * 12 and kwargs["k"].data_ptr() > kwargs["q"].data_ptr()
    pool = kwargs["initial_state"]
    assert pool.shape == (2, 4, 12, 8) and pool.dtype == torch.bfloat16
    before = pool.clone()
    o, ht = chunk_gated_delta_rule(**kwargs, backend="reference")
    assert ht is None and bool(torch.isfinite(o).all()) and not torch.equal(pool, before)

    wide = make_call(spec, WarmupCall((5, 70), None, True, True, offset_dtype=torch.int64), random=True)
    assert wide["cu_seqlens"].dtype == wide["cu_seqlens_cpu"].dtype == torch.int64
    assert chunk_gated_delta_rule(**wide, backend="reference")[0].shape == (1, 75, 4, 12)


def test_choose_backend_on_cpu_is_the_reference():
    spec = WarmupSpec(H=2, HV=4, K=8, V=12, dtype=torch.float32)
    problem = make_problem(**make_call(spec, WarmupCall((64, 1), None, True, True)))
    assert choose_backend(problem, CPU) == "reference"
    assert specialization_keys("reference", problem, CPU) == frozenset()


def test_warmup_on_cpu_has_nothing_to_compile():
    report = warmup(num_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=12, dtype=torch.float32, device="cpu")
    assert (report.backends, report.calls, report.compiles) == (("reference",), 0, 0)


def test_cli_warmup_on_cpu(capsys):
    from gdn_dispatch.__main__ import main

    assert main(["warmup", "--heads", "2", "--v-heads", "4", "--head-k-dim", "8", "--head-v-dim", "12",
                 "--dtype", "fp32", "--device", "cpu", "--pool-dtypes", "bf16", "--layouts", "fused_qkv",
                 "--host-offsets", "absent", "--index-dtype", "int64", "--offset-dtypes", "int64", "--quiet"]) == 0
    assert "warmup: reference on cpu: 0 calls" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--pool-dtypes", "fp64"], "--pool-dtypes: expected a comma-separated list"),
    (["--layouts", "packed"], "--layouts: expected a comma-separated list"),
    (["--host-offsets", "sometimes"], "--host-offsets: invalid choice"),
    (["--offset-dtypes", "int16"], "--offset-dtypes: expected a comma-separated list"),
    (["--offset-dtypes", "none"],
     "argument --offset-dtypes: expected a comma-separated list of ['int32', 'int64'], got 'none'"),
    (["--v-heads", "3"], "argument --v-heads: expected a multiple of --heads 2, got 3"),
    (["--heads", "0"], "argument --heads: expected an integer >= 1, got '0'"),
    (["--v-heads", "-4"], "argument --v-heads: expected an integer >= 1, got '-4'"),
    (["--head-k-dim", "512"], "argument --head-k-dim: expected an integer in [1, 256], got '512'"),
    (["--head-v-dim", "0"], "argument --head-v-dim: expected an integer in [1, 256], got '0'"),
    (["--pool-size", "-3"], "argument --pool-size: expected an integer >= 1, got '-3'"),
    (["--max-seqs", "0"], "argument --max-seqs: expected an integer >= 1, got '0'"),
    (["--max-seqs", "-2"], "argument --max-seqs: expected an integer >= 1, got '-2'"),
    (["--max-seqs", "many"], "argument --max-seqs: expected an integer >= 1, got 'many'"),
    (["--layouts", "none"],
     "argument --layouts: expected a comma-separated list of ['contiguous', 'fused_qkv'], got 'none'"),
], ids=lambda x: "-".join(x) if isinstance(x, list) else None)
def test_cli_warmup_rejects_bad_variants(argv, message, capsys):
    from gdn_dispatch.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["warmup", "--heads", "2", "--v-heads", "4", "--device", "cpu", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_spec_rejects_unknown_layouts_and_pool_sizes():
    with pytest.raises(ValueError, match="input_layouts: expected names from"):
        WarmupSpec(**SMALL, input_layouts=("packed",))
    with pytest.raises(ValueError, match="pool_size: expected a row count >= 1, got 0"):
        WarmupSpec(**SMALL, pool_size=0)


@pytest.mark.parametrize("fields, message", [
    pytest.param(dict(H=0), "H (num_heads): expected an int >= 1, got 0", id="H0"),
    pytest.param(dict(HV=-4), "HV (num_v_heads): expected an int >= 1, got -4", id="HV-neg"),
    pytest.param(dict(H=2.0), "H (num_heads): expected an int >= 1, got 2.0", id="H-float"),
    pytest.param(dict(K=512), "K (head_k_dim): expected an int in [1, 256], got 512", id="K512"),
    pytest.param(dict(V=0), "V (head_v_dim): expected an int in [1, 256], got 0", id="V0"),
    pytest.param(dict(max_num_seqs=0), "max_num_seqs: expected an int >= 1, got 0", id="N0"),
    pytest.param(dict(max_num_seqs=-3), "max_num_seqs: expected an int >= 1, got -3", id="N-neg"),
    pytest.param(dict(H=2, HV=3), "HV (num_v_heads): expected a multiple of H (num_heads) = 2, got 3", id="H2-HV3"),
    pytest.param(dict(input_layouts=()), "input_layouts: expected names from ('contiguous', 'fused_qkv'), got ()",
                 id="no-layouts"),
    pytest.param(dict(host_offsets=()), "host_offsets: expected True, False or both, got ()", id="no-host-offsets"),
    pytest.param(dict(host_offsets=("yes",)), "host_offsets: expected True, False or both, got ('yes',)",
                 id="host-offsets-yes"),
    pytest.param(dict(final_states=()), "final_states: expected True, False or both, got ()", id="no-final"),
    pytest.param(dict(initial_states=(), pool_dtypes=()),
                 "initial_states: expected True, False or both where pool_dtypes is empty, got ()", id="no-state"),
    pytest.param(dict(pool_inplace=()),
                 "pool_inplace: expected True, False or both where pool_dtypes names pools, got ()",
                 id="pools-no-inplace"),
    pytest.param(dict(pool_size=-3), "pool_size: expected a row count >= 1, got -3", id="P-neg"),
    pytest.param(dict(offset_dtypes=()), "offset_dtypes: expected dtypes from (torch.int32, torch.int64), got ()",
                 id="no-offset-dtypes"),
    pytest.param(dict(offset_dtypes=(torch.int16,)),
                 "offset_dtypes: expected dtypes from (torch.int32, torch.int64), got (torch.int16,)",
                 id="offsets-int16"),
])
def test_spec_rejects_what_leaves_nothing_to_warm(fields, message):
    """Dims outside the contract and empty variant lists are errors naming the field, at
    the spec (a plan from them would fail deep inside, or plan no calls and report success)."""
    with pytest.raises(GDNInputError, match=re.escape(message) + "$"):
        WarmupSpec(**{**SMALL, **fields})


def test_spec_takes_every_multiple_of_the_heads_and_no_other():
    rng = random.Random(11)
    for _ in range(40):
        H, groups = rng.randint(1, 8), rng.randint(1, 4)
        assert WarmupSpec(H=H, HV=H * groups, K=rng.randint(1, 256), V=rng.randint(1, 256)).HV == H * groups
        if H > 1:
            HV = H * groups + rng.randint(1, H - 1)
            with pytest.raises(GDNInputError, match=re.escape(f"got {HV}") + "$"):
                WarmupSpec(H=H, HV=HV, K=64, V=64)
    # Pool-only and pool-free servers are specs of their own.
    assert WarmupSpec(**SMALL, initial_states=(), pool_dtypes=(torch.bfloat16,)).initial_states == ()
    assert WarmupSpec(**SMALL, pool_dtypes=(), pool_inplace=()).pool_inplace == ()


@pytest.mark.parametrize("fields, message", [
    pytest.param(dict(host_offsets=()), "host_offsets: expected True, False or both, got ()", id="no-host-offsets"),
    pytest.param(dict(num_v_heads=3), "HV (num_v_heads): expected a multiple of H (num_heads) = 2, got 3",
                 id="H2-HV3"),
    pytest.param(dict(max_num_seqs=0), "max_num_seqs: expected an int >= 1, got 0", id="N0"),
    pytest.param(dict(input_layouts=()), "input_layouts: expected names from", id="no-layouts"),
])
def test_warmup_function_checks_its_arguments(fields, message):
    """The Python function gets the spec's checks, on any device (here the CPU, where it
    would otherwise return at once having planned nothing)."""
    with pytest.raises(GDNInputError, match=re.escape(message)):
        warmup(**{**dict(num_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=12, dtype=torch.float32,
                         device="cpu"), **fields})


# --- triton_generic's key model against its real launches ---------------------------------

#: A stand-in device for the recorded launches: CPU tensors (the interpreter runs nothing
#: here; the launches are recorded), with an SM count that makes context parallelism cut
#: few sequences' long prompts and the state kernel's tiles follow the programs it has.
MODEL_DEVICE = dataclasses.replace(CPU, sm_count=48)


def recorded_launches(problem, monkeypatch) -> frozenset:
    """Every launch triton_generic's host code makes for ``problem`` (CPU tensors) on
    :data:`MODEL_DEVICE`, recorded instead of run: kernel, warps, stages and the
    specialization Triton's own binder computes from the arguments (each constexpr's value,
    pointer dtypes and alignment, integer classes where the kernel does not mark the
    integer ``do_not_specialize``)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import create_function_from_signature

    from gdn_dispatch.backends.triton_generic import _jit
    from gdn_dispatch.backends.triton_generic.forward import forward

    seen = set()

    def record(kernel, *args, grid, warmup, **kwargs):
        assert not args, "triton_generic launches with keyword arguments only"
        binder = create_function_from_signature(kernel.signature, kernel.params, BaseBackend)
        _, specialization, options = binder(**kwargs)
        spec = tuple((p.name, repr(value)) for p, value in zip(kernel.params, specialization))
        seen.add((kernel.fn.__name__, options.get("num_warps"), options.get("num_stages"), spec))

    with monkeypatch.context() as patch:
        patch.setattr(_jit.Kernel, "run", record)
        forward(problem, types.SimpleNamespace(device=MODEL_DEVICE))
    return frozenset(seen)


MODEL_SPEC = WarmupSpec(H=1, HV=2, K=16, V=32, max_num_seqs=20)
#: Long prompts of the checked stream: from the shortest the planner segments (16 chunks)
#: to 64 times the usual long prompt (the planner wants 4 chunks per program, and without a
#: host copy of cu_seqlens it sees the mean length), so segmented calls run over few to
#: many segments.
MODEL_LONG = (16 * 64, 64 * LONG_LENGTH)


def uncovered_launches(spec, monkeypatch) -> list[str]:
    """The recorded launches of a random stream that the recorded launches of triton_generic's
    warm-up plan (planned from the key model) do not include: each would compile."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the registry admits triton_generic on CPU tensors
    plan = plan_warmup(spec, MODEL_DEVICE, "triton_generic")
    assert plan.calls and not plan.unadmitted

    def launches(call):
        return recorded_launches(make_problem(**make_call(spec, call)), monkeypatch)

    covered = frozenset().union(*(launches(call) for call, _ in plan.calls))
    stream = random_stream(400, seed=5, spec=spec, max_len=150, long_len=MODEL_LONG)
    segmented = [c for c in stream
                 if plan_for_problem(make_problem(**make_call(spec, c)), MODEL_DEVICE.sm_count).enabled]
    assert len(segmented) >= 3, "the stream must run some calls over segments"
    missing = []
    for i, call in enumerate(stream):
        missing += [f"batch {i} ({call.label()}): {launch[0]}" for launch in launches(call) - covered]
    return missing


def test_triton_generic_warmup_plan_covers_the_launches_of_a_stream(monkeypatch):
    """Every launch of a random stream, as triton_generic's host code makes it and Triton's
    binder specializes it, is one the warm-up plan's calls make: the key model misses
    nothing the kernels specialize on (segmented long prompts included)."""
    assert not uncovered_launches(MODEL_SPEC, monkeypatch)


@pytest.mark.parametrize("blind_to", ["token_strides", "segment_counts", "per_call_counts"])
def test_key_model_check_catches_a_blind_model(blind_to, monkeypatch):
    """Negative controls: a key model blind to token strides plans no fused-projection
    launch; one that warms a single segment count misses the state kernel's tiles over more
    segments; and kernels that specialized on per-call counts (sequences, segments, pool
    rows) would compile launches no plan can name. The check above finds each."""
    from gdn_dispatch import warmup_plan
    from gdn_dispatch.backends.triton_generic import _jit

    if blind_to == "token_strides":
        monkeypatch.setattr(warmup_plan, "token_rows_stride", lambda t: 0)
        monkeypatch.setattr(warmup_plan, "call_facts", lambda problem: ())
    elif blind_to == "segment_counts":
        counts = warmup_plan.segment_counts.__wrapped__
        monkeypatch.setattr(warmup_plan, "segment_counts", lambda *a: counts(*a)[:1])
    else:
        for kernel in _triton_generic_kernels():
            for param in kernel.params:
                monkeypatch.setattr(param, "do_not_specialize", False)
    assert uncovered_launches(MODEL_SPEC, monkeypatch)


def with_offsets(kwargs: dict, dtype: torch.dtype) -> dict:
    """``kwargs`` with ``cu_seqlens`` (and its host copy, where given) of ``dtype``."""
    return {**kwargs, **{name: kwargs[name].to(dtype) for name in ("cu_seqlens", "cu_seqlens_cpu") if name in kwargs}}


def test_triton_generic_warmup_plan_covers_int64_offsets(monkeypatch):
    """Every kernel takes cu_seqlens as a pointer (without a pool, in the state_indices slot
    too), and Triton compiles one variant per pointer dtype: the launches of random varlen
    calls with int64 offsets, plain, pooled and segmented, are all among the launches of
    the default plan's calls."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = WarmupSpec(H=1, HV=2, K=16, V=32, max_num_seqs=8)
    plan = plan_warmup(spec, MODEL_DEVICE, "triton_generic")

    def launches(kwargs):
        return recorded_launches(make_problem(**kwargs), monkeypatch)

    covered = frozenset().union(*(launches(make_call(spec, call)) for call, _ in plan.calls))
    stream = [c for c in random_stream(60, seed=17, spec=spec, max_len=150, long_len=MODEL_LONG) if c.lengths]
    assert {c.pool_dtype is None for c in stream} == {True, False} and {c.host_offsets for c in stream} == {True, False}
    missing = []
    for i, call in enumerate(stream):
        kwargs = with_offsets(make_call(spec, call), torch.int64)
        missing += [f"batch {i} ({call.label()}): {launch[0]}" for launch in launches(kwargs) - covered]
    assert not missing, missing


@pytest.mark.parametrize("backend, arch", [("triton_generic", None), ("gluon_sm90", "sm_90")])
def test_key_model_tells_offset_dtypes_apart(backend, arch, monkeypatch):
    """int32 and int64 cu_seqlens are different specializations in the key model, the plan
    warms both (make_call builds the int64 ones), and offsets given as a list take the
    int32 keys."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    device = MODEL_DEVICE if arch is None else assumed_device(arch)
    spec = WarmupSpec(H=2, HV=4, K=128, V=128, max_num_seqs=4)
    plan = plan_warmup(spec, device, backend)
    for call in (WarmupCall((64, 17), None, True, True),
                 WarmupCall((5, 70), None, True, False, pool_dtype=torch.bfloat16, pool_size=17, inplace=True)):
        kwargs = make_call(spec, call)
        keys32 = specialization_keys(backend, make_problem(**kwargs), device)
        keys64 = specialization_keys(backend, make_problem(**with_offsets(kwargs, torch.int64)), device)
        built64 = make_call(spec, dataclasses.replace(call, offset_dtype=torch.int64))
        assert keys32 and keys32 != keys64
        assert specialization_keys(backend, make_problem(**built64), device) == keys64
        assert keys32 | keys64 <= plan.keys
        listed = {**kwargs, "cu_seqlens": kwargs["cu_seqlens"].tolist()}
        del listed["cu_seqlens_cpu"]
        assert specialization_keys(backend, make_problem(**listed), device) == keys32


def _triton_generic_kernels():
    from gdn_dispatch.backends.triton_generic import aot

    return {k.fn for k in aot.kernels_for_aot()}


def test_no_kernel_specializes_on_per_call_counts():
    """The integers that change from call to call (sequences, segment slots, segment length,
    pool rows) are ``do_not_specialize`` wherever a kernel takes them at run time, so a
    serving stream compiles one variant whatever they are (the warm-up plans one pool size)."""
    import importlib

    from gdn_dispatch.registry import load_registry

    per_call = {"N", "NSEG", "L", "P", "pool_size"}
    kernels = set(_triton_generic_kernels())
    for row in load_registry():
        if row.name.startswith("gluon"):
            kernels |= {k.fn for k in importlib.import_module(row.module).kernels_for_aot()}
    checked = 0
    for fn in kernels:
        for param in fn.params:
            if param.name in per_call and not param.is_constexpr:
                checked += 1
                assert param.do_not_specialize, f"{fn.fn.__name__} specializes on {param.name}"
    assert checked >= 8


#: Few sequences on 4 v-heads, half the ragged batches with one prompt of 1k to 16k tokens:
#: the stream of the GPU tier's segmented warm-up check.
SEGMENTED_SPEC = WarmupSpec(H=2, HV=4, K=128, V=128, max_num_seqs=4)


def segmented_stream():
    return random_stream(40, seed=13, spec=SEGMENTED_SPEC, max_len=600, long_len=(1024, 16384), long_share=0.5)


def test_segmented_stream_spans_segment_counts_on_an_h200():
    """The GPU check below is only as good as its stream: on an H200 (132 SMs) the automatic
    rule must cut its long prompts into at least three different segment slot counts."""
    counts = set()
    for call in segmented_stream():
        if call.lengths is None or max(call.lengths) < 1024:
            continue
        problem = make_problem(**make_call(SEGMENTED_SPEC, call, "cpu"))
        cp = plan_for_problem(problem, sm_count=132)
        if cp.enabled:
            counts.add(cp.num_segments)
    assert len(counts) >= 3, f"segment slot counts: {sorted(counts)}"


@pytest.mark.parametrize("backend", [None, "triton_generic"], ids=lambda b: b or "registry-choice")
def test_plan_covers_the_segmented_stream(backend):
    """On an H200's SM count the plan covers the segmented stream's launches too: pass 2's
    configuration follows the segment slot count, pass 1 the inputs' strides."""
    device = assumed_device("sm_90")
    plan = plan_warmup(SEGMENTED_SPEC, device, backend=backend)
    assert_plan_covers(plan, SEGMENTED_SPEC, device, segmented_stream(), backend)


def test_plan_covers_prompts_of_whole_segments():
    """Prompts whose lengths are multiples of the segment length leave an empty slot past
    their end, and pass 2 then sizes its V-block on the slots with tokens (16 segments of
    32768 tokens on 4 v-heads: BV 64, not the 128 the 17 slots alone give): the plan
    covers those calls too, with and without host offsets (without them every slot counts)."""
    device = assumed_device("sm_90")
    plan = plan_warmup(SEGMENTED_SPEC, device)
    stream = [WarmupCall((length,), None, initial_state=True, output_final_state=True, host_offsets=host)
              for length in (16384, 32768) for host in (True, False)]
    stream += [WarmupCall((2048, 0, 8192), None, initial_state=True, output_final_state=True),
               WarmupCall(None, (2, 16384), initial_state=True, output_final_state=True)]
    assert_plan_covers(plan, SEGMENTED_SPEC, device, stream)


# --- GPU tier ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", [None, *runnable_gpu_backends()], ids=lambda b: b or "registry-choice")
def test_after_warmup_a_random_ragged_stream_compiles_nothing(backend, capsys):
    """60 random ragged batches (plain, pooled with -1 rows, fused-projection views, both
    varlen forms) after warmup() with the same variants: no compile."""
    from gdn_dispatch import chunk_gated_delta_rule
    from gdn_dispatch.device import default_probe

    max_num_seqs = 32
    report = warmup(num_heads=QWEN35["H"], num_v_heads=QWEN35["HV"], head_k_dim=QWEN35["K"], head_v_dim=QWEN35["V"],
                    backend=backend, max_num_seqs=max_num_seqs)
    with capsys.disabled():
        print(f"\n{report.format()}")
    spec = WarmupSpec(**QWEN35, max_num_seqs=max_num_seqs)
    device = default_probe().for_torch_device(torch.device("cuda"))
    compiled, ran = [], 0
    with CompileCounter() as counter:
        for i, call in enumerate(random_stream(60, seed=11, spec=spec, max_len=600)):
            kwargs = make_call(spec, call, "cuda", random=True, seed=i)
            if backend is not None and choose_backend(make_problem(**kwargs, backend=backend), device, backend) is None:
                continue  # the forced backend does not run this call class (it would raise)
            before = counter.count
            chunk_gated_delta_rule(**kwargs, backend=backend)
            ran += 1
            if counter.count != before:
                compiled.append(f"batch {i} ({call.label()}): {counter.kernels[before:]}")
        torch.cuda.synchronize()
    assert ran >= 30, f"only {ran} of 60 batches run on {backend}"
    assert counter.count == 0, f"{counter.count} compiles after warm-up: {compiled}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", [None, "triton_generic"], ids=lambda b: b or "registry-choice")
def test_after_warmup_segmented_long_prompts_compile_nothing(backend, capsys):
    """Few sequences with long prompts (1k to 16k tokens) on 4 v-heads: context parallelism
    cuts them into few to many segments; after warmup() none of 40 such batches compiles."""
    from gdn_dispatch import chunk_gated_delta_rule
    from gdn_dispatch.device import default_probe

    spec = SEGMENTED_SPEC
    report = warmup(num_heads=spec.H, num_v_heads=spec.HV, head_k_dim=spec.K, head_v_dim=spec.V,
                    backend=backend, max_num_seqs=spec.max_num_seqs)
    with capsys.disabled():
        print(f"\n{report.format()}")
    device = default_probe().for_torch_device(torch.device("cuda"))
    compiled, segmented = [], set()
    with CompileCounter() as counter:
        for i, call in enumerate(segmented_stream()):
            kwargs = make_call(spec, call, "cuda", random=True, seed=i)
            problem = make_problem(**kwargs, backend=backend)
            cp = plan_for_problem(problem, device.sm_count)
            if cp.enabled:
                segmented.add(cp.num_segments)
            before = counter.count
            chunk_gated_delta_rule(**kwargs, backend=backend)
            if counter.count != before:
                compiled.append(f"batch {i} ({call.label()}, {cp.describe()}): {counter.kernels[before:]}")
        torch.cuda.synchronize()
    assert len(segmented) >= 3, f"segment slot counts seen: {sorted(segmented)}"
    assert counter.count == 0, f"{counter.count} compiles after warm-up: {compiled}"


def test_compile_counter_sees_a_triton_compile():
    """The counter the GPU test relies on counts a real triton.compile (here ahead of time
    for sm_90, which needs no GPU): a compile after warm-up could not go unseen."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def _copy_kernel(src, dst, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs))

    source = ASTSource(_copy_kernel, signature={"src": "*fp32", "dst": "*fp32", "BLOCK": "constexpr"},
                       constexprs={"BLOCK": 16})
    with CompileCounter() as counter:
        triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert counter.count == 1
    assert counter.kernels == ["_copy_kernel(BLOCK=16)"], counter.kernels
