"""gluon_sm90's one-kernel build with its state as two one-warpgroup partitions
(``fused.STATE_HALVES``, off as shipped): its plan (fast), its sm_90a compile (slow tier:
every wgmma pipelined, the spills and shared memory of the shipped build or less, the named
barriers clear of Triton's own), and on an sm_90 GPU its outputs against the float32
reference and against the shipped build, with the outputs poisoned first, over ragged
calls, both state layouts, a pool written in place and the qk l2 norm on chip."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from triton.experimental.gluon import language as gl  # noqa: E402

from gdn_dispatch import chunk_gated_delta_rule  # noqa: E402
from gdn_dispatch.contract import make_problem  # noqa: E402
from gdn_dispatch.device import DeviceInfo, SMEM_OPTIN, assumed_device  # noqa: E402
from gdn_dispatch.testing import poison_cuda_allocator, pooled_call, random_call, rel_rms_error  # noqa: E402

from gdn_dispatch.backends.gluon_common.named_barriers import FIRST_ID  # noqa: E402
from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache  # noqa: E402
from gdn_dispatch.backends.gluon_sm90 import fused  # noqa: E402

SM90 = (9, 0)


def _engine():
    from gdn_dispatch.backends import gluon_sm90

    return gluon_sm90.ENGINE


def _device():
    info = assumed_device("sm_90")
    return DeviceInfo(kind="cuda", index=0, name=info.name, capability=SM90, sm_count=132,
                      smem_optin=info.smem_optin)


@pytest.fixture
def halves(monkeypatch):
    """``fused.STATE_HALVES`` on (and ``HALVES_IN_TURN`` as asked), plans computed afresh."""
    def apply(in_turn: bool = True):
        monkeypatch.setattr(fused, "STATE_HALVES", gl.constexpr(True))
        monkeypatch.setattr(fused, "HALVES_IN_TURN", gl.constexpr(in_turn))
        clear_plan_cache()
    yield apply
    clear_plan_cache()


# --- the plan ----------------------------------------------------------------------------------

def test_the_halves_plan_one_warpgroup_each_and_half_wide_o_boxes(halves):
    call = random_call(lengths=[300, 0, 700], H=2, HV=4, K=128, V=128, seed=1)
    problem = make_problem(**call, output_final_state=True)
    shipped = fused.plan_fused(problem, _device(), engine=_engine())
    halves()
    split = fused.plan_fused(problem, _device(), engine=_engine())
    assert shipped.constexprs["HALVES"] is False and split.constexprs["HALVES"] is True
    assert shipped.constexprs["IN_TURN"] is False and split.constexprs["IN_TURN"] is True
    assert shipped.num_warps == 8 and split.num_warps == 4
    o_box = {d.arg: d.block_shape for d in split.descriptors}["o_desc"]
    assert o_box == (64, 64) and {d.arg: d.block_shape for d in shipped.descriptors}["o_desc"] == (64, 128)
    assert "2 halves" in split.notes
    # Everything else as shipped: the same rings, the same constexprs but those two.
    assert {k: v for k, v in split.constexprs.items() if k not in ("HALVES", "IN_TURN")} == \
        {k: v for k, v in shipped.constexprs.items() if k not in ("HALVES", "IN_TURN")}
    assert split.blocks["smem_bytes"] == shipped.blocks["smem_bytes"] + 8 * 2  # the halves_done barriers


@pytest.mark.parametrize("K, V, chain", [(128, 64, False), (64, 64, False), (128, 128, True)],
                         ids=["V64", "K64-V64", "chained"])
def test_the_halves_leave_other_builds_alone(K, V, chain, halves):
    """One state warpgroup already at V = 64; chained segments keep the shipped state."""
    halves()
    call = random_call(lengths=[300, 700], H=2, HV=4, K=K, V=V, seed=2)
    launch = fused.plan_fused(make_problem(**call, output_final_state=True), _device(), engine=_engine(), chain=chain)
    assert launch.constexprs["HALVES"] is False


# --- sm_90a ------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("in_turn", [True, False], ids=["in-turn", "free"])
def test_the_halves_build_compiles_for_sm90a(in_turn, halves):
    """Four specializations of the halves build: no wgmma serialized (a wait on an mbarrier
    with an update in flight made ptxas serialize them all; the halves' joins are named
    barriers), within the shipped build's spill allowance and the 227 KB of shared memory the
    plan says (within 1 KB), the budgets 192 / 192 / 120, five products a half and one for
    the aux (64 wgmma instructions), and the named barriers at ids Triton's own stay below."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_gluon_aot import compile_kernel

    halves(in_turn)
    kernels = {k.specialization: k for k in fused.fused_kernels_for_aot(SM90, "gluon_sm90", engine=_engine())}
    assert kernels["K64-V64-bf16-varlen-kv-h0-ht"].constexprs["HALVES"] is False
    for name in ("bf16-varlen-kv-h0-ht", "fp16-dense-vk-h0-ht", "bf16-varlen-kv-h0-ht-pool-fp32-i32-inplace",
                 "bf16-varlen-kv-h0-ht-l2"):
        kernel = kernels[name]
        assert kernel.constexprs["HALVES"] is True and kernel.num_warps == 4, name
        assert kernel.constexprs["IN_TURN"] is in_turn, name
        report = compile_kernel(kernel, SM90)
        assert not report.wgmma_serialized, name
        assert report.spill_bytes <= kernel.spill_bytes_allowed, (name, report.spill_bytes)
        planned = fused.fused_smem_bytes(128, 128, 2, v_slots=fused.V_SLOTS, single_t=True,
                                         qk_norm=kernel.constexprs["QK_NORM"], aux_t=True, state_scores=True,
                                         halves=True)
        assert planned <= report.shared_bytes <= planned + 1024, (name, planned, report.shared_bytes)
        assert report.shared_bytes <= SMEM_OPTIN[SM90]
        ptx = report.ptx
        budgets = {int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}
        assert {120, 192} <= budgets, (name, budgets)
        assert len(re.findall(r"wgmma\.mma_async", ptx)) == 64, name
        ids = {int(i) for i in re.findall(r"\bbar(?:rier)?\.(?:sync|arrive)(?:\.\w+)*\s+(\d+)", ptx)}
        ours = {FIRST_ID.value + 2} | ({FIRST_ID.value, FIRST_ID.value + 1} if in_turn else set())
        assert ours <= ids and all(i < FIRST_ID.value for i in ids - ours), (name, ids)


