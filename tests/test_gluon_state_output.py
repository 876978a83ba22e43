"""The fused state + output kernel (backends/gluon_common/state_output.py).

CPU: launch plans as dry runs (grid over (sequence, v-head, V-block), the V-block choice,
descriptors over the 2-D views of the packed token axis, shared memory and TMEM within
budget), the AOT list, the launch's argument binding and the empty call. Its compiles for
sm_90a and sm_100a run in tests/test_gluon_aot.py (the list is part of both backends').

GPU (sm_90 or sm_100 only): the fused kernel on wy's w, u and gate cumsum, against the
float32 reference (gdn_dispatch.reference.forward), with NaN-poisoned outputs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from gdn_dispatch.aot import TMEM_COLUMNS  # noqa: E402
from gdn_dispatch.device import SMEM_OPTIN, DeviceInfo, assumed_device  # noqa: E402
from gdn_dispatch.testing import (  # noqa: E402
    PLAN_SHAPES, LaunchRecorder, poison_cuda_allocator, random_problem, rel_rms_error)

from gdn_dispatch.backends.gluon_common import state_output as so  # noqa: E402
from gdn_dispatch.backends.gluon_common import state_output_ws  # noqa: E402
from gdn_dispatch.backends.gluon_common.launch_plan import MAX_STATE_TILE, has_tails  # noqa: E402

SM90, SM100 = (9, 0), (10, 0)


def _engine(capability):
    """The matrix engine of the backend that runs ``capability`` (the plans' ``ENGINE``)."""
    from gdn_dispatch.backends import gluon_sm90, gluon_sm100

    return (gluon_sm100 if capability[0] == 10 else gluon_sm90).ENGINE


def _problem(K=128, V=128, ht=True, **kwargs):
    return random_problem(K=K, V=V, ht=ht, **kwargs)


def _device(capability, sm_count=None):
    info = assumed_device(f"sm_{capability[0]}{capability[1]}")
    if sm_count is None:
        return info
    return DeviceInfo(kind="cuda", index=0, name=info.name, capability=capability, sm_count=sm_count,
                      smem_optin=info.smem_optin)


# ---------------------------------------------------------------------------------------
# Plans


SHAPES = [pytest.param(shape, id=name) for shape, name in PLAN_SHAPES]


@pytest.mark.parametrize("capability", [SM90, SM100], ids=["sm90", "sm100"])
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("H, HV", [(1, 1), (2, 4), (1, 4)], ids=["H1-HV1", "H2-HV4", "H1-HV4"])
@pytest.mark.parametrize("shape", SHAPES)
def test_plan_grid_and_descriptors(shape, H, HV, layout, capability):
    p = _problem(**shape, H=H, HV=HV, layout=layout)
    launch = so.plan_state_output(p, capability)
    K, V, BT = p.K, p.V, 64
    BV, rows = launch.blocks["BV"], p.B * p.T
    assert launch.kernel == "state_output_fwd" and (BV, launch.num_warps) in so.CONFIGS
    assert launch.grid == (p.N * HV * (V // BV),)
    assert launch.blocks["NV"] == V // BV
    assert launch.scalars == {"HV": HV, "GROUP": HV // H, "V": V}
    scatters = capability == SM100 and has_tails(p)
    # The warp-specialized walk where one warpgroup holds the state at K = 128 on sm_90a.
    ws = capability == SM90 and K == 128 and launch.num_warps == 4
    assert launch.constexprs == {"USE_H0": True, "STORE_HT": True, "STATE_VK": layout == "vk",
                                 "USE_L2NORM": False, "HAS_TAILS": has_tails(p), "ENGINE": _engine(capability),
                                 "DEFER_OUT": not ws and so.state_output_defers(K, BV, capability == SM100,
                                                                                launch.num_warps),
                                 "USE_POOL": False, "INPLACE": False, "CHAIN": False, "WS": ws, "PICK": False,
                                 "NUM_BUF": so.state_output_ring_slots(K, BV, 2, launch.num_warps,
                                                                       smem_per_block=SMEM_OPTIN[capability], ws=ws),
                                 **({} if scatters else {"o_rows_desc": None})}
    expected = {
        "q_desc": ("q", (rows, H * K), (BT, K)),
        "k_desc": ("k", (rows, H * K), (BT, K)),
        "w_desc": ("w", (rows, HV * K), (BT, K)),
        "u_desc": ("u", (rows, HV * V), (BT, BV)),
        "o_desc": ("o", (rows, HV * V), (BT, BV)),
        "o_rows_desc": ("o", (rows, HV * V), (1, BV)),
    }
    if not scatters:
        del expected["o_rows_desc"]
    assert {d.arg for d in launch.descriptors} == set(expected)
    for arg, (tensor, shape_, block) in expected.items():
        d = launch.desc(arg)
        assert (d.tensor, d.shape, d.strides, d.block_shape) == (tensor, shape_, (shape_[1], 1), block), arg
        assert d.token_rows == (tensor in ("q", "k")), arg  # inputs read in place, at their own row stride
        assert d.dtype == p.dtype and d.strides[0] * 2 % 16 == 0
    # The ring holds w, k and q in one allocation of w's layout: their tiles must agree.
    assert launch.desc("q_desc").layout == launch.desc("k_desc").layout == launch.desc("w_desc").layout
    if scatters:
        # The scatter descriptor carries the layout of the staged [64, BV] o tile.
        assert launch.desc("o_rows_desc").layout == launch.desc("o_desc").layout
    assert launch.blocks["smem_bytes"] <= SMEM_OPTIN[capability]
    assert launch.blocks["tmem_columns"] <= (TMEM_COLUMNS if capability == SM100 else 0)


@pytest.mark.parametrize("capability", [SM90, SM100], ids=["sm90", "sm100"])
def test_every_planned_descriptor_builds_on_its_tensor(capability):
    p = _problem(lengths=[1, 63, 64, 65, 130, 0], H=2, HV=4)
    for d in so.plan_state_output(p, capability).descriptors:
        desc = d.build(torch.empty(d.shape, dtype=d.dtype))
        assert list(desc.block_shape) == list(d.block_shape) and desc.layout == d.layout


@pytest.mark.parametrize(
    "K, V, heads, sms, expected",
    [
        (128, 128, 32, 132, (32, 4)),    # one wave at any BV: the narrowest block
        (128, 128, 64, 132, (64, 4)),    # 256 programs at BV = 32 would need two waves
        (128, 128, 128, 132, (128, 8)),  # one wave only at BV = 128
        (128, 128, 512, 132, (128, 8)),  # many programs: the widest block
        (128, 128, 64, 264, (32, 4)),    # twice the SMs: BV = 32 fits one wave again
        (128, 64, 128, 132, (64, 4)),
        (64, 128, 66, 132, (32, 4)),     # two one-warpgroup programs per SM at K = 64
        (64, 128, 67, 132, (64, 4)),
        (64, 64, 1, 132, (32, 4)),       # never below 32
    ],
)
def test_config_choice(K, V, heads, sms, expected):
    BV, warps = so.state_output_config(K, V, heads, sms)
    assert (BV, warps) == expected
    assert BV in so.BLOCK_V and V % BV == 0 and warps >= so.state_output_warps(K, BV)


def test_programs_per_sm():
    assert so.state_output_programs_per_sm(128) == 1
    assert so.state_output_programs_per_sm(64) == 2
    assert so.state_output_programs_per_sm(64, 64, warps=8) == 1
    assert so.state_output_programs_per_sm(64, 128) == 1


def test_plan_follows_the_device_sm_count():
    p = _problem(batch=(8, 64), H=16, HV=64, K=64)  # N * HV = 512 (sequence, v-head) pairs
    small = so.plan_state_output(p, _device(SM100, sm_count=8))
    assert (small.blocks["BV"], small.num_warps) == (64, 4)
    big = so.plan_state_output(p, _device(SM100, sm_count=1024))
    assert (big.blocks["BV"], big.num_warps) == (32, 4)


def test_block_v_override_checked():
    p = _problem(lengths=[10], K=128, V=64)
    for capability in (SM90, SM100):
        for bv in (32, 64):
            assert so.plan_state_output(p, capability, block_v=bv).blocks["BV"] == bv
    with pytest.raises(ValueError, match="block_v: expected 32, 64 or 128 dividing V = 64, got 128"):
        so.plan_state_output(p, SM100, block_v=128)
    with pytest.raises(ValueError, match="block_v: expected 32, 64 or 128 dividing V = 64, got 16"):
        so.plan_state_output(p, SM90, block_v=16)
    wide = _problem(lengths=[10], K=128, V=128)
    with pytest.raises(ValueError, match=r"num_warps: expected 4 or 8 holding the \[128, 128\] state tile"):
        so.plan_state_output(wide, SM90, block_v=128, num_warps=4)
    with pytest.raises(ValueError, match="num_warps: expected 4 or 8"):
        so.plan_state_output(wide, SM90, block_v=32, num_warps=2)
    with pytest.raises(ValueError, match="defer_out: sm_90a only"):
        so.plan_state_output(wide, SM100, block_v=32, defer_out=True)
    launch = so.plan_state_output(wide, SM90, block_v=32, num_warps=8, defer_out=False)
    assert launch.num_warps == 8 and launch.constexprs["DEFER_OUT"] is False
    with pytest.raises(ValueError, match="sm_90 or sm_100"):
        so.plan_state_output(p, (8, 0))


@pytest.mark.parametrize("K, BV, warps", [(128, 32, 4), (128, 64, 4), (128, 128, 8), (64, 64, 4), (64, 128, 4)])
def test_warps_hold_the_state_tile(K, BV, warps):
    # At most 8192 fp32 state values per warpgroup: 64 registers per thread.
    assert so.state_output_warps(K, BV) == warps
    assert K * BV // (warps // 4) <= MAX_STATE_TILE


def test_deferred_output_is_sm90_and_below_the_largest_tile():
    assert so.state_output_defers(128, 32, False) and so.state_output_defers(64, 64, False)
    # 64 state registers per thread: the deferred accumulator spilled there.
    assert not so.state_output_defers(128, 64, False) and not so.state_output_defers(128, 128, False)
    assert not any(so.state_output_defers(K, BV, True) for K in (64, 128) for BV in (32, 64, 128))


@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("BV", [32, 64, 128])
def test_smem_and_tmem_budget(K, BV):
    # Ring of six [64, K] tiles, u ring, h, v_new, vs, o, A: e.g. K = 128, BV = 64:
    # 96 + 16 + 16 + 24 + 8 KB.
    smem = so.state_output_smem_bytes(K, BV, 2)
    assert smem == 2 * (6 * 64 * K + 2 * 64 * BV + K * BV + 3 * 64 * BV + 64 * 64) + 72
    # Room for the compiler's scratch (the compiled kernels' totals: tests/test_gluon_aot.py).
    assert smem <= SMEM_OPTIN[SM90] - 8 * 1024
    p = _problem(lengths=[100], K=K, V=128)
    assert so.plan_state_output(p, SM100, block_v=BV).blocks["tmem_columns"] == 3 * BV + 64 <= TMEM_COLUMNS
    # K = 64, BV = 64: two programs per SM on sm_90a.
    assert so.state_output_smem_bytes(64, 64, 2) < SMEM_OPTIN[SM90] // 2 - 8 * 1024


@pytest.mark.parametrize("most, K, BV, warps, slots", [
    (2, 128, 64, 4, 2), (3, 128, 64, 4, 3), (3, 128, 32, 4, 3),
    (3, 128, 128, 8, 2),  # three slots would not fit (287 KB)
    (3, 64, 64, 4, 2),  # three would fit one program per SM where two slots fit two
])
def test_ring_slots_fit_without_fewer_programs(monkeypatch, most, K, BV, warps, slots):
    """A plan takes up to RING_SLOTS_MAX ring slots where their shared memory fits with as
    many programs per SM as two slots allow; its smem_bytes follow."""
    monkeypatch.setattr(so, "RING_SLOTS_MAX", most)
    assert so.state_output_ring_slots(K, BV, 2, warps) == slots
    launch = so.plan_state_output(_problem(lengths=[100], K=K, V=128), SM90, block_v=BV, num_warps=warps, ws=False)
    assert launch.constexprs["NUM_BUF"] == slots
    assert launch.blocks["smem_bytes"] == so.state_output_smem_bytes(K, BV, 2, slots=slots)


@pytest.mark.parametrize("l2, lengths, slots", [(False, [100, 70], 3), (True, [128, 64], 3), (True, [100, 70], 2)])
def test_ring_slots_stay_at_two_where_the_registers_are_full(l2, lengths, slots):
    """Three slots by default at K = V = 128, BV = 64 on one warpgroup; two on sm_90a with
    the qk l2 norm and varlen tails (the register-bound build, where a third slot
    spilled); sm_100a's accumulators are not registers: three there."""
    p = _problem(lengths=lengths, K=128, V=128, l2=l2)
    assert so.plan_state_output(p, SM90, block_v=64, ws=False).constexprs["NUM_BUF"] == slots
    assert so.plan_state_output(p, SM100, block_v=64).constexprs["NUM_BUF"] == 3


def test_three_ring_slots_compile_within_shared_memory():
    """The kernel's lead of NUM_BUF - 1 chunks at three slots (K = V = 128, BV = 64) compiles
    for sm_90a and sm_100a within the part's shared memory, without spills."""
    import dataclasses

    from gdn_dispatch.aot import compile_kernel

    p = _problem(lengths=[100, 70], K=128, V=128)
    for capability, backend in ((SM90, "gluon_sm90"), (SM100, "gluon_sm100")):
        launch = so.plan_state_output(p, capability, block_v=64, ws=False)
        launch = dataclasses.replace(launch.shared, constexprs={**launch.constexprs, "NUM_BUF": 3})
        report = compile_kernel(so.state_output_aot_kernel(backend, launch, torch.bfloat16, "three-slots"),
                                capability)
        assert report.shared_bytes <= SMEM_OPTIN[capability], capability
        assert report.shared_bytes >= so.state_output_smem_bytes(128, 64, 2, slots=3), capability
        assert report.spill_bytes == 0, capability


@pytest.mark.parametrize("BV, slots", [(32, 3), (64, 2)])
def test_warp_specialized_walk_plan(monkeypatch, BV, slots):
    """With STATE_OUTPUT_WS (the default) the sm_90a plans at K = 128 on one warpgroup take
    the warp-specialized walk: WS on, o not deferred (the output partition stores it), the
    ring slots that fit its second h and v_new tile; elsewhere (sm_100a, two warpgroups,
    K = 64, chained segments, o's deferral asked for) the one-warpgroup walk."""
    p = _problem(lengths=[100, 0, 70], K=128, V=128)
    assert so.STATE_OUTPUT_WS
    launch = so.plan_state_output(p, SM90, block_v=BV)
    flags = launch.constexprs
    assert flags["WS"] and not flags["DEFER_OUT"] and flags["NUM_BUF"] == slots and launch.num_warps == 4
    smem = so.state_output_smem_bytes(128, BV, 2, slots=slots, ws=True)
    assert launch.blocks["smem_bytes"] == smem <= SMEM_OPTIN[SM90] - 2 * 1024
    # A second h [K, BV] and v_new [64, BV] tile, each further output partition's A [64, 64]
    # and o [64, BV] tiles, a third barrier per slot and three more MMA-site barriers.
    more = state_output_ws.output_partitions(BV, False) - 1
    assert smem - so.state_output_smem_bytes(128, BV, 2, slots=slots) == \
        2 * (128 * BV + 64 * BV + more * (64 * 64 + 64 * BV)) + 8 * (slots + 4 + 3 * more)
    assert "warp-specialized" in launch.notes
    assert not so.chained_plan(launch.shared).constexprs["WS"]
    assert not so.plan_state_output(p, SM90, block_v=128).constexprs["WS"]  # two warpgroups of state
    assert not so.plan_state_output(p, SM100, block_v=BV).constexprs["WS"]
    assert not so.plan_state_output(_problem(lengths=[100], K=64, V=128), SM90, block_v=BV).constexprs["WS"]
    assert not so.plan_state_output(p, SM90, block_v=BV, defer_out=True).constexprs["WS"]
    with pytest.raises(ValueError, match="defer_out: the one-warpgroup walk's"):
        so.plan_state_output(p, SM90, block_v=BV, ws=True, defer_out=True)
    monkeypatch.setattr(so, "STATE_OUTPUT_WS", False)
    assert not so.plan_state_output(p, SM90, block_v=BV).constexprs["WS"]
    assert so.plan_state_output(p, SM90, block_v=BV, ws=True).constexprs["WS"]
    with pytest.raises(ValueError, match="ws: the warp-specialized walk runs on sm_90a"):
        so.plan_state_output(p, SM100, block_v=BV, ws=True)
    with pytest.raises(ValueError, match="ws: .*not 8 warps"):
        so.plan_state_output(p, SM90, block_v=128, ws=True)


def test_warp_specialized_walk_reaches_the_call_plans(monkeypatch):
    """The flag reaches the forward's dry run: an unsegmented pipeline call (16/32 x 32768
    tokens: BV = 32) and context parallelism's pass 2 at BV = 64 (2/4 x 32768) take the
    warp-specialized walk; chained segments' pass 2, pass 2 at BV = 128 (16/32 in 4
    segments) and the warp-specialized path's calls do not."""
    import importlib

    from gdn_dispatch.contract import make_problem
    from gdn_dispatch.testing import random_call

    from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache

    forward = importlib.import_module("gdn_dispatch.backends.gluon_common.forward")
    monkeypatch.setattr(so, "STATE_OUTPUT_WS", True)
    clear_plan_cache()
    try:
        device = _device(SM90)
        call = random_call(lengths=[32768], H=16, HV=32, K=128, V=128, dtype=torch.bfloat16, seed=2)
        off = forward.plan_call(make_problem(**call, output_final_state=True, context_parallel="off"), device)
        assert off.state_output.constexprs["WS"] and off.state_output.blocks["BV"] == 32
        wide = forward.plan_call(make_problem(**call, output_final_state=True, context_parallel=4), device)
        assert wide.segments is not None and wide.state_output.blocks["BV"] == 128
        assert not wide.state_output.constexprs["WS"]
        assert not forward.CallPlan(context_parallel=dataclasses.replace(wide.context_parallel, chained=True),
                                    launches=wide.launches, segments=None).state_output.constexprs["WS"]
        shard = random_call(lengths=[32768], H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, seed=2)
        segmented = forward.plan_call(make_problem(**shard, output_final_state=True), device)
        assert segmented.segments is not None and segmented.state_output.blocks["BV"] == 64
        assert segmented.state_output.constexprs["WS"]
        many = random_call(batch=(4, 256), H=16, HV=32, K=128, V=128, dtype=torch.bfloat16, seed=2)
        assert forward.plan_call(make_problem(**many, output_final_state=True), device).launches.fused
    finally:
        clear_plan_cache()


@pytest.mark.slow
def test_warp_specialized_walk_compiles():
    """The warp-specialized walk builds for sm_90a at K = V = 128, BV = 32 and 64, with
    tails, the qk l2 norm, "vk" states and a pool written in place: no spills, within
    the shared memory its plan counts (plus the compiler's scratch), the chain's warpgroup
    and one per output partition (``reqntid``) in ``warp_specialize`` partitions, and every
    MMA of the one-warpgroup walk (36 wgmma instructions at K = 128: P 8, the update 8;
    per output partition q k^T 8, q h 8, A v_new 4)."""
    import re

    from gdn_dispatch.aot import compile_kernel

    flags = dict(dtype=torch.bfloat16, tails=True, vk=False, h0=True, ht=True, l2=False, pool=False, inplace=False,
                 state_dtype=torch.float32, index_dtype=torch.int32, cu_dtype=torch.int32)
    cases = [(32, {}), (32, {"l2": True, "vk": True}), (64, {"tails": False}),
             (64, {"pool": True, "inplace": True, "l2": True})]
    for BV, more in cases:
        f = {**flags, **more}
        launch = so.plan_state_output(so._aot_problem(128, 128, **f), SM90, block_v=BV, ws=True)
        report = compile_kernel(so.state_output_aot_kernel("gluon_sm90", launch, f["dtype"], f"ws-{BV}"), SM90)
        assert report.spill_bytes == 0, (BV, more)
        planned = launch.blocks["smem_bytes"]
        assert planned <= report.shared_bytes <= planned + so.SMEM_SCRATCH, (BV, more)
        parts = state_output_ws.output_partitions(BV, f["l2"])
        assert f".reqntid {128 * (1 + parts)}" in report.ptx and "ttg.warp_specialize" in report.ttgir, (BV, more)
        assert len(re.findall(r"wgmma\.mma_async", report.ptx)) == 16 + 20 * parts, (BV, more)


@pytest.mark.slow
def test_two_output_partitions_refuse_a_one_slot_ring():
    """Two output partitions sharing one ring slot would let a partition's wait pass a phase
    that has not opened yet (the walk's static assert): a build with ``NUM_BUF`` 1 fails
    to compile, naming the slots (the shipped builds compile in
    :func:`test_warp_specialized_walk_compiles`)."""
    import dataclasses

    from triton.compiler.errors import CompilationError

    from gdn_dispatch.aot import compile_kernel

    flags = dict(dtype=torch.bfloat16, tails=True, vk=False, h0=True, ht=True, l2=False, pool=False, inplace=False,
                 state_dtype=torch.float32, index_dtype=torch.int32, cu_dtype=torch.int32)
    launch = so.plan_state_output(so._aot_problem(128, 128, **flags), SM90, block_v=64, ws=True).shared
    assert launch.constexprs["NUM_BUF"] == 2 and state_output_ws.output_partitions(64, False) == 2
    one = dataclasses.replace(launch, constexprs={**launch.constexprs, "NUM_BUF": 1})
    with pytest.raises(CompilationError) as refused:
        compile_kernel(so.state_output_aot_kernel("gluon_sm90", one, torch.bfloat16, "ws-one-slot"), SM90)
    # The walk's assertion, raised inside the kernel's call of it.
    assert "two output partitions need two ring slots" in str(refused.value.__cause__)


_OTHER_BUILD = """
import json, sys, torch
from triton.experimental.gluon import language as gl
from gdn_dispatch.backends.gluon_common import state_output_ws
setattr(state_output_ws, sys.argv[1], gl.constexpr(int(sys.argv[2])))
from gdn_dispatch.aot import compile_kernel
from gdn_dispatch.device import assumed_device
from gdn_dispatch.backends.gluon_common import state_output as so
out = []
for BV, l2 in ((32, False), (64, True)):
    flags = dict(dtype=torch.bfloat16, tails=True, vk=False, h0=True, ht=True, l2=l2, pool=False, inplace=False,
                 state_dtype=torch.float32, index_dtype=torch.int32, cu_dtype=torch.int32)
    launch = so.plan_state_output(so._aot_problem(128, 128, **flags), assumed_device("sm_90"), block_v=BV, ws=True)
    report = compile_kernel(so.state_output_aot_kernel("gluon_sm90", launch, torch.bfloat16, "ws"), (9, 0))
    out.append([report.spill_bytes, report.shared_bytes, launch.blocks["smem_bytes"], launch.constexprs["NUM_BUF"]])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_other_output_partition_count_compiles():
    """:data:`.state_output_ws.OUTPUT_PARTITIONS` is read by the kernel at compile time
    (fixed per process): the count not shipped builds in a child process, at BV = 32 and
    (with the qk l2 norm) 64, without spills and within the shared memory its plan counts."""
    other = 3 - state_output_ws.OUTPUT_PARTITIONS.value
    for spills, shared, planned, _ in _other_builds("OUTPUT_PARTITIONS", other):
        assert spills == 0 and planned <= shared <= planned + so.SMEM_SCRATCH <= SMEM_OPTIN[SM90]


def _other_builds(flag: str, value: int) -> list:
    """[spill bytes, shared bytes, planned bytes, ring slots] of :data:`_OTHER_BUILD`'s two
    builds with ``state_output_ws.<flag>`` at ``value``, compiled in a child process."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _OTHER_BUILD, flag, str(value)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_third_h_v_new_slot_compiles_where_the_ring_has_three():
    """:data:`.state_output_ws.HV_SLOTS_MAX` at three (off as shipped): at BV = 32 the ring
    keeps its three slots and the walk takes a third h / v_new slot, 12 KB more than the
    shipped plan and within the SM's shared memory, without spills; at BV = 64 (with the qk
    l2 norm) the ring has two slots, so the walk keeps two and compiles as shipped."""
    shipped = state_output_ws.HV_SLOTS_MAX.value
    (spills32, shared32, planned32, ring32), (spills64, shared64, planned64, ring64) = _other_builds(
        "HV_SLOTS_MAX", 3)
    assert shipped == 2 and ring32 == 3 and ring64 == 2
    assert state_output_ws.hv_slots(3) == 2 and state_output_ws.hv_slots(2) == 2
    extra = (128 * 32 + 64 * 32) * 2 + 2 * 8
    assert planned32 == so.state_output_smem_bytes(128, 32, 2, slots=3, ws=True) + extra
    assert planned64 == so.state_output_smem_bytes(128, 64, 2, slots=2, ws=True, l2=True)
    for spills, shared, planned in ((spills32, shared32, planned32), (spills64, shared64, planned64)):
        assert spills == 0 and planned <= shared <= planned + so.SMEM_SCRATCH <= SMEM_OPTIN[SM90]


def test_plan_flags():
    p = _problem(lengths=[5, 70], layout="vk", h0=False, ht=False, l2=True, dtype=torch.float16)
    launch = so.plan_state_output(p, SM90)
    # The warp-specialized walk (one warpgroup of state at K = 128): o is not deferred there.
    assert launch.constexprs == {"USE_H0": False, "STORE_HT": False, "STATE_VK": True, "USE_L2NORM": True,
                                 "HAS_TAILS": True, "ENGINE": _engine(SM90), "DEFER_OUT": False,
                                 "o_rows_desc": None, "USE_POOL": False, "INPLACE": False, "NUM_BUF": 3,
                                 "CHAIN": False, "WS": True, "PICK": False}
    assert launch.blocks["BV"] == 32  # not the register-bound BV = 64 build: a third slot
    assert launch.desc("q_desc").signature.startswith("tensordesc<fp16[64, 128],NVMMASharedLayout(")
    assert launch.maxnreg is None and so.plan_state_output(p, SM100).maxnreg == 255


# ---------------------------------------------------------------------------------------
# AOT list


@pytest.mark.parametrize("capability", [SM90, SM100], ids=["sm90", "sm100"])
def test_aot_list(capability):
    backend = "gluon_sm100" if capability == SM100 else "gluon_sm90"
    kernels = so.state_output_kernels_for_aot(capability, backend)
    # Every (K, V) x every configuration whose warps hold the state tile (10), x tails x
    # layout x (bf16 with and without l2, fp16 without: its calls with the norm run on
    # normalized copies) (12); then three initial/final state flips; two pools per
    # configuration, a pool only read and a bfloat16 initial state; int64 cu_seqlens at
    # K = V = 128 (3 configurations), and there context parallelism's second pass (tails x
    # l2, one of them already among the flips); chained segments' pass 2 at K = V = 128 (3
    # configurations x a float32 "kv" state and a bfloat16 "vk" pool written back).
    configs = [(K, V, BV, w) for K in (64, 128) for V in (64, 128) for BV, w in so.CONFIGS
               if V % BV == 0 and K * BV * 4 <= MAX_STATE_TILE * w]
    assert len(configs) == 10
    assert len(kernels) == len(configs) * 12 + 3 + len(configs) * 2 + 2 + 3 + 3 * 4 - 1 + 3 * 2
    assert not [k for k in kernels if k.constexprs["USE_L2NORM"] and k.signature["o_ptr"] == "*fp16"]
    chained = [k for k in kernels if k.constexprs["CHAIN"]]
    assert len(chained) == 6 and all(k.specialization.endswith("-chain") for k in chained)
    assert {(k.signature["f_start"], k.signature["chain_flags"], k.signature["hand"]) for k in chained} == \
        {("*i32", "*i32", "*fp32")}
    assert {(k.constexprs["USE_POOL"], k.constexprs["STATE_VK"], k.constexprs["STORE_HT"]) for k in chained} == \
        {(False, False, True), (True, True, False)}
    kernels = [k for k in kernels if not k.constexprs["CHAIN"]]
    # Segments start from float32 "kv" states and return no final state of their own.
    pass2 = {(k.signature["u_desc"], k.num_warps, k.constexprs["HAS_TAILS"], k.constexprs["USE_L2NORM"])
             for k in kernels
             if "[64, 128]" in k.signature["k_desc"] and k.constexprs["V"] == 128 and k.constexprs["USE_H0"]
             and not k.constexprs["STORE_HT"] and not k.constexprs["USE_POOL"] and not k.constexprs["STATE_VK"]
             and k.signature["h0"] == "*fp32" and k.signature["o_ptr"] == "*bf16"}
    assert len(pass2) == 3 * 4
    assert {k.signature["cu_seqlens"] for k in kernels} == {"*i32", "*i64"}
    assert len({k.specialization for k in kernels}) == len(kernels)
    for k in kernels:
        assert k.kernel == "state_output_fwd" and k.backend == backend and k.dialect == "gluon"
        assert list(k.signature) == list(k.fn.arg_names)
        assert k.constexprs["ENGINE"] is _engine(capability)
    blocks = {(k.constexprs["V"], k.signature["u_desc"].split("[")[1].split("]")[0]) for k in kernels}
    assert (128, "64, 32") in blocks and (128, "64, 64") in blocks and (128, "64, 128") in blocks
    assert {k.num_warps for k in kernels} == {4, 8}
    assert {k.constexprs["DEFER_OUT"] for k in kernels} == ({False} if capability == SM100 else {False, True})
    for flag in ("STATE_VK", "HAS_TAILS", "USE_L2NORM", "USE_H0", "STORE_HT", "USE_POOL", "INPLACE"):
        assert {k.constexprs[flag] for k in kernels} == {False, True}, flag
    pools = [k for k in kernels if k.constexprs["USE_POOL"]]
    # Every configuration with a written-back pool of each dtype, layout and index dtype.
    written = [k for k in pools if k.constexprs["INPLACE"]]
    assert len(written) == 2 * len(configs)
    assert {(k.constexprs["V"], k.signature["w_desc"], k.signature["u_desc"], k.num_warps) for k in written} == \
        {(k.constexprs["V"], k.signature["w_desc"], k.signature["u_desc"], k.num_warps) for k in kernels
         if k.signature["o_ptr"] == "*bf16"}
    assert {(k.signature["h0"], k.signature["state_indices"], k.constexprs["STATE_VK"]) for k in written} == \
        {("*fp32", "*i32", False), ("*bf16", "*i64", True)}
    assert all(k.constexprs["USE_H0"] for k in pools)
    assert {k.signature["h0"] for k in kernels if not k.constexprs["USE_POOL"]} == {"*fp32", "*bf16"}
    # Without a pool, cu_seqlens stands in for the (unread) indices.
    assert all(k.signature["state_indices"] == k.signature["cu_seqlens"] for k in kernels
               if not k.constexprs["USE_POOL"])
    assert {k.constexprs["V"] for k in kernels} == {64, 128}


def test_aot_list_is_part_of_both_backends():
    from gdn_dispatch.backends import gluon_sm90, gluon_sm100

    for module, cap in ((gluon_sm90, SM90), (gluon_sm100, SM100)):
        fused = [k for k in module.kernels_for_aot(cap) if k.kernel == "state_output_fwd"]
        assert len(fused) == len(so.state_output_kernels_for_aot(cap, module.BACKEND))


# ---------------------------------------------------------------------------------------
# The host wrapper without a GPU


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_state_output_fwd_binds_every_kernel_argument(monkeypatch, layout):
    recorder = LaunchRecorder(so._state_output_fwd_kernel)
    monkeypatch.setattr(so, "_state_output_fwd_kernel", recorder)
    launched = recorder.launched
    p = _problem(lengths=[1, 63, 130, 0], layout=layout, l2=True)
    launch = so.plan_state_output(p, SM90)
    w = torch.empty(p.B, p.T, p.HV, p.K, dtype=p.dtype)
    u = torch.empty(p.B, p.T, p.HV, p.V, dtype=p.dtype)
    rnorm = torch.empty(p.B * p.T, p.H, 2)
    o, final = so.state_output_fwd(p.q, p.k, w, u, torch.empty(p.B, p.T, p.HV), p.chunks, launch, scale=p.scale,
                                   initial_state=p.initial_state, output_final_state=True, rnorm=rnorm)
    assert set(launched) - {"grid", "num_warps", "maxnreg"} == set(recorder.arg_names)
    assert launched["rnorm"] is rnorm
    assert launched["grid"] == launch.grid and launched["num_warps"] == launch.num_warps
    assert launched["maxnreg"] == launch.maxnreg
    assert launched["STATE_VK"] == (layout == "vk") and launched["V"] == p.V and launched["USE_L2NORM"]
    assert launched["scale"] == p.scale and launched["o_ptr"] is o
    assert o.shape == (p.B, p.T, p.HV, p.V) and o.dtype == p.dtype
    assert final.shape == p.state_shape and final.dtype == torch.float32


def test_state_output_fwd_takes_or_forms_the_qk_norms(monkeypatch):
    monkeypatch.setattr(so, "_state_output_fwd_kernel", LaunchRecorder(so._state_output_fwd_kernel))
    p = _problem(lengths=[1, 63, 130, 0], l2=True)
    launch = so.plan_state_output(p, SM90)
    w = torch.empty(p.B, p.T, p.HV, p.K, dtype=p.dtype)
    u = torch.empty(p.B, p.T, p.HV, p.V, dtype=p.dtype)
    g_cum = torch.empty(p.B, p.T, p.HV)

    def call(**kw):
        return so.state_output_fwd(p.q, p.k, w, u, g_cum, p.chunks, launch, scale=p.scale, **kw)

    for bad in (torch.empty(p.B * p.T, p.H, 2, dtype=torch.float16), torch.empty(p.B * p.T, p.H + 1, 2),
                torch.empty(p.B * p.T, 2, p.H).transpose(1, 2)):
        with pytest.raises(ValueError, match="rnorm: expected contiguous float32"):
            call(rnorm=bad)
    formed = []
    monkeypatch.setattr(so, "qk_rnorm_fwd", lambda q, k, plan: formed.append(plan) or torch.empty(p.B * p.T, p.H, 2))
    call()
    assert [plan.scalars["rows"] for plan in formed] == [p.B * p.T * p.H]


@pytest.mark.parametrize("h0", [True, False])
def test_without_chunks_the_final_state_is_the_initial_one(h0):
    p = _problem(lengths=[0, 0], layout="vk", h0=h0)
    launch = so.plan_state_output(p, SM90)
    empty = torch.empty(1, 0, p.HV, p.K, dtype=p.dtype)
    o, final = so.state_output_fwd(p.q, p.k, empty, empty, torch.empty(1, 0, p.HV), p.chunks, launch,
                                   scale=p.scale, initial_state=p.initial_state, output_final_state=True)
    assert o.shape == (1, 0, p.HV, p.V)
    torch.testing.assert_close(final, p.initial_state if h0 else torch.zeros(p.state_shape))


# ---------------------------------------------------------------------------------------
# On a GPU of the two engines


def _gluon_capability():
    if not torch.cuda.is_available():
        return None
    cap = torch.cuda.get_device_capability()
    return cap if cap[0] in (9, 10) else None


CAPABILITY = _gluon_capability()
#: Relative RMS error against the float32 reference (16-bit inputs).
TOL = {"reference": 5e-3}

GPU_CASES = [
    # (shape, H, HV, K, V, BV, layout, h0, l2, dtype)
    pytest.param(dict(lengths=[1, 63, 64, 65, 130, 0]), 2, 4, 128, 128, 64, "kv", True, False, torch.bfloat16,
                 id="varlen-H2-HV4-K128-V128-BV64-kv-h0-bf16"),
    pytest.param(dict(lengths=[1, 63, 64, 65, 130, 0]), 2, 4, 128, 128, 64, "vk", False, True, torch.float16,
                 id="varlen-H2-HV4-K128-V128-BV64-vk-l2-fp16"),
    pytest.param(dict(lengths=[1, 63, 64, 65, 130, 0]), 2, 4, 128, 128, 32, "vk", True, True, torch.bfloat16,
                 id="varlen-H2-HV4-K128-V128-BV32-vk-h0-l2-bf16"),
    pytest.param(dict(lengths=[31, 511, 501]), 1, 4, 64, 128, 64, "kv", False, True, torch.float16,
                 id="varlen-31-511-501-H1-HV4-K64-V128-BV64-kv-l2-fp16"),
    pytest.param(dict(lengths=[31, 511, 501]), 1, 4, 64, 64, 32, "vk", True, False, torch.bfloat16,
                 id="varlen-31-511-501-H1-HV4-K64-V64-BV32-vk-h0-bf16"),
    pytest.param(dict(batch=(2, 256)), 4, 4, 128, 64, None, "kv", True, True, torch.bfloat16,
                 id="B2-T256-H4-HV4-K128-V64-kv-h0-l2-bf16"),
    pytest.param(dict(batch=(3, 100)), 2, 4, 64, 128, 64, "vk", False, False, torch.float16,
                 id="B3-T100-H2-HV4-K64-V128-BV64-vk-fp16"),
    pytest.param(dict(batch=(1, 1000)), 2, 8, 128, 128, None, "kv", True, True, torch.bfloat16,
                 id="B1-T1000-H2-HV8-K128-V128-kv-h0-l2-bf16"),
]


def _check_fused(shape, H, HV, K, V, layout, h0, l2, dtype, **plan_options):
    """Run the fused kernel with ``plan_options`` (w, u and the gate cumsum from wy) on
    NaN-poisoned memory; compare it with the float32 reference."""
    from gdn_dispatch.backends.gluon_common.wy import plan_wy, wy_fwd
    from gdn_dispatch import reference

    p = _problem(**shape, H=H, HV=HV, K=K, V=V, layout=layout, h0=h0, ht=True, l2=l2, dtype=dtype,
                 device="cuda", seed=7)
    props = torch.cuda.get_device_properties(p.device)
    info = DeviceInfo(kind="cuda", index=p.device.index or 0, name=props.name, capability=CAPABILITY,
                      sm_count=props.multi_processor_count)
    w, u, g_cum = wy_fwd(p.k, p.v, p.g, p.beta, p.chunks, plan_wy(p, info))

    poison_cuda_allocator()
    launch = so.plan_state_output(p, info, **plan_options)
    o, final = so.state_output_fwd(p.q, p.k, w, u, g_cum, p.chunks, launch, scale=p.scale,
                                   initial_state=p.initial_state, output_final_state=True)
    torch.cuda.synchronize()
    o_ref, final_ref = reference.forward(p)

    assert rel_rms_error(o, o_ref) <= TOL["reference"], launch.notes
    assert rel_rms_error(final, final_ref) <= TOL["reference"], launch.notes


@pytest.mark.gpu
@pytest.mark.skipif(CAPABILITY is None, reason="needs a CUDA GPU of compute capability 9.0 or 10.x (Gluon engines)")
@pytest.mark.parametrize("shape, H, HV, K, V, BV, layout, h0, l2, dtype", GPU_CASES)
def test_fused_matches_reference(shape, H, HV, K, V, BV, layout, h0, l2, dtype):
    _check_fused(shape, H, HV, K, V, layout, h0, l2, dtype, block_v=BV)


@pytest.mark.gpu
@pytest.mark.skipif(CAPABILITY is None or CAPABILITY[0] != 9, reason="needs an sm_90 GPU (wgmma)")
@pytest.mark.parametrize("shape, H, HV, BV, layout, h0, l2, dtype", [
    pytest.param(dict(lengths=[1, 63, 64, 65, 130, 0, 700]), 2, 4, 32, "kv", True, False, torch.bfloat16,
                 id="varlen-H2-HV4-BV32-kv-h0-bf16"),
    pytest.param(dict(lengths=[1, 63, 64, 65, 130, 0, 700]), 2, 4, 64, "vk", True, True, torch.float16,
                 id="varlen-H2-HV4-BV64-vk-h0-l2-fp16"),
    pytest.param(dict(lengths=[0, 2000, 129]), 1, 2, 32, "vk", False, True, torch.bfloat16,
                 id="varlen-0-2000-129-H1-HV2-BV32-vk-l2-bf16"),
    pytest.param(dict(batch=(2, 1000)), 2, 8, 64, "kv", True, False, torch.bfloat16, id="B2-T1000-H2-HV8-BV64-kv-h0"),
])
def test_warp_specialized_walk_matches_reference(shape, H, HV, BV, layout, h0, l2, dtype):
    """The walk warp-specialized (the chain in one warpgroup, the output in another, the
    ring refilled by the output partition): tails, empty and one-token sequences, a long
    sequence (ring and h / v_new slots wrapping many times), grouped heads, both layouts."""
    _check_fused(shape, H, HV, 128, 128, layout, h0, l2, dtype, block_v=BV, ws=True)


#: Every launch configuration of the fused kernel: (BV, warps, o stored a chunk late, the
#: walk warp-specialized).
VARIANTS = [(32, 4, False, False), (32, 4, True, False), (32, 8, True, False), (64, 4, False, False),
            (64, 8, True, False), (128, 8, False, False), (32, 4, False, True), (64, 4, False, True)]


@pytest.mark.gpu
@pytest.mark.skipif(CAPABILITY is None, reason="needs a CUDA GPU of compute capability 9.0 or 10.x (Gluon engines)")
@pytest.mark.parametrize("BV, warps, defer, ws", VARIANTS,
                         ids=[f"BV{b}-w{w}{'-defer' if d else ''}{'-ws' if ws else ''}" for b, w, d, ws in VARIANTS])
@pytest.mark.parametrize("l2, layout, dtype", [(True, "vk", torch.bfloat16), (False, "kv", torch.float16)],
                         ids=["l2-vk-bf16", "kv-fp16"])
def test_fused_launch_variants(BV, warps, defer, ws, l2, layout, dtype):
    if (defer or ws) and CAPABILITY[0] != 9:
        pytest.skip("o stored a chunk late, the warp-specialized walk: sm_90a only")
    _check_fused(dict(lengths=[1, 63, 64, 65, 130, 0, 700]), 2, 4, 128, 128, layout, True, l2, dtype,
                 block_v=BV, num_warps=warps, defer_out=defer, ws=ws and CAPABILITY[0] == 9)


@pytest.mark.gpu
@pytest.mark.skipif(CAPABILITY is None, reason="needs a CUDA GPU of compute capability 9.0 or 10.x (Gluon engines)")
@pytest.mark.parametrize("lengths", [[1, 63, 64, 65, 130, 0], [1000, 37, 0, 513]], ids=["1-63-64-65-130-0", "1000-37-0-513"])
@pytest.mark.parametrize("layout, l2, dtype", [("kv", False, torch.bfloat16), ("vk", True, torch.float16)],
                         ids=["kv-bf16", "vk-l2-fp16"])
def test_gluon_forward_matches_reference(lengths, layout, l2, dtype):
    """The whole Gluon pipeline (wy, then the fused kernel) through the public call, with
    grouped value heads, against the float32 reference, on NaN-poisoned memory."""
    from gdn_dispatch import chunk_gated_delta_rule, reference

    backend = "gluon_sm90" if CAPABILITY[0] == 9 else "gluon_sm100"
    p = _problem(lengths=lengths, H=2, HV=4, layout=layout, l2=l2, dtype=dtype, device="cuda", seed=5)
    poison_cuda_allocator()
    o, final = chunk_gated_delta_rule(p.q, p.k, p.v, p.g, p.beta, scale=p.scale, initial_state=p.initial_state,
                                      output_final_state=True, cu_seqlens=p.cu_seqlens,
                                      cu_seqlens_cpu=p.chunks.cu_seqlens_host, use_qk_l2norm_in_kernel=l2,
                                      state_layout=layout, backend=backend)
    o_ref, final_ref = reference.forward(p)
    assert rel_rms_error(o, o_ref) <= TOL["reference"]
    assert rel_rms_error(final, final_ref) <= TOL["reference"]


# ---------------------------------------------------------------------------------------
# State pools (host side)


def _pool_problem(inplace=True, layout="vk", lengths=(1, 63, 0, 130), idx_dtype=torch.int64,
                  pool_dtype=torch.bfloat16):
    from gdn_dispatch.contract import make_problem
    from gdn_dispatch.testing import random_call

    call = random_call(lengths=list(lengths), H=2, HV=4, K=128, V=64, seed=5, state_layout=layout,
                       initial_state=False)
    gen = torch.Generator().manual_seed(1)
    dims = (64, 128) if layout == "vk" else (128, 64)
    pool = torch.randn(6, 4, *dims, generator=gen).to(pool_dtype)
    idx = torch.tensor([5, -1, 0, 2, 4, 1][:len(lengths)], dtype=idx_dtype)
    return make_problem(**{**call, "initial_state": pool}, state_indices=idx, inplace_final_state=inplace,
                        output_final_state=True)


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "read-only"])
def test_pool_plan_flags_and_key(inplace):
    from gdn_dispatch.backends.gluon_common.plan import plan

    p = _pool_problem(inplace=inplace)
    launch = so.plan_state_output(p, SM90)
    assert (launch.constexprs["USE_POOL"], launch.constexprs["INPLACE"], launch.constexprs["USE_H0"]) == \
        (True, inplace, True)
    other = _pool_problem(inplace=not inplace)
    assert plan(p, SM90) is not plan(other, SM90)
    assert plan(p, SM90) is plan(_pool_problem(inplace=inplace), SM90)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_state_output_fwd_reads_the_pool_in_place(monkeypatch, idx_dtype):
    recorder = LaunchRecorder(so._state_output_fwd_kernel)
    monkeypatch.setattr(so, "_state_output_fwd_kernel", recorder)
    p = _pool_problem(idx_dtype=idx_dtype)
    launch = so.plan_state_output(p, SM90)
    w = torch.empty(p.B, p.T, p.HV, p.K, dtype=p.dtype)
    u = torch.empty(p.B, p.T, p.HV, p.V, dtype=p.dtype)
    so.state_output_fwd(p.q, p.k, w, u, torch.empty(p.B, p.T, p.HV), p.chunks, launch, scale=p.scale,
                        initial_state=p.initial_state, output_final_state=True, state_indices=p.state_indices)
    launched = recorder.launched
    assert launched["h0"] is p.initial_state  # the pool itself: bf16, never copied
    assert launched["state_indices"] is p.state_indices and launched["pool_size"] == 6
    assert launched["USE_POOL"] and launched["INPLACE"]
    signature, _, _ = so.state_output_signature(launch, p.dtype, torch.bfloat16, idx_dtype)
    assert signature["h0"] == "*bf16" and signature["state_indices"] == ("*i32" if idx_dtype == torch.int32 else "*i64")
    with pytest.raises(ValueError, match="USE_POOL plan needs initial_state"):
        so.state_output_fwd(p.q, p.k, w, u, torch.empty(p.B, p.T, p.HV), p.chunks, launch, scale=p.scale,
                            initial_state=p.initial_state, output_final_state=True)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_pool_without_tokens_returns_the_named_rows(layout, pool_dtype):
    p = _pool_problem(lengths=(0, 0, 0, 0), layout=layout, pool_dtype=pool_dtype)
    launch = so.plan_state_output(p, SM90)
    pool = p.initial_state
    before = pool.clone()
    w, u = torch.empty(1, 0, p.HV, p.K, dtype=p.dtype), torch.empty(1, 0, p.HV, p.V, dtype=p.dtype)
    o, final = so.state_output_fwd(p.q, p.k, w, u, torch.empty(1, 0, p.HV), p.chunks, launch,
                                   scale=p.scale, initial_state=pool, output_final_state=True,
                                   state_indices=p.state_indices)
    expected = torch.zeros(p.state_shape)
    for n, i in enumerate(p.state_indices.tolist()):
        if i >= 0:
            expected[n] = pool[i].float()
    assert torch.equal(final, expected) and torch.equal(pool, before)


def test_pool_rows_zero_every_index_outside_the_pool():
    pool = torch.randn(3, 2, 4, 4)
    rows = so.pool_rows(pool, torch.tensor([2, -1, 3, 0, -7], dtype=torch.int32))
    assert torch.equal(rows[0], pool[2]) and torch.equal(rows[3], pool[0])
    assert not rows[[1, 2, 4]].any()


@pytest.mark.gpu
@pytest.mark.skipif(CAPABILITY is None, reason="needs a CUDA GPU of compute capability 9.0 or 10.x (Gluon engines)")
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=["cu32", "cu64"])
@pytest.mark.parametrize("lengths", [[0, 1, 63, 64, 65, 127, 128, 129, 0, 700, 2, 64, 31, 511, 501, 3],
                                     [64, 128, 0, 192]], ids=["ragged-16", "whole-chunks"])
def test_chunk_slots_from_a_device_cu_seqlens_alone(lengths, cu_dtype):
    """The w/u kernel maps chunk slots to chunks by bisection over a device cu_seqlens: with
    no host copy there is no sync (sync debug mode "error"), and every row of o and every
    final state matches the reference on NaN-poisoned memory (idle slots write nothing,
    every chunk is written once)."""
    from gdn_dispatch import chunk_gated_delta_rule, reference

    backend = "gluon_sm90" if CAPABILITY[0] == 9 else "gluon_sm100"
    p = _problem(lengths=lengths, H=2, HV=4, layout="vk", l2=True, device="cuda", seed=13)
    cu = p.cu_seqlens.to(cu_dtype)
    kwargs = dict(scale=p.scale, initial_state=p.initial_state, output_final_state=True, cu_seqlens=cu,
                  use_qk_l2norm_in_kernel=True, state_layout="vk", backend=backend)
    chunk_gated_delta_rule(p.q, p.k, p.v, p.g, p.beta, **kwargs)  # compile outside the sync check
    poison_cuda_allocator()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        o, final = chunk_gated_delta_rule(p.q, p.k, p.v, p.g, p.beta, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    o_ref, final_ref = reference.forward(p)
    assert rel_rms_error(o, o_ref) <= TOL["reference"]
    assert rel_rms_error(final, final_ref) <= TOL["reference"]
