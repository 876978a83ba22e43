"""``python -m gdn_dispatch bench``: its pure pieces on the CPU, one smoke run on a GPU."""

import argparse
import io
import json
import math
import os
import sys

import pytest
import torch

from gdn_dispatch import bench, bench_ceiling, bench_report, bench_shapes, bench_timing
from gdn_dispatch.bench_shapes import BenchShape
from gdn_dispatch.bench_report import Measurement, ShapeResult
from gdn_dispatch.device import assumed_device
from gdn_dispatch.registry import GDNDispatchError

SMALL = BenchShape("small", H=2, HV=4, B=3, T=5, K=8, V=16)
RAGGED = BenchShape("ragged", H=2, HV=4, B=1, T=36, K=16, V=8, seqlens=(31, 0, 5))
has_cuda = torch.cuda.is_available()


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


class FakeProbe:
    """A DeviceProbe stand-in: ``count`` devices, or none for ``reason``."""

    def __init__(self, count=0, reason="no CUDA driver: RuntimeError: libcuda.so.1 not found"):
        self._count, self.unavailable_reason = count, reason

    def count(self):
        return self._count


# --------------------------------------------------------------------------- shapes and counts


def test_default_shapes():
    shapes = bench_shapes.default_shapes()
    names = [s.name for s in shapes]
    assert names == [
        "H16-HV32-1x8192", "H16-HV32-1x32768", "H16-HV32-4x8192", "H16-HV32-8x4096", "H16-HV32-ragged16",
        "H16-HV64-1x8192", "H16-HV64-1x32768", "H16-HV64-4x8192", "H16-HV64-8x4096", "H16-HV64-ragged16",
    ]
    for s in shapes:
        assert (s.K, s.V) == (128, 128)
        if s.is_varlen:
            assert (s.B, s.T, s.N) == (1, sum(s.seqlens), 16)
            assert all(1 <= n <= 8192 for n in s.seqlens)
        else:
            assert s.N == s.B and s.tokens == s.B * s.T


def test_ragged_lengths_are_fixed_across_runs():
    assert bench_shapes.ragged_lengths() == bench_shapes.ragged_lengths()
    assert bench_shapes.ragged_lengths(seed=1) != bench_shapes.ragged_lengths()
    assert len(set(bench_shapes.ragged_lengths())) > 1


@pytest.mark.parametrize("patterns, expected", [
    pytest.param(None, 10, id="all"),
    pytest.param("H16-HV32-1x8192", ["H16-HV32-1x8192"], id="one-name"),
    pytest.param("H16-HV64-ragged16, H16-HV32-1x8192", ["H16-HV32-1x8192", "H16-HV64-ragged16"], id="table-order"),
    pytest.param("*ragged*", ["H16-HV32-ragged16", "H16-HV64-ragged16"], id="glob"),
])
def test_select_shapes(patterns, expected):
    chosen = [s.name for s in bench_shapes.select_shapes(bench_shapes.default_shapes(), patterns)]
    assert chosen == expected if isinstance(expected, list) else len(chosen) == expected


def test_select_shapes_rejects_unknown():
    with pytest.raises(ValueError, match=r"'H8-\*' matches no shape; valid names: H16-HV32-1x8192"):
        bench_shapes.select_shapes(bench_shapes.default_shapes(), "H16-HV32-1x8192,H8-*")


def test_flop_count_by_hand():
    shape = BenchShape("x", H=16, HV=32, B=1, T=8192)
    # 6KV + C(6K + 4V) + 2C^2/3 per token and v-head, K = V = 128, C = 64
    per_token = 6 * 128 * 128 + 64 * (6 * 128 + 4 * 128) + 2 * 64 * 64 / 3
    assert per_token == pytest.approx(182954.667, rel=1e-8)
    assert bench_shapes.flop_count(shape) == pytest.approx(8192 * 32 * per_token, rel=1e-12)
    assert bench_shapes.flop_count(RAGGED) == pytest.approx(36 * 4 * (6 * 16 * 8 + 64 * (6 * 16 + 4 * 8) + 2 * 64 * 64 / 3))


def test_io_bytes_by_hand():
    # 15 tokens, H=2, HV=4, K=8, V=16, N=3: q, k, v, o bf16; g fp32; beta bf16; states fp32
    q = k = 15 * 2 * 8 * 2
    v = o = 15 * 4 * 16 * 2
    g, beta = 15 * 4 * 4, 15 * 4 * 2
    state = 3 * 4 * 8 * 16 * 4
    assert bench_shapes.io_bytes(SMALL) == (q + k + v + g + beta + state, o + state)
    assert bench_shapes.min_bytes(SMALL) == q + k + v + g + beta + 2 * state + o


def test_io_bytes_ragged_counts_one_state_per_sequence():
    read, written = bench_shapes.io_bytes(RAGGED)
    state = 3 * 4 * 16 * 8 * 4
    assert written == 36 * 4 * 8 * 2 + state
    assert read == 2 * 36 * 2 * 16 * 2 + 36 * 4 * 8 * 2 + 36 * 4 * 6 + state


def test_io_bytes_qwen_shape():
    read, written = bench_shapes.io_bytes(BenchShape("x", H=16, HV=32, B=1, T=8192))
    assert read == 8192 * (2 * 16 * 128 * 2 + 32 * 128 * 2 + 32 * 6) + 32 * 128 * 128 * 4
    assert written == 8192 * 32 * 128 * 2 + 32 * 128 * 128 * 4


@pytest.mark.parametrize("nbytes, flops, expected", [
    pytest.param(4e9, 1e12, (1e-3, "memory"), id="memory-bound"),
    pytest.param(4e6, 1e12, (1e-3 * 1e12 / 1e12 * 1.0, "compute"), id="compute-bound"),
])
def test_sol_bound(nbytes, flops, expected):
    seconds, by = bench_shapes.sol_bound_s(nbytes, flops, bandwidth=4e12, matmul_rate=1e15)
    assert by == expected[1]
    assert seconds == pytest.approx(max(nbytes / 4e12, flops / 1e15))


@pytest.mark.parametrize("set_bytes, l2_bytes, expected", [
    pytest.param(1_000_000, 0, 8, id="tiny-capped"),
    pytest.param(137_887_744, 0, 3, id="H16-HV32-1x8192"),
    pytest.param(50_000_000, 0, 4, id="exact-multiple"),
    pytest.param(2_000_000_000, 0, 2, id="huge-still-two"),
    pytest.param(137_887_744, 126 * 2**20, 4, id="larger-l2-raises-budget"),
])
def test_rotation_count(set_bytes, l2_bytes, expected):
    assert bench_timing.rotation_count(set_bytes, l2_bytes) == expected


def test_rotation_sets_exceed_the_budget():
    for s in bench_shapes.default_shapes():
        n = bench_timing.rotation_count(bench_shapes.io_bytes(s)[0], 60 * 10**6)
        assert 2 <= n <= bench_timing.MAX_INPUT_SETS
        assert n * bench_shapes.io_bytes(s)[0] > bench_timing.ROTATION_BUDGET_BYTES


# --------------------------------------------------------------------------- results, table, JSON, plot


def fake_result() -> ShapeResult:
    shape = BenchShape("H16-HV32-1x8192", H=16, HV=32, B=1, T=8192)
    result = ShapeResult(shape=shape, min_bytes=bench_shapes.min_bytes(shape), flops=bench_shapes.flop_count(shape),
                         bound_ms=0.05, bound_by="memory", input_sets=3)
    result.measurements = [
        bench_report.from_times("triton_generic", [0.30, 0.20, 0.25, 0.90]),
        bench_report.from_times("fla", [0.50, 0.40, 0.45]),
        Measurement("gluon_sm100", note="cannot run: needs compute capability in {sm_100, sm_103}"),
    ]
    return bench_report.finish(result)


