"""The call programs (:mod:`gdn_dispatch.backends.call_program`) of the Gluon forward and of
triton_generic's against their Python paths.

A call program binds the stage wrappers' own argument lists to a call's values in C++;
these tests run each call of a fuzz through both paths, launches stubbed (as in
``test_gluon_host_path.py``; triton_generic's binder and launch site runtime likewise),
and require the same launches: kernel, grid, every argument
of the C launch (pointers compared by which tensor they point at: each path's buffers are
its own), and the outputs returned pointing where the launches wrote. Forms the program
takes (contiguous inputs, a float32 or bfloat16 initial state or state pool, read and
maybe written back in place) must be taken
once the Python path has bound the call's kernels; every other form must be left to the
Python path, with nothing launched by the program. Segmented calls (context parallelism)
likewise, their plain-Triton segment kernels recorded with the Gluon launches. Needs the
native layer built.
"""

from __future__ import annotations

import contextlib
import importlib
import random
from unittest import mock

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from gdn_dispatch import native  # noqa: E402
from gdn_dispatch.contract import make_problem  # noqa: E402
from gdn_dispatch.device import assumed_device  # noqa: E402

from gdn_dispatch.backends import direct_launch  # noqa: E402
from gdn_dispatch.backends.call_program import PROGRAM_CALLS  # noqa: E402
from gdn_dispatch.backends.gluon_common import call_program  # noqa: E402
from gdn_dispatch.backends.gluon_common import compat  # noqa: E402
from gdn_dispatch.backends.gluon_common import forward as F  # noqa: E402
from gdn_dispatch.backends.gluon_common import launch as L  # noqa: E402
from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache  # noqa: E402
from gdn_dispatch.backends.triton_generic import call_program as tg_program  # noqa: E402
from gdn_dispatch.backends.triton_generic import configs as tg_configs  # noqa: E402
TG = importlib.import_module("gdn_dispatch.backends.triton_generic.forward")  # the module (the package exports
# a function of that name)

from test_gluon_host_path import _Compiled, _engine, _raw_launch, stubbed_launches  # noqa: E402

pytestmark = pytest.mark.slow

ADDRESS = 2 ** 32  # CPU heap addresses lie above; no count or size of these calls does


def _random_form(rng: random.Random, head_dims=((128, 128), (128, 128), (64, 128), (128, 64), (64, 64)),
                 dtypes=(torch.bfloat16, torch.float16)) -> tuple[dict, bool]:
    """A random call (CPU tensors, fresh values) and whether a program (and a route) may
    take it."""
    dtype = rng.choice(dtypes)
    H, group = rng.choice([(1, 1), (2, 2), (4, 2), (16, 2), (8, 4)])
    HV = H * group
    K, V = rng.choice(head_dims)
    lengths = [rng.choice([0, 1, 17, 63, 64, 65, 130, 200]) for _ in range(rng.randint(1, 6))]
    lengths[0] = max(lengths[0], 1)  # a call with tokens (an empty one launches nothing)
    varlen = rng.random() < 0.6
    if not varlen:
        lengths = [lengths[0]] * len(lengths)
    T = sum(lengths) if varlen else lengths[0]
    B = 1 if varlen else len(lengths)
    gen = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    q = torch.randn(B, T, H, K, generator=gen).to(dtype)
    k = torch.randn(B, T, H, K, generator=gen).to(dtype)
    v = torch.randn(B, T, HV, V, generator=gen).to(dtype)
    g = -torch.rand(B, T, HV, generator=gen).to(rng.choice([torch.float32, dtype]))
    beta = torch.rand(B, T, HV, generator=gen).to(rng.choice([torch.float32, dtype]))
    call = dict(q=q, k=k, v=v, g=g, beta=beta, output_final_state=rng.random() < 0.7,
                use_qk_l2norm_in_kernel=rng.random() < 0.5, state_layout=rng.choice(["kv", "vk"]),
                scale=rng.choice([None, 0.3]))
    N = len(lengths)
    if varlen:
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        cu_dtype = rng.choice([torch.int32, torch.int64])
        call["cu_seqlens"] = torch.tensor(offsets, dtype=cu_dtype)
        if rng.random() < 0.7:
            call["cu_seqlens_cpu"] = torch.tensor(offsets, dtype=cu_dtype)
    takes = True
    state_shape = (N, HV, K, V) if call["state_layout"] == "kv" else (N, HV, V, K)
    h0 = rng.choice([None, torch.float32, torch.bfloat16, torch.float16])
    if h0 is not None:
        call["initial_state"] = torch.randn(state_shape, generator=gen).to(h0)
        takes = h0 is not torch.float16  # converted to float32 by the Python path
    form = rng.random()
    if form < 0.1:  # q a view of a fused projection's rows, read in place by the Python path
        call["q"] = torch.randn(B, T, 2 * H * K, generator=gen).to(dtype)[..., :H * K].unflatten(-1, (H, K))
        takes = takes and call["q"].is_contiguous()  # one token: a contiguous view
    elif form < 0.15:  # g a view of a wider gate projection, read in place (token stride 2 HV)
        call["g"] = -torch.rand(B, T, 2 * HV, generator=gen)[..., :HV]
        takes = takes and call["g"].is_contiguous()
    elif form < 0.25:  # a state pool (float32 or bfloat16), read in place through state_indices
        pool = torch.randn(N + 3, *state_shape[1:], generator=gen).to(rng.choice([torch.float32, torch.bfloat16]))
        indices = torch.randperm(N + 3, generator=gen)[:N].to(rng.choice([torch.int32, torch.int64]))
        if rng.random() < 0.3:
            indices[rng.randrange(N)] = -1
        call.update(initial_state=pool, state_indices=indices, inplace_final_state=rng.random() < 0.5)
        takes = True
    return call, takes


