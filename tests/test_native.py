"""The native host layer (:mod:`gdn_dispatch.native`): its switch, its Python allocator,
and, built (slow tier: a C++ compile), the same launches and tensors as the Python path.

The built tests compile the module into a temporary cache directory once per test run
(``GDN_SELFTEST_CACHE``), then compare it with the Python launchers and allocator: over the
Gluon host path's ragged stream (launches stubbed, as ``tests/test_gluon_host_path.py``)
every recorded launch is the same; a GuardedLauncher built for one argument list refuses,
launching nothing, every argument of another value class; and the host-path and
kept-launch tests pass with ``GDN_DISPATCH_NATIVE=1`` (the native layer required).
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gdn_dispatch import native

ROOT = Path(__file__).resolve().parents[1]


def _random_specs(rng: random.Random, count: int):
    """Specs of random dims and dtypes, some in one of two allocator groups."""
    dtypes = [None, torch.float32, torch.bfloat16, torch.int32]
    specs = []
    for _ in range(count):
        dims = tuple(rng.choice([-1, -2, -3, -4, -5, -6, rng.randint(0, 5)]) for _ in range(rng.randint(1, 4)))
        group = rng.choice([None, None, 0, 0, 1])
        specs.append((dims, rng.choice(dtypes)) if group is None else (dims, rng.choice(dtypes), group))
    return specs


def _check_allocated(out, specs, like, sizes, carved=False):
    """Each tensor of the spec's shape and dtype, contiguous on like's device; every one
    writable without touching another; with ``carved`` (the native allocator) the specs of
    one group share one allocation, each at a 256-byte boundary, and every other spec has
    its own."""
    assert len(out) == len(specs)
    for t, (dims, dtype, *_) in zip(out, specs):
        assert tuple(t.shape) == tuple(d if d >= 0 else sizes[-d - 1] for d in dims)
        assert t.dtype == (dtype or like.dtype) and t.device == like.device and t.is_contiguous()
    for i, t in enumerate(out):
        t.fill_(i + 1)
    for i, t in enumerate(out):
        assert bool((t == i + 1).all()), f"tensor {i} was overwritten by another"
    if not carved:
        return
    groups = [spec[2] if len(spec) > 2 else None for spec in specs]
    storages = [t.untyped_storage().data_ptr() for t in out]
    for i, (t, group) in enumerate(zip(out, groups)):
        shared = {j for j, other in enumerate(groups) if storages[j] == storages[i] and out[j].numel() and t.numel()}
        if not t.numel():
            continue
        if group is None:
            assert shared == {i}
        else:
            assert shared == {j for j, other in enumerate(groups) if other == group and out[j].numel()}
            assert (t.data_ptr() - storages[i]) % 256 == 0


def test_python_allocator_allocates_each_spec():
    rng = random.Random(3)
    like = torch.randn(2, 3, dtype=torch.float16)
    for _ in range(20):
        specs = _random_specs(rng, rng.randint(1, 5))
        sizes = tuple(rng.randint(0, 7) for _ in range(6))
        _check_allocated(native._python_allocator(specs)(like, *sizes), specs, like, sizes)


def test_switch_and_status(monkeypatch, tmp_path):
    monkeypatch.setenv("GDN_SELFTEST_CACHE", str(tmp_path))
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert native.load() is None and native.status().startswith("off")
    assert native.admission() is None  # the contract then checks every call in Python
    monkeypatch.delenv(native.NATIVE_ENV)
    assert native.load() is None and native.status().startswith("not built")
    # Not built and the Python path serves: the allocator is the Python one.
    assert not hasattr(native.allocator([((1,), None)]), "add_tensor")
    monkeypatch.setenv(native.NATIVE_ENV, "1")
    with pytest.raises(RuntimeError, match="GDN_DISPATCH_NATIVE=1 but the native host layer is not built"):
        native.load()


def test_not_built_says_how_to_build_it_here(monkeypatch, tmp_path):
    """The not-built reason names a way to build the layer that works on this machine:
    warmup builds it only where it has a CUDA device to warm, native.build() anywhere (the
    slow tier's ``native_built`` runs it on CPU-only machines)."""
    monkeypatch.setenv("GDN_SELFTEST_CACHE", str(tmp_path))
    monkeypatch.setenv(native.NATIVE_ENV, "1")
    with pytest.raises(RuntimeError) as raised:
        native.load()
    message = str(raised.value)
    assert "warmup builds it on a CUDA device" in message
    snippet = re.search(r"python -c '([^']+)'", message).group(1)
    assert snippet == "from gdn_dispatch import native; native.build()"
    compile(snippet, "<hint>", "exec")
    from gdn_dispatch.warmup import warmup

    report = warmup(num_heads=1, num_v_heads=1, head_k_dim=8, head_v_dim=8, dtype=torch.float32, device="cpu")
    assert report.native == "" and native.built_path() is None


@pytest.mark.slow
def test_native_allocator_allocates_each_spec(native_built):
    module, _ = native_built
    rng = random.Random(5)
    like = torch.randn(4, dtype=torch.bfloat16)
    for _ in range(60):
        specs = _random_specs(rng, rng.randint(1, 5))
        sizes = tuple(rng.randint(0, 7) for _ in range(6))
        alloc = native.allocator(specs)
        assert isinstance(alloc, module.Allocator)
        _check_allocated(alloc(like, *sizes), specs, like, sizes, carved=True)


def _addresses_numbered(runs: list) -> list:
    """The recorded launches with every address (an int above 2^32: the two runs allocate
    their own buffers, which the host's allocator places differently) replaced, within each
    launch, by the order of its first appearance there."""
    def numbered(run):
        seen: dict[int, str] = {}

        def number(value):
            if isinstance(value, tuple):
                return tuple(number(v) for v in value)
            if isinstance(value, int) and not isinstance(value, bool) and value > 2 ** 32:
                return seen.setdefault(value, f"address{len(seen)}")
            return value

        return number(run)

    return [numbered(run) for run in runs]


@pytest.mark.slow
def test_native_launchers_launch_what_the_python_ones_launch(native_built, monkeypatch):
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import test_gluon_host_path as host_path
    finally:
        sys.path.pop(0)
    from gdn_dispatch.contract import make_problem
    from gdn_dispatch.device import assumed_device
    from gdn_dispatch.backends.gluon_common import forward as F
    from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache

    records, kinds = {}, {}
    for mode in ("0", "1"):
        monkeypatch.setenv(native.NATIVE_ENV, mode)
        clear_plan_cache()
        device = assumed_device("sm_90")
        engine = host_path._engine((9, 0))
        problems = [make_problem(**call) for call in host_path.ragged_calls(40, seed=11, max_len=300)]
        with host_path.stubbed_launches() as launches:
            outs = [F.forward(problem, device, engine=engine) for problem in problems]
            launchers = {type(launch.compiled.get("fast")).__name__
                         for launch in {id(b[1]): b[1] for b in launches.binds}.values()}
        records[mode] = _addresses_numbered(launches.runs)
        kinds[mode] = launchers - {"NoneType"}
        assert all(o.shape[0] == p.B and (f is None or f.shape[0] == p.N) for (o, f), p in zip(outs, problems))
    assert kinds["0"] == {"function"} and kinds["1"] == {"GuardedLauncher"}
    assert len(records["1"]) == len(records["0"]) > 40
    assert records["1"] == records["0"]


@pytest.mark.slow
def test_a_guarded_launcher_refuses_another_value_class(native_built):
    module, _ = native_built
    sent = []
    t = torch.zeros(64, dtype=torch.bfloat16)
    launcher = module.GuardedLauncher(lambda *args: sent.append(args), ("P",), [None] * 6, 0, (4, 2), None, 6)
    launcher.add_tensor("x", 0, torch.bfloat16, t.data_ptr() % 16 == 0)
    launcher.add_int("n", 1, True, False, True, True)      # a multiple of 16, not 1, int32
    launcher.add_int("m", 2, False, False, False, True)    # unspecialized: its int32 range only
    launcher.add_object("flag", 3, module.KIND_IDENTITY, None)
    launcher.add_object("scale", 4, module.KIND_TYPE, float)
    launcher.add_object("BLOCK", 5, module.KIND_EQUAL, 64)
    good = dict(x=t, n=32, m=7, flag=None, scale=0.5, BLOCK=64)
    assert launcher(0, good, None, 1, 2, 3, 99, (4, 2))
    assert sent == [(1, 2, 3, 99, "P", t.data_ptr(), 32, 7, None, 0.5, 64)]
    bad = [dict(good, x=t.float()), dict(good, x=t[1:]), dict(good, x=1), dict(good, n=33), dict(good, n=1),
           dict(good, n=2 ** 40), dict(good, n=True), dict(good, m=2 ** 33), dict(good, flag=t), dict(good, scale=1),
           dict(good, BLOCK=32), {k: v for k, v in good.items() if k != "m"}, dict(good, extra=1)]
    for args in bad:
        assert not launcher(0, args, None, 1, 2, 3, 99, (4, 2)), args
    assert not launcher(1, good, None, 1, 2, 3, 99, (4, 2))  # another device
    assert not launcher(0, good, None, 1, 2, 3, 99, (8, 2))  # other launch options
    assert len(sent) == 1
    # Unspecialized: other values of the same int32 class launch.
    assert launcher(0, dict(good, m=1), None, 1, 1, 1, 99, (4, 2)) and sent[-1][7] == 1


@pytest.mark.slow
def test_host_path_and_kept_launch_tests_pass_on_the_native_layer(native_built):
    _, cache = native_built
    env = {**os.environ, "GDN_SELFTEST_CACHE": str(cache), native.NATIVE_ENV: "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-m", "not gpu",
         "tests/test_gluon_host_path.py", "tests/test_gluon_launch.py", "tests/test_triton_generic.py",
         "-k", "kept or fast or host_path or planned or ragged or stub"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout


@pytest.mark.parametrize("cp_n", ["off", 4, "fused", "fused-t-kernel"])
@pytest.mark.parametrize("layout, final", [("kv", True), ("vk", True), ("kv", False)])
def test_call_buffers_are_what_the_launches_write(cp_n, layout, final, monkeypatch):
    """The Gluon forward's one-call allocation (:func:`.forward.call_buffers`) against the
    shapes and dtypes its launching functions document, for the pipeline, for a
    segmented call and for the warp-specialized path, one launch or (``fused.AUX_T`` off)
    with the T kernel's tiles (with the Python allocator here; the slow tier's native one
    in ``test_call_buffers_native``)."""
    _check_call_buffers(cp_n, layout, monkeypatch, final)


@pytest.mark.slow
def test_call_buffers_native(native_built, monkeypatch):
    module, _ = native_built
    for cp_n, layout in (("off", "kv"), (4, "vk"), ("fused", "kv"), ("fused-t-kernel", "kv")):
        assert isinstance(_check_call_buffers(cp_n, layout, monkeypatch), module.Allocator)


def _check_call_buffers(cp_n, layout, monkeypatch, final=True):
    from gdn_dispatch.contract import make_problem
    from gdn_dispatch.context_parallel import plan_for_problem
    from gdn_dispatch.device import assumed_device
    from gdn_dispatch.testing import random_call
    from gdn_dispatch.backends.gluon_common import forward as F
    from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache, plan

    from gdn_dispatch.backends.gluon_common.wy_t import planned_t_tile_rows
    from gdn_dispatch.backends.gluon_sm90 import fused as fused_module

    # The path forms the chunk inverses in its fused kernel as shipped; "fused-t-kernel":
    # the T kernel writes them into t_tiles first.
    monkeypatch.setattr(fused_module, "AUX_T", cp_n != "fused-t-kernel")
    clear_plan_cache()
    device = assumed_device("sm_90")
    fused = cp_n in ("fused", "fused-t-kernel")
    # The warp-specialized path: K = V = 128 and enough (sequence, v-head) programs.
    lengths, H, HV, K = ([300, 0, 170] * 12, 4, 8, 128) if fused else ([300, 0, 170], 2, 4, 64)
    call = random_call(lengths=lengths, H=H, HV=HV, K=K, V=128, dtype=torch.bfloat16, seed=2, state_layout=layout)
    problem = make_problem(**call, output_final_state=final, context_parallel="off" if fused else cp_n)
    cp = plan_for_problem(problem, device.sm_count)
    assert cp.enabled == (cp_n not in ("off", "fused", "fused-t-kernel"))
    launches = plan(problem, device=device, fused=fused)
    assert launches.fused == fused
    assert launches.inverses_on_chip == (cp_n == "fused")
    t_kernel = fused and not launches.inverses_on_chip
    t_rows = planned_t_tile_rows(launches.stage("wy_t_fwd").shared, problem.B * problem.T, problem.N) if t_kernel else 0
    out = F.call_buffers(problem, launches, cp, t_rows)
    B, T, N, V, S = 1, sum(lengths), len(lengths), 128, cp.num_segments
    bf16, f32 = torch.bfloat16, torch.float32
    if fused:
        # One launch: no T tiles (the fused kernel reads neither them nor g_cum).
        assert (t_rows > 0) == t_kernel
        expected = [((B, T, HV, V), bf16), ((B, T, HV), f32), ((t_rows, 64), bf16)]
    else:
        expected = [((B, T, HV, K), bf16), ((B, T, HV, V), bf16), ((B, T, HV), f32), ((B, T, HV, V), bf16)]
    if cp.enabled:
        expected += [((S + 1,), call["cu_seqlens"].dtype), ((S, HV, K, K), f32), ((S, HV, K, K), bf16),
                     ((S, HV, K, V), f32), ((S, HV, K, V), f32)]
    expected.append((((N, HV, V, K) if layout == "vk" else (N, HV, K, V)), f32) if final else None)
    assert [t if t is None else (tuple(t.shape), t.dtype) for t in out] == expected
    assert all(t is None or t.is_contiguous() for t in out)
    form = ("fused",) if fused else ("segmented", call["cu_seqlens"].dtype, f32) if cp.enabled else ("pipeline",)
    return launches.cls.allocators[form]


def test_warmup_builds_unless_off_and_reports_why_not(monkeypatch, tmp_path):
    from gdn_dispatch.warmup import WarmupReport, build_native

    monkeypatch.setenv("GDN_SELFTEST_CACHE", str(tmp_path))
    built = []
    monkeypatch.setattr(native, "build", lambda log: built.append(log) or None)
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert build_native(progress=False).startswith("off") and not built
    monkeypatch.delenv(native.NATIVE_ENV)
    build_native(progress=False)
    assert len(built) == 1

    def no_compiler(log):
        raise RuntimeError("the native host layer did not build: no C++ compiler")

    monkeypatch.setattr(native, "build", no_compiler)
    line = build_native(progress=False)
    assert line.startswith("not built (the native host layer did not build: no C++ compiler)")
    report = WarmupReport(("gluon_sm90",), "cuda:0", 3, 4, 5, 1.0, native=line)
    assert report.format().endswith(f"; native host layer {line}")


@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("unsegmented, final, layout", [(True, True, "kv"), (True, True, "vk"), (True, False, "kv"),
                                                        (False, True, "kv")])
def test_triton_generic_call_buffers(l2, unsegmented, final, layout):
    """triton_generic's one-call allocation against the shapes its stages document."""
    import importlib

    from gdn_dispatch.context_parallel import plan_for_problem
    from gdn_dispatch.contract import make_problem
    from gdn_dispatch.testing import random_call

    tg_forward = importlib.import_module("gdn_dispatch.backends.triton_generic.forward")
    call = random_call(lengths=[100, 0, 30], H=2, HV=4, K=32, V=48, dtype=torch.float16, seed=4, state_layout=layout)
    problem = make_problem(**call, output_final_state=final, use_qk_l2norm_in_kernel=l2,
                           context_parallel="off" if unsegmented else 2)
    cp = plan_for_problem(problem, 132)
    assert cp.enabled != unsegmented
    out = tg_forward.call_buffers(problem, cp)
    B, T, N, HV, K, V, NS = 1, 130, 3, 4, 32, 48, problem.chunks.num_slots
    S = cp.num_segments
    f16, f32 = torch.float16, torch.float32
    expected = [((B, T, HV), f32), ((B, T, HV), f32) if l2 else None, ((B, T, HV, K), f16), ((B, T, HV, V), f16)]
    if not unsegmented:  # pass 1's and the scan's, then pass 2's h over the segments' chunk slots
        expected += [((S + 1,), call["cu_seqlens"].dtype), ((S, HV, K, K), f32), ((S, HV, K, K), torch.bfloat16),
                     ((S, HV, K, V), f32), ((S, HV, K, V), f32)]
        NS = T // 64 + S
    expected += [((NS, HV, K, V), f16), ((B, T, HV, V), f16), ((B, T, HV, V), f16),
                 (((N, HV, V, K) if layout == "vk" else (N, HV, K, V)), f32) if final else None]
    assert [t if t is None else (tuple(t.shape), t.dtype) for t in out] == expected
    assert all(t is None or t.is_contiguous() for t in out)