def test_finish_fills_ratios():
    result = fake_result()
    ours, fla, skipped = result.measurements
    assert (ours.ms, ours.min_ms, ours.max_ms, ours.iters) == (0.275, 0.20, 0.90, 4)
    assert ours.sol_ratio == pytest.approx(0.275 / 0.05)
    assert ours.fla_ratio == pytest.approx(0.275 / 0.45)
    assert fla.fla_ratio == 1.0
    assert ours.tflops == pytest.approx(bench_shapes.flop_count(result.shape) / 0.275e-3 / 1e12)
    assert skipped.ms is skipped.tflops is skipped.sol_ratio is skipped.fla_ratio is None


def test_finish_without_fla_leaves_fla_ratio_empty():
    result = fake_result()
    result.measurements = [m for m in result.measurements if m.backend != "fla"]
    assert bench_report.finish(result).measurements[0].fla_ratio is None


def test_format_table():
    text = bench_report.format_table([fake_result()])
    lines = text.splitlines()
    assert lines[0].split()[:7] == ["backend", "ms", "TFLOP/s", "x", "SOL", "x", "fla"]
    assert "err o" not in lines[0]
    assert lines[1].startswith("H16-HV32-1x8192: B=1 T=8192, H=16 HV=32 K=128 V=128;")
    assert "bound 0.0500 ms (memory), 3 input sets" in lines[1]
    row = lines[2].split()
    assert row[:5] == ["triton_generic", "0.2750", f"{bench_shapes.flop_count(fake_result().shape) / 0.275e9:.1f}",
                       "5.50", "0.611"]
    assert lines[3].split()[:5] == ["fla", "0.4500", lines[3].split()[2], "9.00", "1.000"]
    assert lines[4].split()[:5] == ["gluon_sm100", "-", "-", "-", "-"]
    assert lines[4].endswith("cannot run: needs compute capability in {sm_100, sm_103}")


def test_format_table_with_check_columns():
    result = fake_result()
    result.measurements[0].err_o, result.measurements[0].err_state = 1.234e-3, 5e-6
    lines = bench_report.format_table([result], check=True).splitlines()
    assert "err o" in lines[0] and "err state" in lines[0]
    assert lines[2].split()[5:7] == ["1.23e-03", "5.00e-06"]
    assert lines[4].split()[5:7] == ["-", "-"]


def make_report(result=None):
    return bench_report.build_report(
        [result or fake_result()],
        device={"name": "NVIDIA H200", "capability": "9.0", "arch": "sm_90", "sm_count": 132, "l2_bytes": 52428800},
        versions={"torch": "2.11.0", "triton": "3.6.0", "gdn_dispatch": "0.1.0", "fla": None},
        ceilings={"copy_bandwidth_GBps": 4000.0, "matmul_bf16_TFLOPs": 700.0, "chunk": 64},
        settings={"iters": 30, "warmup": 5, "seed": 0},
        command="python -m gdn_dispatch bench --json out.json",
        date="2026-01-01T00:00:00+00:00",
    )


def test_json_round_trip(tmp_path):
    report = make_report()
    path = tmp_path / "bench.json"
    bench_report.write_json(str(path), report)
    loaded = json.loads(path.read_text())
    assert loaded == report
    shape = loaded["shapes"][0]
    assert shape["name"] == "H16-HV32-1x8192" and shape["tokens"] == 8192 and shape["seqlens"] is None
    assert shape["min_bytes"] == bench_shapes.min_bytes(fake_result().shape)
    by_name = {m["backend"]: m for m in shape["results"]}
    assert by_name["triton_generic"]["ms"] == 0.275
    assert by_name["triton_generic"]["fla_ratio"] == pytest.approx(0.275 / 0.45)
    assert by_name["gluon_sm100"]["ms"] is None and by_name["gluon_sm100"]["note"].startswith("cannot run")
    assert loaded["command"].startswith("python -m gdn_dispatch bench")
    assert loaded["device"]["capability"] == "9.0"


def test_json_keeps_nan_and_inf_as_names(tmp_path):
    result = fake_result()
    result.measurements[0].err_o, result.measurements[0].err_state = float("nan"), float("inf")
    path = tmp_path / "bench.json"
    bench_report.write_json(str(path), make_report(result))
    row = json.loads(path.read_text())["shapes"][0]["results"][0]
    assert (row["err_o"], row["err_state"]) == ("nan", "inf")


def test_json_ragged_lengths_are_a_list(tmp_path):
    shape = bench_shapes.default_shapes()[4]
    result = ShapeResult(shape=shape, min_bytes=1, flops=1.0, bound_ms=1.0, bound_by="memory", input_sets=2)
    path = tmp_path / "bench.json"
    bench_report.write_json(str(path), make_report(result))
    assert json.loads(path.read_text())["shapes"][0]["seqlens"] == list(shape.seqlens)


