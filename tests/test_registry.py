"""Dispatch: the registry's choice per architecture, GDN_BACKEND, versions, features."""

import dataclasses

import pytest
import torch

from gdn_dispatch import GDNDispatchError, chunk_gated_delta_rule, registry
from gdn_dispatch.contract import make_problem
from gdn_dispatch.device import CPU, assumed_device
from gdn_dispatch.registry import (
    QWEN35_CALL,
    CallSpec,
    _call_key,
    explain,
    load_registry,
    parse_override,
    select,
    version_reason,
)
from gdn_dispatch.device import use_probe
from gdn_dispatch.testing import StandInProbe, padded_pool, random_call

NAMES = [r.name for r in load_registry()]

# What each architecture gets for a Qwen3.5-shaped bf16 call with the backends that exist.
EXPECTED_CHOICE = {
    "sm_75": "reference",  # below triton_generic's sm_80 floor: the torch oracle is the last resort
    "sm_80": "triton_generic",
    "sm_86": "triton_generic",
    "sm_89": "triton_generic",
    "sm_90": "gluon_sm90",  # measured faster than triton_generic on the H200
    "sm_100": "gluon_sm100",
    "sm_103": "gluon_sm100",
    "sm_120": "triton_generic",  # consumer Blackwell: no TMEM, never gluon_sm100
    "cpu": "reference",
}


def _row(name):
    return next(r for r in load_registry() if r.name == name)


def _verdict(explanation, name):
    return next(v for v in explanation.verdicts if v.name == name)


@pytest.mark.parametrize("arch, expected", EXPECTED_CHOICE.items())
def test_dispatch_matrix(arch, expected):
    explanation = explain(assumed_device(arch), QWEN35_CALL, env={})
    assert explanation.selected == expected, explanation.format()
    assert explanation.format().splitlines()[-1] == f"selected: {expected}"


@pytest.mark.parametrize("arch", ["sm_120", "sm_121", "sm_90", "sm_89"])
def test_gluon_sm100_never_matches_other_parts(arch):
    verdict = _verdict(explain(assumed_device(arch), QWEN35_CALL, env={}), "gluon_sm100")
    assert verdict.status == "rejected"
    assert "needs compute capability in {sm_100, sm_103}" in verdict.reason


def test_every_row_has_a_verdict_with_reason():
    explanation = explain(assumed_device("sm_90"), QWEN35_CALL, env={})
    assert [v.name for v in explanation.verdicts] == NAMES
    assert all(v.reason for v in explanation.verdicts)


def test_missing_module_is_not_available_and_selection_moves_on():
    ghost = dataclasses.replace(_row("triton_generic"), name="ghost", module="gdn_dispatch.backends.not_written_yet", priority=999)
    rows = (ghost, *load_registry())
    explanation = explain(assumed_device("sm_90"), QWEN35_CALL, env={}, rows=rows)
    verdict = _verdict(explanation, "ghost")
    assert verdict.status == "not available"
    assert "ModuleNotFoundError" in verdict.reason and "gdn_dispatch.backends.not_written_yet" in verdict.reason
    assert explanation.selected != "ghost"


def test_version_requirement_rejects_old_triton():
    row = _row("triton_generic")
    assert version_reason(row, {"triton": "3.5.1"}) == "needs triton>=3.6, found 3.5.1"
    assert version_reason(row, {"triton": None}) == "needs triton>=3.6, which is not installed"
    assert version_reason(row, {"triton": "3.6.0"}) is None
    explanation = explain(assumed_device("sm_90"), QWEN35_CALL, env={}, versions={"triton": "3.4.0", "torch": "2.9.0"})
    assert _verdict(explanation, "triton_generic").reason == "needs triton>=3.6, found 3.4.0"
    assert explanation.selected == "reference"


@pytest.mark.parametrize(
    "call, backend, reason",
    [
        (CallSpec(dtype="float32"), "gluon_sm100", "q/k/v dtype float32 not in ['bfloat16', 'float16']"),
        (CallSpec(K=96), "gluon_sm100", "needs K in {64, 128}, got 96"),
        (CallSpec(V=256), "gluon_sm100", "needs V in {64, 128}, got 256"),
    ],
)
def test_call_features_reject(call, backend, reason):
    explanation = explain(assumed_device("sm_100"), call, env={})
    assert _verdict(explanation, backend).reason == reason
    assert explanation.selected != backend


@pytest.mark.parametrize(
    "value, expected",
    [
        ("triton_generic", {"*": "triton_generic"}),
        (" reference ", {"*": "reference"}),
        ("cuda:0=gluon_sm100,cuda:1=triton_generic,cpu=reference",
         {"cuda:0": "gluon_sm100", "cuda:1": "triton_generic", "cpu": "reference"}),
        ("cuda=triton_generic", {"cuda": "triton_generic"}),
        ("", {}),
    ],
)
def test_parse_override(value, expected):
    assert parse_override(value, NAMES) == expected