# --- on the GPU --------------------------------------------------------------------------------

needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != SM90,
                                reason="needs an sm_90 GPU")


def _run(problem):
    from gdn_dispatch.device import default_probe

    launch = fused.plan_fused(problem, default_probe().for_torch_device(problem.device), engine=_engine())
    stand_in = torch.empty(1, device=problem.device)
    poison_cuda_allocator()
    return launch, fused.fused_fwd(problem, stand_in, stand_in, launch)


CASES = [
    # (lengths, dtype, layout, initial state, l2, pool)
    pytest.param([3000, 0, 1, 64, 700, 4097], torch.bfloat16, "kv", True, False, None, id="ragged-bf16-kv"),
    pytest.param([2048, 2048], torch.float16, "vk", True, False, None, id="uniform-fp16-vk"),
    pytest.param([1000, 63, 2500], torch.bfloat16, "kv", False, False, None, id="ragged-bf16-no-h0"),
    pytest.param([1500, 0, 4096], torch.bfloat16, "kv", True, True, None, id="ragged-bf16-l2"),
    pytest.param([5000, 0, 333], torch.bfloat16, "vk", True, False, torch.bfloat16, id="pool-bf16-vk"),
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("in_turn", [True, False], ids=["in-turn", "free"])
@pytest.mark.parametrize("lengths, dtype, layout, h0, l2, pool", CASES)
def test_the_halves_match_the_reference_and_the_shipped_build(lengths, dtype, layout, h0, l2, pool, in_turn,
                                                              halves):
    call = random_call(lengths=lengths, H=2, HV=4, K=128, V=128, dtype=dtype, device="cuda", seed=5,
                       initial_state=h0, state_layout=layout, normalize_qk=not l2)
    flags = dict(use_qk_l2norm_in_kernel=l2, output_final_state=True)
    extra, ref_call = {}, dict(call)
    if pool is not None:
        call, extra, ref_call = pooled_call(call, pool)
    cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in ref_call.items()}
    o_ref, ht_ref = chunk_gated_delta_rule(**cpu, **flags, backend="reference")
    shipped_call = {**call, "initial_state": call["initial_state"].clone()} if pool is not None else call
    plan_a, (o_a, ht_a) = _run(make_problem(**shipped_call, **flags, **extra, backend="gluon_sm90"))
    halves(in_turn)
    problem = make_problem(**call, **flags, **extra, backend="gluon_sm90")
    plan_b, (o, ht) = _run(problem)
    torch.cuda.synchronize()
    assert plan_a.constexprs["HALVES"] is False and plan_b.constexprs["HALVES"] is True
    assert torch.isfinite(o).all() and torch.isfinite(ht).all(), "an output element left unwritten"
    assert rel_rms_error(o.float().cpu(), o_ref.float()) < 5e-3
    assert rel_rms_error(ht.float().cpu(), ht_ref.float()) < 5e-3
    # Per row of S^T the same products as the shipped build; the scores go through k q^T.
    assert rel_rms_error(o.float(), o_a.float()) < 1e-3
    assert rel_rms_error(ht.float(), ht_a.float()) < 1e-3
    if pool is not None:
        live = extra["state_indices"] >= 0
        rows = extra["state_indices"][live].long()
        assert rel_rms_error(call["initial_state"][rows].float().cpu(), ht_ref[live.cpu()].float()) < 5e-3