def test_plot_written_or_noted(tmp_path):
    path = tmp_path / "bench.png"
    note = bench_report.write_plot(str(path), make_report())
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert note.startswith("--plot: matplotlib not importable")
        assert not path.exists()
    else:
        assert note is None
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_note(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise
    note = bench_report.write_plot(str(tmp_path / "bench.png"), make_report())
    assert note.startswith("--plot: matplotlib not importable") and "no plot written" in note


def test_plot_with_nothing_timed_is_a_note(tmp_path):
    pytest.importorskip("matplotlib")
    result = fake_result()
    result.measurements = [result.measurements[2]]
    assert bench_report.write_plot(str(tmp_path / "b.png"), make_report(result)) == "--plot: nothing was timed; no plot written"


@pytest.mark.parametrize("argv, expected", [
    pytest.param(["/x/gdn_dispatch/__main__.py", "bench", "--shapes", "a b"],
                 "python -m gdn_dispatch bench --shapes 'a b'", id="module"),
    pytest.param(["/usr/bin/gdn-dispatch", "bench"], "/usr/bin/gdn-dispatch bench", id="script"),
])
def test_command_line(argv, expected):
    assert bench_report.command_line(argv) == expected


# --------------------------------------------------------------------------- inputs and callers


@pytest.mark.parametrize("shape, qk_l2norm", [
    pytest.param(SMALL, False, id="B3-T5-H2-HV4-K8-V16"),
    pytest.param(RAGGED, True, id="ragged-31-0-5-l2norm-in-kernel"),
])
def test_make_input_sets(shape, qk_l2norm):
    sets = bench_timing.make_input_sets(shape, 3, "cpu", seed=7, qk_l2norm=qk_l2norm)
    assert len(sets) == 3
    x = sets[0]
    B, T, H, HV, K, V = shape.B, shape.T, shape.H, shape.HV, shape.K, shape.V
    assert x.q.shape == x.k.shape == (B, T, H, K) and x.q.dtype == x.k.dtype == torch.bfloat16
    assert x.v.shape == (B, T, HV, V) and x.v.dtype == torch.bfloat16
    assert x.g.shape == (B, T, HV) and x.g.dtype == torch.float32 and bool((x.g <= 0).all())
    assert x.beta.dtype == torch.bfloat16 and bool(((x.beta >= 0) & (x.beta <= 1)).all())
    assert x.h0.shape == (shape.N, HV, K, V) and x.h0.dtype == torch.float32
    assert x.scale == K ** -0.5 and x.qk_l2norm is qk_l2norm
    norms = x.k.float().norm(dim=-1)
    if qk_l2norm:
        assert not torch.allclose(norms, torch.ones_like(norms), atol=0.05)
    else:
        assert torch.allclose(norms, torch.ones_like(norms), atol=1e-2)
    assert not torch.equal(sets[0].v, sets[1].v)
    assert torch.equal(bench_timing.make_input_sets(shape, 1, "cpu", seed=7, qk_l2norm=qk_l2norm)[0].v, x.v)
    if shape.is_varlen:
        assert x.cu_seqlens.tolist() == x.cu_seqlens_cpu.tolist() == [0, 31, 31, 36]
        assert x.cu_seqlens.dtype == x.cu_seqlens_cpu.dtype == torch.int32
        assert x.cu_seqlens_long.dtype == torch.int64
        assert sets[1].cu_seqlens is x.cu_seqlens  # shared: fla caches its chunk indices per tensor
    else:
        assert x.cu_seqlens is x.cu_seqlens_cpu is x.cu_seqlens_long is None


def test_fla_caller_passes_fla_arguments():
    seen = {}

    def fake_fla(q, k, v, g, beta, **kwargs):
        seen.update(kwargs, q=q)
        return v, kwargs["initial_state"]

    x = bench_timing.make_input_sets(RAGGED, 1, "cpu", seed=0)[0]
    bench_timing.fla_caller(fake_fla)(x)
    assert seen["q"] is x.q and seen["initial_state"] is x.h0
    assert seen["cu_seqlens"] is x.cu_seqlens_long and seen["cu_seqlens"].dtype == torch.int64
    assert seen["output_final_state"] is True and seen["use_qk_l2norm_in_kernel"] is False
    assert seen["scale"] == 16 ** -0.5
    assert "cu_seqlens_cpu" not in seen and "backend" not in seen


@pytest.mark.parametrize("shape", [pytest.param(SMALL, id="uniform"), pytest.param(RAGGED, id="ragged")])
def test_ours_caller_runs_the_forced_backend(shape):
    x = bench_timing.make_input_sets(shape, 1, "cpu", seed=0)[0]
    o, state = bench_timing.ours_caller("reference")(x)
    assert o.shape == (shape.B, shape.T, shape.HV, shape.V) and o.dtype == torch.bfloat16
    assert state.shape == (shape.N, shape.HV, shape.K, shape.V) and state.dtype == torch.float32
    if shape.is_varlen:  # the zero-length sequence keeps its initial state
        assert torch.equal(state[1], x.h0[1])


def test_load_fla_without_fla(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # makes `import fla...` raise
    monkeypatch.setenv("FLA_FLASH_QLA", "unset below")  # so the undo also drops load_fla's value
    monkeypatch.delenv("FLA_FLASH_QLA")
    fn, version, reason = bench_timing.load_fla()
    assert fn is None and version is None
    assert reason.startswith("not importable: ModuleNotFoundError: No module named 'fla.ops'")
    assert os.environ["FLA_FLASH_QLA"] == "0"


def test_load_fla_keeps_callers_flash_qla_choice(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)
    monkeypatch.setenv("FLA_FLASH_QLA", "1")
    bench_timing.load_fla()
    assert os.environ["FLA_FLASH_QLA"] == "1"


# --------------------------------------------------------------------------- one shape, fake timer


def fake_timer(call, sets, warmup, iters):
    """Runs the call once (so its errors surface as on a GPU) and returns fixed times."""
    call(sets[0])
    return [1.0, 2.0, 3.0]


def test_bench_shape_with_fake_timer_and_check():
    sets = bench_timing.make_input_sets(RAGGED, 2, "cpu", seed=0)
    reference = bench_timing.ours_caller("reference")

    def slow_fla(x):  # stands in for fla: the same answer, a little perturbed
        o, state = reference(x)
        return o, state * (1 + 1e-3)

    def cannot(x):
        raise GDNDispatchError("backend 'gluon_sm100' cannot run this call: needs sm_100")

    def broken(x):
        raise RuntimeError("illegal memory access")

    callers = {"reference": reference, "gluon_sm100": cannot, "triton_generic": broken, "fla": slow_fla}
    result = bench_timing.bench_shape(RAGGED, sets, callers, bandwidth=1e12, matmul_rate=1e14, timer=fake_timer,
                               warmup=1, iters=3, check_against=("fla", slow_fla))
    by = {m.backend: m for m in result.measurements}
    assert list(by) == ["reference", "gluon_sm100", "triton_generic", "fla"]
    assert by["reference"].ms == 2.0 and by["reference"].fla_ratio == 1.0
    assert by["reference"].err_o == 0.0 and by["reference"].err_state == pytest.approx(1e-3, rel=1e-2)
    assert by["fla"].err_state == 0.0
    assert by["gluon_sm100"].note.startswith("cannot run: ") and not by["gluon_sm100"].failed
    assert by["triton_generic"].note == "error: RuntimeError: illegal memory access" and by["triton_generic"].failed
    assert by["triton_generic"].err_o is None
    bound = max(bench_shapes.min_bytes(RAGGED) / 1e12, bench_shapes.flop_count(RAGGED) / 1e14) * 1e3
    assert result.bound_ms == pytest.approx(bound) and result.input_sets == 2
    assert by["reference"].sol_ratio == pytest.approx(2.0 / bound)


def test_bench_shape_fla_errors_are_notes_not_failures():
    def fla_without_gva(x):
        raise AssertionError("HV must equal H")

    result = bench_timing.bench_shape(SMALL, bench_timing.make_input_sets(SMALL, 1, "cpu", 0), {"fla": fla_without_gva},
                               bandwidth=1e12, matmul_rate=1e14, timer=fake_timer, warmup=0, iters=1)
    m = result.measurements[0]
    assert m.note == "error: AssertionError: HV must equal H" and not m.failed


def test_bench_all_on_cpu_prints_each_shape():
    out = io.StringIO()
    reference = bench_timing.ours_caller("reference")
    results = bench.bench_all([SMALL, RAGGED], {"reference": reference}, "cpu", bandwidth=1e12, matmul_rate=1e14,
                              timer=fake_timer, warmup=0, iters=3, seed=0, check_against=("reference", reference),
                              out=out)
    assert [r.shape.name for r in results] == ["small", "ragged"]
    assert all(r.input_sets == bench_timing.MAX_INPUT_SETS for r in results)  # tiny sets: the cap
    assert all(r.measurements[0].err_o == 0.0 for r in results)
    lines = out.getvalue().splitlines()
    assert "err o" in lines[0] and lines[1].startswith("small: ") and lines[3].startswith("ragged: ")


@pytest.mark.parametrize("failed, code", [pytest.param(False, 0, id="ok"), pytest.param(True, 1, id="failed")])
def test_finish_run_writes_outputs_and_exit_code(tmp_path, failed, code, capsys):
    result = fake_result()
    result.measurements[0].failed = failed
    args = parse("--json", str(tmp_path / "b.json"))
    out = io.StringIO()
    assert bench.finish_run(args, [result], make_report(result), out) == code
    assert json.loads((tmp_path / "b.json").read_text())["shapes"][0]["name"] == "H16-HV32-1x8192"
    assert f"wrote {tmp_path / 'b.json'}" in out.getvalue()
    assert ("bench: failed: H16-HV32-1x8192/triton_generic" in capsys.readouterr().err) is failed


# --------------------------------------------------------------------------- the subcommand on the CPU


def test_defaults():
    args = parse()
    assert (args.iters, args.warmup, args.seed, args.device) == (30, 5, 0, 0)
    assert not (args.check or args.qk_l2norm or args.list_shapes)
    assert args.backends is args.shapes is args.json is args.plot is None


@pytest.mark.parametrize("argv, message", [
    pytest.param(["--iters", "0"], "expected an integer >= 1", id="iters-0"),
    pytest.param(["--warmup", "-1"], "expected an integer >= 0", id="warmup-negative"),
    pytest.param(["--device", "cpu"], "expected cuda or cuda:N", id="device-cpu"),
])
def test_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("text, index", [("cuda", 0), ("cuda:3", 3), ("1", 1)])
def test_device_flag(text, index):
    assert parse("--device", text).device == index


@pytest.mark.parametrize("text, expected", [
    pytest.param(None, (["gluon_sm100", "triton_generic"], True), id="default-skips-reference"),
    pytest.param("reference,fla", (["reference"], True), id="reference-on-request"),
    pytest.param("triton_generic", (["triton_generic"], False), id="no-fla"),
])
def test_requested_backends(text, expected):
    assert bench.requested_backends(text, ["gluon_sm100", "triton_generic", "reference"]) == expected


def test_requested_backends_rejects_unknown():
    with pytest.raises(ValueError, match=r"unknown backend 'flash'; valid names: a, reference, fla"):
        bench.requested_backends("a,flash", ["a", "reference"])


def test_no_gpu_exits_2_with_the_probe_reason(capsys):
    code = bench.run(parse(), probe=FakeProbe(count=0))
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == ("bench needs a CUDA device; found none: "
                           "no CUDA driver: RuntimeError: libcuda.so.1 not found")


@pytest.mark.skipif(has_cuda, reason="checks the real probe on a machine without a GPU")
def test_no_gpu_exits_2_with_the_default_probe(capsys):
    assert bench.run(parse()) == 2
    assert capsys.readouterr().err.startswith("bench needs a CUDA device; found none: ")


def test_device_index_beyond_count(capsys):
    assert bench.run(parse("--device", "cuda:2"), probe=FakeProbe(count=1, reason=None)) == 2
    assert "--device cuda:2 asked, but only 1 CUDA device(s) present" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    pytest.param(["--backends", "nope"], "bench: --backends: unknown backend 'nope'", id="backend"),
    pytest.param(["--shapes", "H99*"], "bench: --shapes: 'H99*' matches no shape", id="shape"),
])
def test_bad_names_exit_2(argv, message, capsys):
    assert bench.run(parse(*argv), probe=FakeProbe(count=1, reason=None)) == 2
    assert capsys.readouterr().err.startswith(message)