def _labels(records, outputs, inputs):
    """The launches with each address as the name of its input or the order it first
    appeared in (outputs last)."""
    names = {t.data_ptr(): name for name, t in inputs.items() if isinstance(t, torch.Tensor) and t.numel()}
    seen: dict[int, str] = {}

    def label(x):
        if isinstance(x, tuple):
            return tuple(label(y) for y in x)
        if isinstance(x, int) and not isinstance(x, bool) and x >= ADDRESS:
            if x in names:
                return names[x]
            return seen.setdefault(x, f"buffer{len(seen)}")
        return x

    launches = [(fn.__name__, label(head), label(args)) for fn, head, args in records]
    return launches, [None if t is None else (label(t.data_ptr()), tuple(t.shape), t.dtype) for t in outputs]


@pytest.mark.parametrize("capability, aux_t, small_heads", [((9, 0), False, False), ((10, 0), False, False),
                                                            ((9, 0), True, False), ((9, 0), True, True)],
                         ids=["sm90", "sm100", "sm90-aux-t", "sm90-aux-t-small-heads"])
def test_call_programs_launch_what_the_python_path_launches(native_built, capability, aux_t, small_heads,
                                                             monkeypatch):
    """With ``aux_t`` the warp-specialized path's fused kernel forms the inverses itself
    (:data:`gdn_dispatch.backends.gluon_sm90.fused.AUX_T`, as shipped): its calls are one
    launch, else the T kernel's and the fused kernel's; with
    ``small_heads`` calls with K or V of 64 take the path too (``fused.SMALL_HEADS``)."""
    from gdn_dispatch.backends.gluon_sm90 import fused as fused_module

    monkeypatch.setattr(fused_module, "AUX_T", aux_t)
    monkeypatch.setattr(fused_module, "SMALL_HEADS", small_heads)
    clear_plan_cache()
    device, engine = assumed_device(f"sm_{capability[0]}{capability[1]}"), _engine(capability)
    rng = random.Random(1234 + capability[0])
    paths = {"fused": 0, "pipeline": 0, "refused": 0, "pool": 0, "small heads": 0}
    with stubbed_launches() as stub:
        for i in range(120):
            call, takes = _random_form(rng)
            problem = make_problem(**call)
            expected, got, taken = _both_paths(F, "run_call", lambda: F.forward(problem, device, engine=engine),
                                               stub.runs, problem)
            assert got == expected, f"call {i}: {call.keys()}"
            # the views are read in place
            assert problem.q.is_contiguous() == call["q"].is_contiguous()
            assert problem.g.is_contiguous() == call["g"].is_contiguous()
            assert taken == int(takes), f"call {i}: program taken {taken}, expected {takes}"
            if takes:
                launches = F.plan(problem, device=device, engine=engine)
                fused = launches.fused
                assert launches.inverses_on_chip == (fused and aux_t)
                paths["fused" if fused else "pipeline"] += 1
                paths["small heads"] += fused and (problem.K, problem.V) != (128, 128)
                paths["pool"] += problem.state_indices is not None
            else:
                paths["refused"] += 1
    # The fuzz covered what it is for: both paths where the engine has both, state pools,
    # and refusals.
    assert paths["pipeline"] >= 20 and paths["refused"] >= 10 and paths["pool"] >= 3
    assert paths["fused"] >= (5 if capability == (9, 0) else 0)
    assert (paths["small heads"] >= 3) if small_heads else paths["small heads"] == 0, paths
    clear_plan_cache()