@pytest.mark.parametrize(
    "value, message",
    [
        ("cutlass", r"unknown backend 'cutlass'; valid names: " + ", ".join(NAMES)),
        ("cuda:0=gluon_sm100,cuda:1", r"malformed entry 'cuda:1'"),
        ("cuda:0=", r"malformed entry 'cuda:0='"),
        ("gpu0=reference", r"unknown device 'gpu0'"),
        ("cuda:x=reference", r"unknown device 'cuda:x'"),
        ("cpu=reference,cpu=reference", r"device 'cpu' given twice"),
        ("cpu=cutlass", r"unknown backend 'cutlass'"),
    ],
)
def test_parse_override_errors(value, message):
    with pytest.raises(GDNDispatchError, match=message):
        parse_override(value, NAMES)


def test_override_per_device():
    env = {"GDN_BACKEND": "cuda:0=reference,cuda:1=triton_generic"}
    dev0 = assumed_device("sm_100")
    dev1 = dataclasses.replace(dev0, index=1)
    assert explain(dev0, QWEN35_CALL, env=env).selected == "reference"
    assert explain(dev1, QWEN35_CALL, env=env).selected == "triton_generic"
    # cuda:2 has no entry: automatic choice
    dev2 = dataclasses.replace(dev0, index=2)
    assert explain(dev2, QWEN35_CALL, env=env).forced is None


def test_forced_backend_that_cannot_run_raises_with_reason(monkeypatch):
    monkeypatch.setenv("GDN_BACKEND", "triton_generic")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    call = random_call(batch=(1, 8), K=8, V=8, dtype=torch.float32)
    with pytest.raises(GDNDispatchError, match=r"backend 'triton_generic' \(forced by GDN_BACKEND='triton_generic'\) "
                                               r"cannot run this call on cpu \(cpu\): needs a CUDA device"):
        chunk_gated_delta_rule(**call)


def test_forced_argument_wins_over_env(monkeypatch):
    monkeypatch.setenv("GDN_BACKEND", "triton_generic")
    call = random_call(batch=(1, 8), K=8, V=8, dtype=torch.float32)
    o, _ = chunk_gated_delta_rule(**call, backend="reference")
    assert o.shape == (1, 8, 4, 8)


def test_malformed_env_raises_at_call_time(monkeypatch):
    call = random_call(batch=(1, 8), K=8, V=8, dtype=torch.float32)
    monkeypatch.setenv("GDN_BACKEND", "cpu=")
    with pytest.raises(GDNDispatchError, match="malformed entry"):
        chunk_gated_delta_rule(**call)
    monkeypatch.setenv("GDN_BACKEND", "cpu=reference")
    chunk_gated_delta_rule(**call)


def test_interpreter_admits_triton_generic_on_cpu_only_when_forced():
    env = {"TRITON_INTERPRET": "1"}
    assert explain(CPU, QWEN35_CALL, env=env).selected == "reference"
    forced = explain(CPU, QWEN35_CALL, env=env, backend="triton_generic")
    assert _verdict(forced, "triton_generic").status in ("selected", "not available")


def test_select_returns_module_with_forward():
    call = random_call(batch=(1, 8), K=8, V=8, dtype=torch.float32)
    selection = select(CPU, make_problem(**call), env={})
    assert selection.spec.name == "reference" and callable(selection.module.forward)


def test_select_keeps_the_static_choice_and_rechecks_each_problem(monkeypatch):
    # Calls of one spec reuse the choice (no per-call explanation of every row) ...
    first = select(CPU, make_problem(**random_call(batch=(1, 8), K=8, V=8, dtype=torch.float32, seed=1)), env={})
    again = select(CPU, make_problem(**random_call(batch=(2, 5), K=8, V=8, dtype=torch.float32, seed=2)), env={})
    assert again is first
    assert select(CPU, make_problem(**random_call(batch=(1, 8), K=8, V=8, dtype=torch.float32)),
                  env={"GDN_BACKEND": "reference"}).explanation.forced == "reference"
    # ... but the chosen module's own check of the problem's tensors runs on every call.
    monkeypatch.setattr(first.module, "unsupported_reason", lambda problem: "tensors misaligned", raising=False)
    with pytest.raises(GDNDispatchError, match="reference: tensors misaligned"):
        select(CPU, make_problem(**random_call(batch=(1, 8), K=8, V=8, dtype=torch.float32)), env={})


def test_confirm_keeps_a_choice_its_module_takes_and_asks_select_otherwise(monkeypatch):
    problem = make_problem(**random_call(batch=(1, 8), K=8, V=8, dtype=torch.float32, seed=4))
    kept = select(CPU, problem, env={})
    asked = []
    monkeypatch.setattr(registry, "select", lambda *args, **kwargs: asked.append(args) or "selected anew")
    assert registry.confirm(kept, CPU, problem) is kept and asked == []
    monkeypatch.setattr(kept.module, "unsupported_reason", lambda p: "tensors misaligned", raising=False)
    assert registry.confirm(kept, CPU, problem) == "selected anew" and asked == [(CPU, problem)]