def test_list_shapes_needs_no_gpu():
    out = io.StringIO()
    assert bench.run(parse("--list-shapes", "--shapes", "*ragged*"), probe=FakeProbe(count=0), out=out) == 0
    lines = out.getvalue().splitlines()
    assert [line.split()[0] for line in lines] == ["H16-HV32-ragged16", "H16-HV64-ragged16"]
    assert "16 seqs" in lines[0]


def test_header_names_the_native_host_layer():
    """Our calls' host time depends on whether the native host layer is on: the table's
    header says which, on its second line."""
    out = io.StringIO()
    bench._print_header(out, assumed_device("sm_90"), {"torch": torch.__version__}, 3.0e12, 8.0e14, parse(), {},
                        False, None, None, "not built (python -m gdn_dispatch warmup builds it)")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("gdn-dispatch bench on ")
    assert lines[1] == "native host layer: not built (python -m gdn_dispatch warmup builds it)"


def test_discover_backends_reports_why_not():
    runnable, skipped = bench.discover_backends(assumed_device("sm_90"), ["gluon_sm100"], qk_l2norm=False)
    assert runnable == []
    assert skipped == {"gluon_sm100": "needs compute capability in {sm_100, sm_103}, device is sm_90"}
    runnable, skipped = bench.discover_backends(assumed_device("sm_90"), ["reference"], qk_l2norm=True)
    assert runnable == ["reference"] and skipped == {}


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not has_cuda, reason="needs a CUDA GPU")
def test_bench_smoke_on_gpu(tmp_path):
    path = tmp_path / "bench.json"
    out = io.StringIO()
    code = bench.run(parse("--shapes", "H16-HV32-1x8192", "--iters", "3", "--warmup", "1", "--check",
                           "--json", str(path)), out=out)
    text = out.getvalue()
    assert code == 0, text
    assert "ceilings: copy" in text and "H16-HV32-1x8192:" in text
    from gdn_dispatch import native

    assert f"native host layer: {native.status()}" in text
    report = json.loads(path.read_text())
    assert report["settings"]["native_host_layer"] == native.status()
    assert report["ceilings"]["copy_bandwidth_GBps"] > 0 and report["ceilings"]["matmul_bf16_TFLOPs"] > 0
    rows = report["shapes"][0]["results"]
    timed = [m for m in rows if m["ms"] is not None]
    assert timed, text
    for m in timed:
        assert m["ms"] > 0 and math.isfinite(m["sol_ratio"]) and m["sol_ratio"] > 0
        assert m["err_o"] is not None and m["err_o"] < 5e-2, m


# --------------------------------------------------------------------------- bench --host


def test_host_cases_cover_both_sizes_and_both_varlen_forms():
    from gdn_dispatch.bench_host import host_cases

    cases = {c.name: c for c in host_cases()}
    for tokens in (64, 8192):
        assert not cases[f"uniform-1x{tokens}"].varlen
        assert cases[f"varlen-1x{tokens}"].varlen and cases[f"varlen-1x{tokens}"].host_copy
        assert not cases[f"varlen-1x{tokens}-no-cpu"].host_copy
    full = [c for c in cases.values() if c.heads == (16, 32)]
    assert all(sum(c.lengths) in (64, 8192) for c in full)
    # The TP = 8 shard's long prompt, in both varlen forms.
    shard = [c for c in cases.values() if c.heads != (16, 32)]
    assert {(c.heads, c.lengths, c.host_copy) for c in shard} == {((2, 4), (32768,), True), ((2, 4), (32768,), False)}


def test_the_host_tables_shard_case_is_cut_into_segments():
    """On the H200 (132 SMs) "auto" cuts the TP = 8 shard's 32768-token prompt into
    segments: the host table measures a context-parallel call."""
    from gdn_dispatch.bench_host import TP8_HEADS, case_call, host_cases
    from gdn_dispatch.context_parallel import plan_for_problem
    from gdn_dispatch.contract import make_problem

    case = next(c for c in host_cases() if c.heads == TP8_HEADS and c.host_copy)
    call = case_call(case, "cpu", seed=1)
    assert call["q"].shape[2] == 2 and call["v"].shape[2] == 4
    assert plan_for_problem(make_problem(**call, output_final_state=True), 132).enabled


def test_ragged_stream_is_seeded_and_in_bounds():
    from gdn_dispatch.bench_host import STREAM_BATCHES, ragged_stream

    stream = ragged_stream(seed=4)
    assert stream == ragged_stream(seed=4) and stream != ragged_stream(seed=5)
    assert len(stream) == STREAM_BATCHES
    assert all(1 <= len(b) <= 16 and all(1 <= n <= 4000 for n in b) for b in stream)
    assert len({len(b) for b in stream}) > 5  # batch sizes vary


