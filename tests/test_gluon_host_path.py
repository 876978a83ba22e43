"""The Gluon forward's host path on the CPU, with the launches stubbed.

:func:`stubbed_launches` replaces what only a GPU has (the current device and stream,
Triton's binder and the compiled kernel's launcher) with stand-ins that record each launch,
and leaves the rest of the host path as it runs on the GPU: the plan lookup, the output
allocations, the descriptor and argument assembly of :func:`.launch.launch_planned`.
Over a stream of ragged calls the tests check that a call class is planned once (its
first call) and bound once per kernel, while every call gets its own grid and descriptor
rows. ``python tests/test_gluon_host_path.py`` prints the host time per call, of the
forward and of the whole public call.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import sys
import time
from unittest import mock

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from gdn_dispatch import native  # noqa: E402
from gdn_dispatch.contract import make_problem  # noqa: E402
from gdn_dispatch.device import assumed_device  # noqa: E402

from gdn_dispatch.backends.gluon_common import compat  # noqa: E402
from gdn_dispatch.backends.gluon_common import forward as F  # noqa: E402
from gdn_dispatch.backends.gluon_common import launch as L  # noqa: E402
from gdn_dispatch.backends.gluon_common import state_output as so_module  # noqa: E402
from gdn_dispatch.backends.gluon_common import wy  # noqa: E402
from gdn_dispatch.backends.gluon_common.plan import PLAN_COUNTS, clear_plan_cache, plan, plan_key  # noqa: E402


class _Compiled:
    """A compiled kernel's launch interface, with a C launch (``compat.raw_launch`` of it,
    stubbed below) that records the launcher call, the way Triton 3.6's launcher hands it."""

    function, packed_metadata = "fn-handle", "packed"

    def __init__(self, fn, record, descriptors: int):
        self.fn, self.record, self.descriptors = fn, record, descriptors

    def run(self, *args):
        raise AssertionError("kept kernels launch through their C launch")

    def c_launch(self, *args):
        # (grid, stream, function, flags, scratch, metadata, hooks) then the kernel's arguments
        self.record.append((self.fn, args[:4] + args[4:13], args[13:]))


def _raw_launch(compiled):
    return compat.RawLaunch(compiled.c_launch, ("fn-handle", False, False, None, None, "packed", None, None, None),
                            [{}] * compiled.descriptors)


def _tma_encoder(meta):
    return lambda ptr, shape, strides: ("map", ptr, tuple(shape), tuple(strides))


class _Runtime(L._Runtime):
    """Triton's real knobs; device 0 and a made-up stream (no driver here). Direct launches
    on whatever Triton is installed: the launcher is the stub above, so what this file checks
    (plans, binder passes, grids, descriptor rows) is the library's host path alone; which
    Triton releases launch directly is test_gluon_launch.py's business."""

    def __init__(self):
        super().__init__()
        self.direct = True

    def current_device(self):
        return 0

    def stream(self, device):
        return 1234


class Launches:
    """What a stubbed forward launched: ``binds`` (Triton binder passes: kernel, plan,
    grid) and ``runs`` (direct launches: kernel, launcher arguments)."""

    def __init__(self):
        self.binds: list = []
        self.runs: list = []


@contextlib.contextmanager
def stubbed_launches():
    """Run the Gluon forward's host path on CPU tensors: binder passes and direct launches
    are recorded (a :class:`Launches`), nothing is compiled or run."""
    launches = Launches()

    def bind(fn, launch, tensors, args, grid):
        # What the JIT path checks and builds, then a kept "kernel".
        for d in launch.descriptors:
            d.build(tensors[d.tensor])
        launches.binds.append((fn, launch, grid))
        return _Compiled(fn, launches.runs, len(launch.descriptors))

    with mock.patch.object(L, "_RUNTIME", _Runtime()), mock.patch.object(L, "_jit_launch", bind), \
            mock.patch.object(compat, "raw_launch", _raw_launch), mock.patch.object(compat, "tma_encoder", _tma_encoder), \
            mock.patch.object(L, "JIT_LAUNCH_ENV", "GDN_DISPATCH_JIT_LAUNCH_UNSET_IN_THIS_TEST"), \
            mock.patch.object(torch.cuda, "current_device", lambda: None):  # CPU tensors: device index None
        yield launches


H, HV, K, V = 2, 4, 128, 128