def test_the_selection_cache_key_tells_apart_every_call_spec():
    """select() keys its cache by a plain tuple instead of a CallSpec: calls that differ in
    any CallSpec field must differ in the key (else one call class would get another's
    backend), over random variations of every field."""
    import random

    rng = random.Random(3)
    seen: dict[tuple, CallSpec] = {}
    specs = set()
    for i in range(120):
        H = rng.choice([1, 2])
        shape = dict(lengths=[5, 9]) if rng.random() < 0.5 else dict(batch=(2, 7))
        call = random_call(**shape, H=H, HV=H * rng.choice([1, 2]), K=rng.choice([16, 32]), V=rng.choice([16, 32]),
                           dtype=rng.choice([torch.bfloat16, torch.float16]), seed=i,
                           initial_state=rng.random() < 0.5, state_layout=rng.choice(["kv", "vk"]))
        pool = {}
        if rng.random() < 0.3:
            HV, K, V = call["v"].shape[2], call["q"].shape[3], call["v"].shape[3]
            N = call["initial_state"].shape[0] if call["initial_state"] is not None else 2
            dims = (K, V) if call["state_layout"] == "kv" else (V, K)
            rows, idx, _ = padded_pool(N, HV, dims, torch.float32, seed=i, device="cpu")
            pool = dict(initial_state=rows, state_indices=idx, inplace_final_state=rng.random() < 0.5)
        problem = make_problem(**{**call, **pool}, output_final_state=rng.random() < 0.5,
                               use_qk_l2norm_in_kernel=rng.random() < 0.5,
                               context_parallel=rng.choice(["auto", "off", 2]))
        spec, key = CallSpec.from_problem(problem), _call_key(problem)
        assert seen.setdefault(key, spec) == spec, (key, spec, seen[key])
        specs.add(spec)
    assert len(specs) >= 40 and any(spec.state_pool for spec in specs)


def test_explain_takes_the_call_from_the_problem():
    problem = make_problem(**random_call(lengths=[5, 70], H=2, HV=4, K=8, V=16, dtype=torch.float32, seed=5,
                                         state_layout="vk"), output_final_state=False)
    explanation = explain(assumed_device("sm_90"), problem=problem, env={})
    assert explanation.call == CallSpec.from_problem(problem) != QWEN35_CALL
    assert _verdict(explanation, "gluon_sm90").reason == "q/k/v dtype float32 not in ['bfloat16', 'float16']"
    assert explain(assumed_device("sm_90"), env={}).call == QWEN35_CALL
    mismatch = r"call: CallSpec\(dtype='bfloat16'.* is not the problem's CallSpec\(dtype='float32'"
    with pytest.raises(ValueError, match=mismatch):
        explain(assumed_device("sm_90"), QWEN35_CALL, problem=problem, env={})


def test_explain_takes_device_strings_and_torch_devices():
    with use_probe(StandInProbe("sm_90", "sm_100")):
        for device in ("cpu", torch.device("cpu")):
            explanation = explain(device, env={})
            assert explanation.device == CPU and explanation.selected == "reference"
        for device, arch, chosen in (("cuda:1", "sm_100", "gluon_sm100"),
                                     (torch.device("cuda", 0), "sm_90", "gluon_sm90")):
            explanation = explain(device, env={})
            assert explanation.device.arch == arch and explanation.selected == chosen
        with pytest.raises(TypeError, match=r"device: expected a DeviceInfo, a torch.device or a device string .*got int"):
            explain(0, env={})
        with pytest.raises(ValueError, match=r"device: expected 'cpu', 'cuda' or 'cuda:N', got 'gpu:0'"):
            explain("gpu:0", env={})
    with pytest.raises(ValueError, match=r"device meta: only cuda and cpu devices are supported"):
        explain("meta", env={})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the case of a machine without CUDA")
def test_current_cuda_device_without_cuda_is_a_value_error():
    # "cuda" with no index asks torch for its current device, which asserts without CUDA.
    with pytest.raises(ValueError, match=r"device cuda: no CUDA device here"):
        explain("cuda", env={})
    from gdn_dispatch.warmup import warmup

    with pytest.raises(ValueError, match=r"device cuda: no CUDA device here"):
        warmup(num_heads=2, num_v_heads=4, head_k_dim=64, head_v_dim=64, device="cuda", progress=False)


def test_registry_rows_are_sorted_and_complete():
    rows = load_registry()
    assert [r.priority for r in rows] == sorted((r.priority for r in rows), reverse=True)
    assert rows[-1].name == "reference" and rows[-1].device == "any"
    assert _row("gluon_sm100").capabilities == ((10, 0), (10, 3))


def test_info_reads_the_probe_in_force(capsys, monkeypatch):
    from gdn_dispatch.__main__ import main
    from gdn_dispatch.device import default_probe, use_probe

    monkeypatch.delenv("GDN_BACKEND", raising=False)
    with use_probe(StandInProbe("sm_100", "sm_120")):
        assert main(["info"]) == 0
    sections = capsys.readouterr().out.split("\n[")[1:]
    assert [s.splitlines()[0].split("]")[0] for s in sections] == ["cuda:0", "cuda:1", "cpu"]
    assert [s.rstrip().splitlines()[-1] for s in sections] == [
        "selected: gluon_sm100", "selected: triton_generic", "selected: reference"]
    assert not isinstance(default_probe(), StandInProbe)  # gone after the block