class StandInClock:
    """A clock that advances ``step`` seconds per call of the timed function."""

    def __init__(self, step):
        self.now, self.step, self.events = 0.0, step, []

    def __call__(self):
        return self.now

    def work(self):
        self.events.append("call")
        self.now += self.step

    def sync(self):
        self.events.append("sync")


def test_per_call_us_syncs_only_around_the_loop():
    from gdn_dispatch.bench_host import per_call_us

    clock = StandInClock(step=25e-6)
    assert per_call_us(clock.work, 4, clock=clock, sync=clock.sync, warmup=2) == pytest.approx(25.0)
    assert clock.events == ["call"] * 2 + ["sync"] + ["call"] * 4 + ["sync"]


def test_rounds_us_reports_the_median_round():
    """One round on a busy host (a call 10x slower) does not move the figure; the first
    round alone warms up."""
    from gdn_dispatch.bench_host import rounds_us

    clock = StandInClock(step=20e-6)
    steps = iter([20e-6] * 3 + [20e-6] * 4 + [200e-6] * 4 + [30e-6] * 4)

    def work():
        clock.step = next(steps)
        clock.work()

    assert rounds_us(work, 4, 3, clock=clock, sync=clock.sync) == pytest.approx(30.0)
    first = ["call"] * 3 + ["sync"] + ["call"] * 4 + ["sync"]
    assert clock.events == first + (["sync"] + ["call"] * 4 + ["sync"]) * 2


def test_enqueue_rounds_read_the_reference_around_each_round():
    """Each round carries the slower of the references read just before and just after it
    (one reading between two rounds serves both); only the first round warms up."""
    from gdn_dispatch.bench_host import EnqueueRound, enqueue_rounds

    clock = StandInClock(step=20e-6)
    steps = iter([20e-6] * 2 + [20e-6] * 4 + [50e-6] * 4 + [30e-6] * 4)
    readings = iter([1.0, 2.1, 1.1, 1.05])

    def work():
        clock.step = next(steps)
        clock.work()

    def reference():
        clock.events.append("ref")
        return next(readings)

    got = enqueue_rounds(work, 4, 3, clock=clock, sync=clock.sync, reference=reference, warmup=2)
    assert got == [EnqueueRound(pytest.approx(20.0), 2.1), EnqueueRound(pytest.approx(50.0), 2.1),
                   EnqueueRound(pytest.approx(30.0), 1.1)]
    first = ["ref"] + ["call"] * 2 + ["sync"] + ["call"] * 4 + ["sync", "ref"]
    assert clock.events == first + (["sync"] + ["call"] * 4 + ["sync", "ref"]) * 2


def test_pass_summary_reads_each_row_at_full_host_speed():
    """The summary's full-speed median leaves out the rounds whose reference read more than
    FULL_SPEED times the run's fastest (any row's); best and median take every round."""
    from gdn_dispatch.bench_host import FULL_SPEED, EnqueueRound, HostRow, format_passes

    assert format_passes([HostRow("gluon_sm90", "varlen-1x64")]) == []
    fast = 1.0
    slow = FULL_SPEED * fast + 0.01
    ours = HostRow("gluon_sm90", "varlen-1x64", rounds=[
        EnqueueRound(40.0, fast), EnqueueRound(90.0, slow), EnqueueRound(44.0, FULL_SPEED * fast),
        EnqueueRound(85.0, 2.2), EnqueueRound(38.0, 1.1)])
    theirs = HostRow("fla", "varlen-1x64", note="a later pass: RuntimeError: x",
                     rounds=[EnqueueRound(900.0, 2.0), EnqueueRound(950.0, 2.1)])
    failed = HostRow("triton_generic", "varlen-1x64", note="error: boom")
    lines = format_passes([ours, theirs, failed])
    assert "1.00 us" in lines[0] and f"{FULL_SPEED}x" in lines[0]
    assert lines[1].split() == ["case", "backend", "rounds", "median", "best", "fs", "rounds", "fs", "median"]
    assert lines[2].split() == ["varlen-1x64", "gluon_sm90", "5", "44.0", "38.0", "3/5", "40.0"]
    assert lines[3].split()[:7] == ["varlen-1x64", "fla", "2", "925.0", "900.0", "0/2", "-"]
    assert lines[3].endswith("a later pass: RuntimeError: x") and len(lines) == 4  # no rounds, no line


def test_later_passes_add_enqueue_rounds_to_each_row(monkeypatch):
    """A later pass appends its rounds to every row that has a first-pass figure (fla's
    calls in its own keywords); a caller that fails in it keeps its rounds and says why."""
    from gdn_dispatch import bench_host
    from gdn_dispatch.bench_host import FLA, HostCase, HostRow, case_call, retime_enqueue

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    readings = []
    monkeypatch.setattr(bench_host, "python_reference_us", lambda **kw: readings.append(kw) or 1.0)
    case = HostCase("varlen-tiny", (3, 5), varlen=True, heads=(1, 2))
    seen, fla_seen = [], []

    def ours(**call):
        seen.append(tuple(call["cu_seqlens"].tolist()))

    def broken(**call):
        raise RuntimeError("gone")

    def theirs(**call):
        fla_seen.append((call["cu_seqlens"].dtype, "cu_seqlens_cpu" in call))

    rows = [HostRow("ours", case.name, enqueue_us=10.0), HostRow("broken", case.name, enqueue_us=12.0),
            HostRow("never", case.name, note="error: first pass"), HostRow(FLA, case.name, enqueue_us=500.0)]
    callers = {"ours": ours, "broken": broken, "never": broken, FLA: theirs}
    retime_enqueue(case_call(case, "cpu", 0), rows, callers, calls=2, rounds=3)
    assert len(rows[0].rounds) == 3 and all(r.ref_us == 1.0 for r in rows[0].rounds)
    assert len(rows[3].rounds) == 3 and fla_seen == [(torch.int64, False)] * 9  # int64 offsets, no host copy
    assert readings[:4] == [{"rounds": 1}] * 4  # one round per reading: a best-of would hide a slow stretch
    assert set(seen) == {(0, 3, 8)} and len(seen) == 3 + 3 * 2  # warm-up, then 3 rounds of 2
    assert rows[1].rounds == [] and rows[1].note == "a later pass: RuntimeError: gone"
    assert rows[2].rounds == [] and rows[2].note == "error: first pass"


def test_synchronized_us_includes_the_wait():
    from gdn_dispatch.bench_host import synchronized_us

    clock = StandInClock(step=1e-3)

    def sync():
        clock.events.append("sync")
        clock.now += 2e-3  # the device finishing

    assert synchronized_us(clock.work, clock=clock, sync=sync) == pytest.approx(3000.0)
    assert clock.events == ["sync", "call", "sync"]


def test_host_reference_times_both_pieces_and_prints_them():
    from gdn_dispatch.bench_host import _python_reference, format_reference, host_reference_us, python_reference_us

    assert _python_reference() == sum(range(16)) + 16 * 2 + 6 * 1  # k0..k9: 2 characters, k10..k15: 3
    ticks = iter(range(10 ** 6))
    # A clock 2 µs further at each reading: a round (two readings around its calls) reads
    # 2 µs for its 4 calls.
    ref = host_reference_us("cpu", calls=4, rounds=2, clock=lambda: next(ticks) * 2e-6)
    assert set(ref) == {"torch.empty", "python"} and all(v == pytest.approx(2.0 / 4) for v in ref.values())
    real = host_reference_us("cpu", calls=50, rounds=2)
    assert all(0 < v < 1e4 for v in real.values())
    line = format_reference({"torch.empty": 5.4, "python": 1.25})
    assert "torch.empty [1, 64, 32, 128] bf16 5.40 us" in line and "Python reference 1.25 us" in line
    # A row's own reference: the fastest of its rounds (3 calls each: 9, 3 and 6 µs).
    readings = iter([0.0, 9e-6, 10e-6, 13e-6, 20e-6, 26e-6])
    assert python_reference_us(calls=3, rounds=3, clock=lambda: next(readings)) == pytest.approx(1.0)
    assert 0 < python_reference_us() < 1e4