def ragged_calls(count: int, seed: int, max_len: int = 4000, max_seqs: int = 16) -> list[dict]:
    """``count`` calls as a server sends them: 1..max_seqs sequences of 1..max_len tokens,
    half with a host copy of cu_seqlens, with an initial state and the final state; every
    fifth a uniform batch of 64 or 8192 tokens. Inputs are views of shared buffers (the
    host path reads no value)."""
    rng = random.Random(seed)
    total = max(max_len * max_seqs, 8192)
    q = torch.randn(1, total, H, K).to(torch.bfloat16)
    v = torch.randn(1, total, HV, V).to(torch.bfloat16)
    g = -torch.rand(1, total, HV)
    beta = torch.rand(1, total, HV)
    h0 = torch.zeros(max_seqs, HV, K, V)
    calls = []
    for i in range(count):
        if i % 5 == 4:
            T = rng.choice([64, 8192])
            calls.append(dict(q=q[:, :T], k=q[:, :T], v=v[:, :T], g=g[:, :T], beta=beta[:, :T],
                              initial_state=h0[:1], output_final_state=True, context_parallel="off"))
            continue
        lengths = [rng.randint(1, max_len) for _ in range(rng.randint(1, max_seqs))]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        T = int(cu[-1])
        calls.append(dict(q=q[:, :T], k=q[:, :T], v=v[:, :T], g=g[:, :T], beta=beta[:, :T],
                          initial_state=h0[:len(lengths)], output_final_state=True, cu_seqlens=cu,
                          cu_seqlens_cpu=cu if rng.random() < 0.5 else None, context_parallel="off"))
    return calls


def host_times(problems, device, engine, repeats: int = 3) -> list[float]:
    """Seconds of the Gluon forward's host path per call (the best of ``repeats`` passes
    over ``problems``), launches stubbed."""
    best = [float("inf")] * len(problems)
    with stubbed_launches():
        for problem in problems:  # the first call of each class plans and binds
            F.forward(problem, device, engine=engine)
        for _ in range(repeats):
            for i, problem in enumerate(problems):
                start = time.perf_counter()
                F.forward(problem, device, engine=engine)
                best[i] = min(best[i], time.perf_counter() - start)
    return best


def _engine(capability):
    from gdn_dispatch.backends import gluon_sm90, gluon_sm100

    return gluon_sm100.ENGINE if capability[0] == 10 else gluon_sm90.ENGINE