def test_a_refused_check_launches_nothing(native_built):
    """A program whose second launch's guard fails launches neither (all checks first)."""
    clear_plan_cache()
    device, engine = assumed_device("sm_90"), _engine((9, 0))
    call, _ = _random_form(random.Random(5))
    call.pop("state_indices", None)
    call["q"], call["initial_state"] = call["q"].contiguous(), None
    problem = make_problem(**call)
    with stubbed_launches() as stub:
        F.forward(problem, device, engine=engine)
        F.forward(problem, device, engine=engine)
        launches = F.plan(problem, device=device, engine=engine)
        last = launches.launches[-1]
        fast = last.compiled["fast"]

        class Refusing:  # not a GuardedLauncher: the program must refuse before any launch
            def __call__(self, *args):
                return fast(*args)

        stub.runs.clear()
        before = dict(PROGRAM_CALLS)
        module = native.for_calls()
        module.reset_stats(timing=True)
        with mock.patch.dict(last.compiled, {"fast": Refusing()}):
            assert call_program.run_call(problem, launches, engine) is None
        assert stub.runs == []
        assert module.stats()["programs"] == 0
        assert call_program.run_call(problem, launches, engine) is not None
        assert len(stub.runs) == len(launches.launches)
        # bench --host reads these: one refusal, one call taken
        assert PROGRAM_CALLS["refused"] == before.get("refused", 0) + 1
        assert PROGRAM_CALLS["taken"] == before.get("taken", 0) + 1
        # host_parts reads these: the one program run, its phases timed, each descriptor
        # of its launches had once (the same tensors as the call before: reused or found)
        stats = module.stats()
        module.reset_stats()
        descriptors = sum(len(launch.descriptors) for launch in launches.launches)
        assert stats["programs"] == 1 and stats["ns_allocate"] > 0 and stats["ns_launches"] > 0
        assert stats["desc_reused"] + stats["desc_found"] + stats["desc_encoded"] == descriptors


class _TritonRuntime:
    """direct_launch's runtime on the CPU: direct launches, a made-up stream."""

    compat = compat

    def direct(self):
        return True

    def stream(self, device):
        return 1234


@contextlib.contextmanager
def _triton_launch_stubs(runs: list):
    """triton_generic's binder returning a stand-in kernel whose C launch records into
    ``runs``, from fresh launch sites."""
    def jit_launch(kernel, grid, cfg, kwargs):
        return _Compiled(kernel.fn, runs, 0)

    with mock.patch.object(tg_configs, "_jit_launch", jit_launch), \
            mock.patch.object(direct_launch, "_RUNTIME", _TritonRuntime()), \
            mock.patch.object(direct_launch, "_CALL_SITES", {}):
        yield


@contextlib.contextmanager
def stubbed_triton_launches():
    """triton_generic's launches on CPU tensors without the interpreter: Triton's binder
    returns a stand-in kernel whose C launch records (kernel, grid + prefix, arguments)."""
    runs: list = []
    with _triton_launch_stubs(runs), mock.patch.object(compat, "raw_launch", _raw_launch), \
            mock.patch.object(torch.cuda, "current_device", lambda: 0):
        tg_program.clear_programs()
        yield runs
    tg_program.clear_programs()


@contextlib.contextmanager
def stubbed_segmented_launches():
    """The Gluon forward's launches stubbed as :func:`stubbed_launches` does, and the
    plain-Triton segment kernels it launches on a segmented call as
    :func:`stubbed_triton_launches` does, all recorded in one list, in order (the one
    device: CPU tensors, index None)."""
    with stubbed_launches() as stub, _triton_launch_stubs(stub.runs), \
            mock.patch.object(L._RUNTIME, "current_device", lambda: None):
        yield stub