def test_fla_call_takes_int64_offsets_without_a_host_copy():
    from gdn_dispatch.bench_host import fla_call, make_call

    call = make_call((5, 70), True, True, "cpu", seed=1)
    assert call["cu_seqlens_cpu"] is not None
    theirs = fla_call(call)
    assert "cu_seqlens_cpu" not in theirs and theirs["cu_seqlens"].dtype == torch.int64
    assert "cu_seqlens_cpu" not in make_call((5, 70), True, False, "cpu", seed=1)
    assert make_call((64,), False, True, "cpu", seed=1)["q"].shape[:2] == (1, 64)


def test_host_steps_run_alone_on_the_cpu():
    from gdn_dispatch.bench_host import host_steps, make_call

    call = make_call((3, 9), True, False, "cpu", seed=2)
    steps = host_steps(call, "reference")
    assert list(steps) == ["validate", "select", "forward"]
    assert steps["validate"]().N == 2 and steps["select"]().spec.name == "reference"
    o, ht = steps["forward"]()
    assert o.shape == (1, 12, 32, 128) and ht.shape == (2, 32, 128, 128) and torch.isfinite(o.float()).all()


def test_host_table_and_stream_format():
    from gdn_dispatch.bench_host import HostRow, format_rows, format_stream

    lines = format_rows([HostRow("triton_generic", "varlen-1x64", 40.0, 20.0, {"validate": 5.0}, program=(28, 33),
                                 route=(25, 33), host_ref_us=1.05),
                         HostRow("fla", "varlen-1x64", note="error: boom")])
    assert lines[0].split()[:8] == ["case", "backend", "enqueue", "us", "GPU", "us", "host/GPU", "py"]
    assert lines[1].split()[:6] == ["varlen-1x64", "triton_generic", "40.0", "20.0", "2.00", "1.05"]
    assert lines[2].split()[:6] == ["varlen-1x64", "fla", "-", "-", "-", "-"]
    assert "validate 5.0, program 28/33, route 25/33" in lines[1] and lines[2].rstrip().endswith("error: boom")
    assert "program" not in lines[2] and "route" not in lines[2]
    stream = format_stream({"triton_generic": 900.0, "fla": 1500.0, "gluon_sm90": "error: x"})
    assert "0.900 ms  0.60x fla" in stream[1] and stream[2].split() == ["fla", "1.500", "ms"]
    assert stream[3].split() == ["gluon_sm90", "error:", "x"]


def test_host_flag_needs_a_gpu(capsys):
    args = parse("--host", "--host-calls", "7", "--host-rounds", "3", "--host-passes", "2")
    assert args.host and args.host_calls == 7 and args.host_rounds == 3 and args.host_passes == 2
    assert parse("--host").host_passes == 3
    assert bench.run(args, probe=FakeProbe(count=0)) == 2
    assert capsys.readouterr().err.startswith("bench needs a CUDA device")


# --------------------------------------------------------------------------- bench --startup (CPU parts)

from gdn_dispatch import bench_startup  # noqa: E402
from gdn_dispatch.bench_startup import RESULT_MARK, StartupReport, StartupRow  # noqa: E402


def test_startup_flag_defaults_off():
    assert parse().startup is False and parse("--startup").startup is True


def test_startup_without_gpu_exits_2(capsys):
    code = bench.run(parse("--startup"), probe=FakeProbe(count=0))
    assert code == 2
    assert "bench --startup needs a CUDA device; found none: no CUDA driver" in capsys.readouterr().err


def test_startup_bad_backends_is_a_usage_error(capsys):
    assert bench.run(parse("--startup", "--backends", "flash"), probe=FakeProbe(count=1)) == 2
    assert "unknown backend 'flash'" in capsys.readouterr().err


def test_run_child_reads_the_result_line():
    source = f"print('noise')\nprint({RESULT_MARK!r}, '{{\"seconds\": 1.5}}')\n"
    assert bench_startup.run_child(source, {}) == {"seconds": 1.5}


def test_run_child_passes_its_environment():
    source = f"import json, os\nprint({RESULT_MARK!r}, json.dumps({{'dir': os.environ['TRITON_CACHE_DIR']}}))\n"
    assert bench_startup.run_child(source, {"TRITON_CACHE_DIR": "/tmp/some-cache"}) == {"dir": "/tmp/some-cache"}


@pytest.mark.parametrize("source, timeout, message", [
    pytest.param("import sys\nprint('half done')\nsys.exit(3)", 60, "exit status 3, no result line (stdout: half done)",
                 id="exit-3"),
    pytest.param("print('nothing to report')", 60, "exit status 0, no result line", id="no-result"),
    pytest.param("import time\ntime.sleep(30)", 1, "no result within 1 s", id="timeout"),
])
def test_run_child_reports_what_went_wrong(source, timeout, message):
    assert message in bench_startup.run_child(source, {}, timeout=timeout)["error"]


def test_import_source_times_an_import_in_a_fresh_process():
    result = bench_startup.run_child(bench_startup.import_source("json"), {})
    assert 0 < result["seconds"] < 10


def test_task_source_names_the_task_and_its_parameters():
    source = bench_startup.task_source("first_call", device="cuda:1", backend="triton_generic")
    assert "child_task('first_call'" in source and '"backend": "triton_generic"' in source
    with pytest.raises(ValueError, match="task: expected 'first_call' or 'warmup', got 'nap'"):
        bench_startup.child_task("nap", device="cpu")


class StandInRunner:
    """Stands in for the child processes: records each (task, env), checks the cache the
    cold runs start from is empty and the warm runs' is not, and answers like a child."""

    def __init__(self, fail: str | None = None):
        self.runs, self.fail = [], fail

    def __call__(self, source, env):
        import json as _json
        import os as _os

        task = "import" if "child_task" not in source else ("warmup" if "'warmup'" in source else "first_call")
        backend = _json.loads(source.split("json.loads(")[1].split(")))")[0][1:-1]).get("backend") if task != "import" else None
        cache = env.get("TRITON_CACHE_DIR")
        cold = cache is not None and not _os.listdir(cache)
        self.runs.append((task, backend, cache, cold))
        if cache is not None:
            open(_os.path.join(cache, f"kernel-{len(self.runs)}"), "w").close()  # what a compile leaves
        if self.fail is not None and backend == self.fail:
            return {"error": "exit status 1, no result line"}
        if task == "import":
            return {"seconds": 0.5}
        if task == "first_call":
            return {"import_s": 1.0, "seconds": 4.0 if cold else 0.3}
        return {"seconds": 60.0 if cold else 5.0, "compiles": 40, "calls": 40, "backends": ["gluon_sm90"],
                "stream_compiles": 0}