@pytest.mark.parametrize("capability", [(9, 0), (10, 0)], ids=["sm90", "sm100"])
def test_a_call_class_is_planned_and_bound_once_over_a_ragged_stream(capability):
    clear_plan_cache()
    device = assumed_device(f"sm_{capability[0]}{capability[1]}")
    engine = _engine(capability)
    problems = [make_problem(**call) for call in ragged_calls(60, seed=7, max_len=300)]
    classes = set()
    with stubbed_launches() as launches:
        for problem in problems:
            key = plan_key(problem, device, engine)
            computed = PLAN_COUNTS["computed"]
            runs, binds = len(launches.runs), len(launches.binds)
            o, final = F.forward(problem, device, engine=engine)
            assert PLAN_COUNTS["computed"] == computed + (key not in classes)
            classes.add(key)
            # wy and the fused kernel, each launched once, with this call's counts.
            assert len(launches.runs) - runs + len(launches.binds) - binds == 2
            rows, n = problem.B * problem.T, problem.N
            so = plan(problem, device=device, engine=engine).stage("state_output_fwd")
            tails = so.constexprs["HAS_TAILS"]
            expected = {wy._wy_fwd_kernel: (rows // 64 + (n if tails else 0)) * HV,
                        so_module._state_output_fwd_kernel: n * HV * so.blocks["NV"]}
            grids = [(fn, head[:3]) for fn, head, _ in launches.runs[runs:]]
            grids += [(fn, grid + (1, 1)) for fn, _, grid in launches.binds[binds:]]
            assert sorted(expected[fn] for fn, _ in grids) == sorted(expected.values())
            assert all(grid == (expected[fn], 1, 1) for fn, grid in grids)
            for _, _, args in launches.runs[runs:]:
                maps = [a for a in args if isinstance(a, tuple) and a[:1] == ("map",)]
                assert maps and all(m[2][0] == rows for m in maps)
            assert o.shape == (problem.B, problem.T, HV, V) and final.shape == (n, HV, K, V)
    assert PLAN_COUNTS["computed"] == len(classes) <= 4
    assert PLAN_COUNTS["hits"] == len(problems) * 2 - len(classes)
    # One binder pass per launch plan a call used (fused-kernel configurations included):
    # no new length or sequence count binds again.
    bound = [id(launch) for _, launch, _ in launches.binds]
    assert len(bound) == len(set(bound)) and len(launches.runs) == 2 * len(problems) - len(bound)


def test_the_stub_sees_a_recomputed_plan():
    """Negative control: with the plan cache emptied before every call, the counter shows
    every call planning its class."""
    device, engine = assumed_device("sm_90"), _engine((9, 0))
    problems = [make_problem(**call) for call in ragged_calls(6, seed=3, max_len=200)]
    clear_plan_cache()
    with stubbed_launches():
        for problem in problems:
            clear_plan_cache()
            F.forward(problem, device, engine=engine)
            assert PLAN_COUNTS["computed"] == 1 and PLAN_COUNTS["hits"] == 0


def main() -> None:
    """Print the host time per call of the Gluon forward (launches stubbed) over 60 ragged calls."""
    for capability in ((9, 0), (10, 0)):
        clear_plan_cache()
        device, engine = assumed_device(f"sm_{capability[0]}{capability[1]}"), _engine(capability)
        calls = ragged_calls(60, seed=7)
        problems = [make_problem(**call) for call in calls]
        times = host_times(problems, device, engine)
        varlen = [t for t, c in zip(times, calls) if "cu_seqlens" in c]
        uniform = [t for t, c in zip(times, calls) if "cu_seqlens" not in c]
        print(f"sm_{capability[0]}{capability[1]}: {len(PLAN_COUNTS) and PLAN_COUNTS['computed']} class plans; "
              f"host path per call (us, launches stubbed): varlen median {statistics.median(varlen) * 1e6:.1f}, "
              f"uniform median {statistics.median(uniform) * 1e6:.1f}, all max {max(times) * 1e6:.1f}")
        small = [make_problem(**call) for call in ragged_calls(60, seed=7, max_len=64, max_seqs=4)]
        print(f"  calls of 1..4 x 1..64 tokens: median {statistics.median(host_times(small, device, engine)) * 1e6:.1f}")
    print(f"the public call on sm_90 (validate, select, forward; launches stubbed, native layer "
          f"{native.status()}): " + ", ".join(f"{name} {us:.1f} us" for name, us in public_call_times().items()))


def public_call_times(repeats: int = 2000) -> dict[str, float]:
    """Host microseconds of the whole public call (``chunk_gated_delta_rule(...,
    backend="gluon_sm90")``: the contract, the registry's choice and the forward) per case,
    median of ``repeats`` calls, on CPU tensors taken for an sm_90 device's, launches
    stubbed; Qwen3.5's H = 16, HV = 32, K = V = 128, bf16, initial and final state."""
    from gdn_dispatch import api, op
    from gdn_dispatch.backends import gluon_sm90
    from gdn_dispatch.testing import random_call

    device = assumed_device("sm_90")

    class Probe:
        def for_torch_device(self, _):
            return device

    # 4 x 64 tokens take the warp-specialized path (128 programs) with outputs small
    # enough that CPU allocations stay cheap, as CUDA's cached ones are.
    cases = {"uniform 1 x 64": dict(batch=(1, 64)), "varlen 1 x 64": dict(lengths=[64]),
             "varlen 1 x 64, no cu_seqlens_cpu": dict(lengths=[64], host_copy=False),
             "varlen 4 x 64": dict(lengths=[64] * 4)}
    times = {}
    with stubbed_launches(), mock.patch.object(op, "default_probe", Probe), \
            mock.patch.object(gluon_sm90, "unsupported_reason", lambda problem: None):
        for name, shape in cases.items():
            host_copy = shape.pop("host_copy", True)
            call = random_call(**shape, H=16, HV=32, K=128, V=128, device="cpu", seed=0)
            if not host_copy:
                call.pop("cu_seqlens_cpu")
            for _ in range(20):
                api.chunk_gated_delta_rule(**call, output_final_state=True, backend="gluon_sm90")
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                api.chunk_gated_delta_rule(**call, output_final_state=True, backend="gluon_sm90")
                samples.append(time.perf_counter() - start)
            times[name] = statistics.median(samples) * 1e6
    return times


if __name__ == "__main__":
    sys.exit(main())