@pytest.mark.parametrize("capability", [(9, 0), (10, 0)])
def test_segmented_call_programs_launch_what_the_python_path_launches(native_built, monkeypatch, capability):
    """Calls with a forced segment count: [qk l2norm,] wy, [qk rnorm,] pass 1, the scan and pass 2 in
    one program, the segment kernels through their plain-Triton launch sites; a ragged batch
    with a host copy of its offsets too (pass 2's plan reads the segment offsets it gives)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    clear_plan_cache()
    device, engine = assumed_device(f"sm_{capability[0]}{capability[1]}"), _engine(capability)
    rng = random.Random(4321 + capability[0])
    count = pools = 0
    with stubbed_segmented_launches() as stub:
        for i in range(60):
            call, takes = _random_form(rng)
            call["context_parallel"] = rng.choice([2, 3, 4])
            problem = make_problem(**call)
            assert F.plan_for_problem(problem, device.sm_count).enabled, f"call {i}"
            expected, got, taken = _both_paths(F, "run_segmented_call",
                                               lambda: F.forward(problem, device, engine=engine), stub.runs, problem)
            launched = [name for name, *_ in got[0]]
            # The qk l2 norm: bf16's reciprocal norms after wy, fp16's normalized copies first.
            l2, half = problem.use_qk_l2norm, problem.q.dtype == torch.float16
            assert launched == (["_qk_l2norm_fwd_kernel"] if l2 and half else []) + ["_wy_fwd_kernel"] + (
                ["_qk_rnorm_fwd_kernel"] if l2 and not half else []) + [
                "_segment_map_fwd_kernel", "_segment_scan_fwd_kernel", "_state_output_fwd_kernel"], f"call {i}"
            assert got == expected, f"call {i}: {call.keys()}"
            assert taken == int(takes), f"call {i}: program taken {taken}, expected {takes}"
            count += takes
            pools += takes and problem.state_indices is not None
    assert 25 <= count <= 55 and pools >= 2  # taken and refused forms both drawn, pools among them


@pytest.mark.parametrize("segmented", [False, True], ids=["unsegmented", "segmented"])
@pytest.mark.parametrize("fused_solve", [True, False])
def test_triton_generic_call_programs_launch_what_the_python_path_launches(native_built, monkeypatch, fused_solve,
                                                                           segmented):
    """Both w/u forms: T formed in the w/u kernel (sm_80..sm_90), or by kkt_solve first
    (sm_100, sm_120; here by the CPU stand-in's capability answer). Segmented: a forced
    segment count, the forgetting starts, pass 1, the scan and the state and output kernels
    over the segment slots in the same program, ragged batches with a host copy of their offsets among
    them (pass 2 here reads none)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(TG, "fuse_solve_into_wu", lambda capability: fused_solve)
    monkeypatch.setattr(tg_program, "fuse_solve_into_wu", lambda capability: fused_solve)
    rng = random.Random(77 + fused_solve + 236 * segmented)
    entry = "run_segmented_call" if segmented else "run_call"
    calls = 60 if segmented else 120
    count = pools = 0
    with stubbed_triton_launches() as runs:
        for i in range(calls):
            call, takes = _random_form(rng, head_dims=((128, 128), (64, 64), (96, 80), (128, 64), (64, 128), (80, 96)),
                                       dtypes=(torch.bfloat16, torch.float16, torch.float32))
            if segmented:
                call["context_parallel"] = rng.choice([2, 3, 4])
            problem = make_problem(**call)
            expected, got, taken = _both_paths(TG, entry, lambda: TG.forward(problem), runs, problem)
            # No cumsum launch: the kernel forming T forms the gate cumsum (w/u fused, else kkt_solve).
            launched = [name for name, *_ in got[0]]
            middle = ["_forgetting_start_kernel", "_segment_map_fwd_kernel", "_segment_scan_fwd_kernel"] \
                if segmented else []
            assert launched == ([] if fused_solve else ["_kkt_solve_fwd_kernel"]) + [
                "_wu_fwd_kernel", *middle, "_state_fwd_kernel", "_output_fwd_kernel"], f"call {i}: {launched}"
            assert got == expected, f"call {i}: {call.keys()}"
            assert taken == int(takes), f"call {i}: program taken {taken}, expected {takes}"
            count += takes
            pools += takes and problem.state_indices is not None
    # taken and refused forms both drawn, pools among them
    assert (25 <= count <= 55 if segmented else 60 <= count <= 110) and pools >= (2 if segmented else 3)


def _both_paths(module, entry: str, forward, runs: list, problem):
    """``(expected, got, taken)``: the launches and outputs (:func:`_labels`) of ``forward()``
    with ``module.entry`` (the program's entry) answering None, after one such call that
    binds the form's kernels; then with the real entry, and whether it took the call."""
    inputs = {name: getattr(problem, name) for name in ("q", "k", "v", "g", "beta", "initial_state",
                                                         "state_indices")}
    inputs["cu_seqlens"] = problem.chunks.cu_seqlens
    with mock.patch.object(module, entry, lambda *a: None):
        forward()
        runs.clear()
        expected = _labels(runs, forward(), inputs)
    runs.clear()
    real = getattr(module, entry)
    taken = []

    def spy(*args):
        out = real(*args)
        taken.append(out is not None)
        return out

    with mock.patch.object(module, entry, spy):
        got = _labels(runs, forward(), inputs)
    return expected, got, sum(taken)