def test_measure_runs_cold_then_warm_on_one_fresh_cache_per_backend():
    runner = StandInRunner()
    rows = bench_startup.measure("cuda:0", ["gluon_sm90", "triton_generic"], True, runner=runner, progress=False)
    imports = [r for r in runner.runs if r[0] == "import"]
    assert len(imports) == 2 * bench_startup.IMPORT_REPEATS and all(r[2] is None for r in imports)
    calls = [r for r in runner.runs if r[0] != "import"]
    assert [(task, backend, cold) for task, backend, _, cold in calls] == [
        ("first_call", "gluon_sm90", True), ("first_call", "gluon_sm90", False),
        ("first_call", "triton_generic", True), ("first_call", "triton_generic", False),
        ("first_call", "fla", True), ("first_call", "fla", False),
        ("warmup", None, True), ("warmup", None, False)]
    caches = [cache for _, _, cache, _ in calls]
    assert caches[0] == caches[1] and len(set(caches)) == 4  # a fresh folder per pair
    by_name = {row.what: row for row in rows}
    assert (by_name["first call: gluon_sm90"].cold_s, by_name["first call: gluon_sm90"].warm_s) == (4.0, 0.3)
    assert (by_name["warmup"].cold_s, by_name["warmup"].warm_compiles) == (60.0, 40)
    assert rows[-1].cold_compiles == rows[-1].warm_compiles == 0
    assert bench_startup.exit_status(rows) == 0


@pytest.mark.parametrize("fail, status", [("fla", 0), ("triton_generic", 1)])
def test_exit_status_fails_on_our_errors_not_fla(fail, status):
    rows = bench_startup.measure("cuda:0", ["triton_generic"], True, runner=StandInRunner(fail=fail), progress=False)
    failed = next(r for r in rows if r.what == f"first call: {fail}")
    assert failed.error == "exit status 1, no result line"
    assert bench_startup.exit_status(rows) == status


def test_exit_status_fails_when_a_batch_compiles_after_warmup():
    rows = [StartupRow("warmup", 1.0, 1.0), StartupRow("compiles over 60 ragged batches after warmup",
                                                       cold_compiles=0, warm_compiles=2)]
    assert bench_startup.exit_status(rows) == 1


def startup_report() -> StartupReport:
    return StartupReport(device="NVIDIA H200 (cuda:0)", versions={"triton": "3.6.0"}, rows=[
        StartupRow("import gdn_dispatch", cold_s=0.812, note="median of 3 fresh processes"),
        StartupRow("import fla", error="not importable: ModuleNotFoundError: No module named 'fla'"),
        StartupRow("warmup", cold_s=61.25, warm_s=4.5, cold_compiles=40, warm_compiles=40, note="40 calls"),
        StartupRow("compiles over 60 ragged batches after warmup", cold_compiles=0, warm_compiles=0),
    ])


def test_startup_table():
    lines = bench_startup.format_table(startup_report()).splitlines()
    assert lines[0].startswith("start-up on NVIDIA H200 (cuda:0) (triton 3.6.0)")
    assert "cold Triton cache" in lines[1] and "warm Triton cache" in lines[1]
    assert lines[2].split()[:4] == ["import", "gdn_dispatch", "0.81", "s"] and lines[2].count(" - ") == 1
    assert "not importable: ModuleNotFoundError" in lines[3]
    assert "61.25 s (40 compiles)" in lines[4] and "4.50 s (40 compiles)" in lines[4]
    assert lines[5].split()[-2:] == ["0", "0"]


def test_startup_json_round_trip(tmp_path):
    path = tmp_path / "startup.json"
    bench_startup.write_json(startup_report(), str(path))
    data = json.loads(path.read_text())
    assert data["device"] == "NVIDIA H200 (cuda:0)" and data["versions"] == {"triton": "3.6.0"}
    assert data["rows"][2] == {"what": "warmup", "cold_s": 61.25, "warm_s": 4.5, "cold_compiles": 40,
                               "warm_compiles": 40, "note": "40 calls", "error": ""}
    assert data["rows"][1]["cold_s"] is None


def test_gpu_backends_follow_the_registry():
    names = ["gluon_sm100", "gluon_sm90", "triton_generic", "reference"]
    assert bench_startup.gpu_backends(assumed_device("sm_90"), names) == ["gluon_sm90", "triton_generic"]
    assert bench_startup.gpu_backends(assumed_device("sm_80"), names) == ["triton_generic"]


# --------------------------------------------------------------------------- context parallelism

from gdn_dispatch import bench_cp, context_parallel  # noqa: E402
from gdn_dispatch.testing import rel_rms_error  # noqa: E402

H200_SMS = 132


def test_tp_shapes_are_the_issue_shards_as_varlen_calls():
    shapes = bench_shapes.tp_shapes()
    assert [s.name for s in shapes] == ["tp-H2-HV4-1x32768", "tp-H4-HV8-1x32768", "tp-H2-HV8-1x32768",
                                        "tp-H8-HV16-1x32768", "tp-H16-HV32-1x32768", "tp-H2-HV4-8x4096"]
    for s in shapes:
        assert (s.K, s.V, s.B, s.tokens) == (128, 128, 1, 32768) and s.is_varlen
    assert shapes[-1].seqlens == (4096,) * 8 and shapes[-1].N == 8


@pytest.mark.parametrize("patterns, listing, expected", [
    pytest.param(None, False, 10, id="default-table"),
    pytest.param(None, True, 16, id="listing-every-group"),
    pytest.param("tp*", False, 6, id="tp-group"),
    pytest.param("tp-H16*,H16-HV32-1x32768", False, ["H16-HV32-1x32768", "tp-H16-HV32-1x32768"], id="both-groups"),
])
def test_shapes_for(patterns, listing, expected):
    chosen = [s.name for s in bench_shapes.shapes_for(patterns, listing=listing)]
    assert chosen == expected if isinstance(expected, list) else len(chosen) == expected
    with pytest.raises(ValueError, match=r"'tp-H3\*' matches no shape; valid names: H16-HV32-1x8192.*tp-H2-HV4"):
        bench_shapes.shapes_for("tp-H3*")


def test_list_shapes_shows_the_tp_group():
    out = io.StringIO()
    assert bench.run(parse("--list-shapes", "--shapes", "tp*"), probe=FakeProbe(count=0), out=out) == 0
    assert [line.split()[0] for line in out.getvalue().splitlines()][0] == "tp-H2-HV4-1x32768"


@pytest.mark.parametrize("text, value", [("auto", "auto"), ("off", "off"), ("compare", "compare"), ("3", 3)])
def test_context_parallel_flag(text, value):
    assert parse("--context-parallel", text).context_parallel == value
    assert parse().context_parallel == "auto"


@pytest.mark.parametrize("text", ["0", "-2", "on", "1.5", ""])
def test_context_parallel_flag_rejects(text, capsys):
    with pytest.raises(SystemExit):
        parse("--context-parallel", text)
    assert f"expected auto, off, compare or a segment count >= 1, got {text!r}" in capsys.readouterr().err


def test_make_callers_times_off_and_auto_under_compare():
    made = []

    def caller(name, context_parallel):
        made.append((name, context_parallel))
        return (name, context_parallel)

    callers = bench_cp.make_callers(["gluon_sm90", "triton_generic"], "compare", caller)
    assert list(callers) == ["gluon_sm90[cp=off]", "gluon_sm90[cp=auto]", "triton_generic[cp=off]",
                             "triton_generic[cp=auto]"]
    assert made == [("gluon_sm90", "off"), ("gluon_sm90", "auto"), ("triton_generic", "off"),
                    ("triton_generic", "auto")]
    assert bench_cp.make_callers(["gluon_sm90"], 4, caller) == {"gluon_sm90": ("gluon_sm90", 4)}


def test_ours_caller_passes_context_parallel():
    x = bench_timing.make_input_sets(RAGGED, 1, "cpu", seed=0)[0]
    o_off, s_off = bench_timing.ours_caller("reference", context_parallel="off")(x)
    o_seg, s_seg = bench_timing.ours_caller("reference", context_parallel=2)(x)
    assert rel_rms_error(o_seg, o_off) <= 5e-3 and rel_rms_error(s_seg, s_off) <= 1e-5
    with pytest.raises(ValueError, match="context_parallel"):
        bench_timing.ours_caller("reference", context_parallel=0)(x)


def test_auto_decision_on_the_tp_shapes(monkeypatch):
    # Segmented up to 32 programs (N x HV x 2 V blocks); 16/32 heads make 64: off, or picked
    # on the device (the warm chain or "off") under a tuning that asks for it; 8 sequences of
    # 2/4 heads make 64 too, with 8 chunks a sequence: too short for two chained segments.
    on = {"tp-H2-HV4-1x32768", "tp-H4-HV8-1x32768", "tp-H2-HV8-1x32768", "tp-H8-HV16-1x32768"}
    assert on < {s.name for s in bench_shapes.tp_shapes()}
    for shape in bench_shapes.tp_shapes():
        decision = bench_cp.auto_decision(shape, H200_SMS)
        assert decision.enabled == (shape.name in on) and not decision.picked, shape.name
        if decision.enabled:
            assert decision.num_segments == shape.tokens // decision.seg_len + shape.N
    monkeypatch.setattr(context_parallel, "TUNING", context_parallel.PICKING)
    for shape in bench_shapes.tp_shapes():
        decision = bench_cp.auto_decision(shape, H200_SMS)
        assert decision.enabled == (shape.name in on | {"tp-H16-HV32-1x32768"}), shape.name
        assert decision.picked == (shape.name == "tp-H16-HV32-1x32768"), shape.name
    big = next(s for s in bench_shapes.default_shapes() if s.name == "H16-HV64-8x4096")
    assert not bench_cp.auto_decision(big, H200_SMS).enabled
    assert not bench_cp.auto_decision(bench_shapes.tp_shapes()[0], 0).enabled


def _result(shape, times):
    return ShapeResult(shape=shape, min_bytes=1, flops=1.0, bound_ms=0.1, bound_by="memory", input_sets=1,
                       measurements=[Measurement(backend=name, ms=ms) for name, ms in times.items()])


def test_crossover_rows_and_table():
    tp, big = bench_shapes.tp_shapes()[0], next(s for s in bench_shapes.default_shapes()
                                                if s.name == "H16-HV64-8x4096")
    results = [
        _result(tp, {"gluon_sm90[cp=off]": 0.84, "gluon_sm90[cp=auto]": 0.21, "fla": 0.78,
                     "triton_generic[cp=off]": 0.85}),
        _result(big, {"gluon_sm90[cp=off]": 2.0, "gluon_sm90[cp=auto]": 2.0, "triton_generic[cp=off]": 2.5,
                      "triton_generic[cp=auto]": 2.5}),
    ]
    rows = bench_cp.crossover_rows(results, ["gluon_sm90", "triton_generic"], H200_SMS,
                                   lambda name: name == "gluon_sm90")
    decision = bench_cp.auto_decision(tp, H200_SMS)
    assert [(r.shape, r.backend, r.off_ms, r.auto_ms, r.segments) for r in rows] == [
        (tp.name, "gluon_sm90", 0.84, 0.21, f"{decision.num_segments} x {decision.seg_len}"),
        (tp.name, "triton_generic", 0.85, None, "off"),  # its row runs no segments; auto failed
        (big.name, "gluon_sm90", 2.0, 2.0, "off"),
        (big.name, "triton_generic", 2.5, 2.5, "off"),
    ]
    assert rows[0].speedup == pytest.approx(4.0) and rows[1].speedup is None
    table = bench_cp.format_crossover(rows)
    assert table[0].startswith("| shape | backend | off ms | auto ms |") and len(table) == 2 + len(rows)
    assert table[2] == f"| {tp.name} | gluon_sm90 | 0.840 | 0.210 | 4.00 | {rows[0].segments} |"
    assert table[3] == f"| {tp.name} | triton_generic | 0.850 | - | - | off |"


@pytest.mark.gpu
@pytest.mark.skipif(not has_cuda, reason="needs a CUDA GPU")
def test_bench_compare_on_gpu(tmp_path):
    """``--context-parallel compare`` on a tensor-parallel shard: every runnable backend timed
    with off and auto, the crossover table printed and in the JSON report."""
    path = tmp_path / "bench.json"
    out = io.StringIO()
    code = bench.run(parse("--shapes", "tp-H2-HV4-1x32768", "--iters", "3", "--warmup", "1", "--context-parallel",
                           "compare", "--backends", "triton_generic", "--json", str(path)), out=out)
    text = out.getvalue()
    assert code == 0, text
    assert "triton_generic[cp=off]" in text and "triton_generic[cp=auto]" in text
    assert "| tp-H2-HV4-1x32768 | triton_generic |" in text
    report = json.loads(path.read_text())
    assert report["settings"]["context_parallel"] == "compare"
    (row,) = report["context_parallel"]
    assert row["off_ms"] > 0 and row["auto_ms"] > 0 and " x " in row["segments"]


def test_bench_rows_name_their_launches(monkeypatch):
    """On a GPU each of our rows notes the kernels its backend launched (gluon_sm90: the
    warp-specialized path or the pipeline); a name the registry does not know, fla, and a
    row that did not run get no note. Planned here for an H200 from CPU tensors (the
    backend's tensor check stubbed out)."""
    from gdn_dispatch.backends import gluon_sm90
    from gdn_dispatch.bench_shapes import BenchShape
    from gdn_dispatch.device import assumed_device

    monkeypatch.setattr(gluon_sm90, "unsupported_reason", lambda problem: None)
    describe = bench.launch_describer("cpu", assumed_device("sm_90"))
    many = BenchShape(name="ws", B=4, T=128, H=16, HV=32, K=128, V=128)
    few = BenchShape(name="pipe", B=1, T=128, H=16, HV=32, K=128, V=128)
    assert describe("gluon_sm90", bench_timing.make_input_sets(many, 1, "cpu", 0)[0]) == "fused_fwd"
    assert describe("gluon_sm90", bench_timing.make_input_sets(few, 1, "cpu", 0)[0]) == "wy_fwd, state_output_fwd"
    assert describe("gluon_sm90[cp=off]", bench_timing.make_input_sets(few, 1, "cpu", 0)[0]) == ""
    forced = bench.launch_describer("cpu", assumed_device("sm_90"), context_parallel=2)
    assert forced("gluon_sm90", bench_timing.make_input_sets(many, 1, "cpu", 0)[0]) == \
        "wy_fwd, segment_map_fwd, segment_scan, state_output_fwd"
    assert bench.launch_describer("cpu") is None

    def ok(x):
        return None

    def broken(x):
        raise RuntimeError("boom")

    result = bench_timing.bench_shape(SMALL, bench_timing.make_input_sets(SMALL, 1, "cpu", 0),
                                      {"triton_generic": ok, "reference": broken, "fla": ok}, bandwidth=1e12,
                                      matmul_rate=1e14, timer=fake_timer, warmup=0, iters=1,
                                      describe=lambda name, x: f"launches of {name}")
    by = {m.backend: m.note for m in result.measurements}
    assert by == {"triton_generic": "launches of triton_generic", "reference": "error: RuntimeError: boom", "fla": ""}
