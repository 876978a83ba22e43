"""The profiling phases of the warp-specialized kernels (backends/gluon_common/scopes.py) and
benchmarks/partition_profile.py's reading of a profile.

CPU: outside an instrumented compile the scopes emit nothing (no clock reads in the
kernels); with Proton's instrumentation passes (registered as a Proton session registers
them, on the Triton release they were verified on) the fused kernel and the warp-specialized
walk compile with a clock read at every phase boundary; the script's tree walk finds the
``partition.phase`` nodes of a hatchet tree.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from gdn_dispatch.device import assumed_device  # noqa: E402
from gdn_dispatch.testing import script_module  # noqa: E402

from gdn_dispatch.backends.gluon_common import state_output as so  # noqa: E402
from gdn_dispatch.backends.gluon_common import state_output_ws  # noqa: E402

SM90 = (9, 0)
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "partition_profile.py"
#: The scopes of each kernel, as its sources open them (``aux.walk``, ``aux.inverse``, the
#: phases within it, the last six in ``wy.py``'s chunk inverse, and ``state.scores``: the
#: fused kernel built with ``fused.AUX_T`` only, the last with its ``STATE_SCORES``; both
#: shipped).
AUX_T_PHASES = {"aux.walk", "aux.inverse", "aux.store_t", "aux.cumsum", "aux.kk", "aux.a", "aux.save_a",
                "aux.blocks", "aux.check", "state.scores"}
FUSED_PHASES = {"state.walk", "state.operand", "state.issue", "state.decay", "state.wait_tiles", "state.wait_aux",
                "state.v_new", "state.update_output", "state.release", "state.refill", "state.store",
                "aux.wait_tiles", "aux.wait_state", "aux.scores"} | AUX_T_PHASES
WALK_PHASES = {"chain.walk", "chain.wait_output", "chain.h_store", "chain.wait_tiles", "chain.p", "chain.update",
               "chain.release", "output.walk", "output.wait_tiles", "output.wait_chain", "output.products",
               "output.release", "output.refill", "output.store"}


def _script():
    return script_module(SCRIPT, "partition_profile_under_test")


def _kernels():
    """The fused kernel (bf16, varlen, initial + final state) and the warp-specialized walk
    (BV = 32, the same flags) as AOT kernels for sm_90a."""
    from gdn_dispatch.backends import gluon_sm90
    from gdn_dispatch.backends.gluon_sm90.fused import fused_kernels_for_aot

    fused = fused_kernels_for_aot(SM90, "gluon_sm90", engine=gluon_sm90.ENGINE)[0]
    flags = dict(dtype=torch.bfloat16, tails=True, vk=False, h0=True, ht=True, l2=False, pool=False, inplace=False,
                 state_dtype=torch.float32, index_dtype=torch.int32, cu_dtype=torch.int32)
    launch = so.plan_state_output(so._aot_problem(128, 128, **flags), assumed_device("sm_90"), block_v=32, ws=True)
    return fused, so.state_output_aot_kernel("gluon_sm90", launch, torch.bfloat16, "ws-32")


def test_the_script_reads_the_phases_of_a_hatchet_tree():
    tree = [{"frame": {"name": "ROOT"}, "metrics": {"cycles": 10}, "children": [
        {"frame": {"name": "_fused_fwd_kernel"}, "metrics": {"cycles": 9}, "children": [
            {"frame": {"name": "state.p"}, "metrics": {"cycles": 4.0, "normalized_cycles": 2.0, "note": "x"}},
            {"frame": {"name": "aux.scores"}, "metrics": {"cycles": 5}, "children": []}]}]},
        {"device": "meta"}]
    assert _script().phases(tree) == [("aux.scores", {"cycles": 5}),
                                      ("state.p", {"cycles": 4.0, "normalized_cycles": 2.0})]


@pytest.mark.slow
def test_scopes_emit_nothing_outside_an_instrumented_compile():
    from gdn_dispatch.aot import compile_kernel

    for kernel in _kernels():
        assert "%clock" not in compile_kernel(kernel, SM90).ptx, kernel.kernel


@contextlib.contextmanager
def _instrumented():
    """Proton's compile-time instrumentation (cycle records into a global buffer), registered
    as its session registers it, without a GPU."""
    from triton import knobs
    from triton._C.libtriton import passes, proton
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.profiler import mode
    from triton.profiler.flags import flags
    from triton.profiler.hooks.instrumentation import Instrumentation

    from gdn_dispatch.device import SMEM_OPTIN

    m = mode.Default(buffer_type="global")

    def to_llvmir(pm):
        proton.add_convert_proton_to_protongpu(pm, m.metric_type, m.sampling_strategy, m.sampling_options,
                                               m.granularity, m.buffer_strategy, m.buffer_type, m.buffer_size,
                                               SMEM_OPTIN[SM90], 1, 128, True)
        passes.common.add_cse(pm)
        proton.add_allocate_proton_shared_memory(pm)

    def to_llvm(pm):
        proton.add_allocate_proton_global_scratch_buffer(pm)
        proton.add_convert_proton_nvidia_gpu_to_llvm(pm)

    kept = (flags.instrumentation_on, CUDABackend.instrumentation, knobs.compilation.instrumentation_mode)
    flags.instrumentation_on = True
    CUDABackend.instrumentation = Instrumentation({"ttgpuir_to_llvmir": to_llvmir, "llvmir_to_llvm": to_llvm})
    knobs.compilation.instrumentation_mode = str(m)
    try:
        yield str(m)
    finally:
        flags.instrumentation_on, CUDABackend.instrumentation, knobs.compilation.instrumentation_mode = kept


@pytest.mark.slow
def test_instrumented_kernels_record_every_phase(monkeypatch):
    """Under the instrumentation passes each kernel compiles with two clock reads per scope
    (64-bit clocks: a low and a high half each) and a profile buffer; the scopes its source
    opens are the phases the script reports (the fused kernel's ``aux.inverse`` and
    ``state.scores`` as shipped; its two-launch build, ``fused.AUX_T`` off, compiled third,
    without them)."""
    import triton

    from gdn_dispatch.backends import gluon_sm90
    from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache
    from gdn_dispatch.backends.gluon_sm90 import fused

    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"Proton's compile hooks are verified on triton 3.6 (this is {triton.__version__})")
    from gdn_dispatch.aot import _gpu_target
    from gdn_dispatch.backends.gluon_common.compat import gluon_ast_source

    shipped = _kernels()
    monkeypatch.setattr(fused, "AUX_T", False)
    clear_plan_cache()
    t_kernel = fused.fused_kernels_for_aot(SM90, "gluon_sm90", engine=gluon_sm90.ENGINE)[0]
    clear_plan_cache()
    assert shipped[0].constexprs["AUX_T"] and shipped[0].constexprs["STATE_SCORES"]
    assert not t_kernel.constexprs["AUX_T"] and not t_kernel.constexprs["STATE_SCORES"]
    builds = zip((*shipped, t_kernel), (FUSED_PHASES, WALK_PHASES, FUSED_PHASES - AUX_T_PHASES),
                 (("backends/gluon_sm90/fused.py", "backends/gluon_common/wy.py"),
                  ("backends/gluon_common/state_output_ws.py",),
                  ("backends/gluon_sm90/fused.py", "backends/gluon_common/wy.py")))
    for kernel, names, sources in builds:
        opened = {name for source in sources for name in
                  re.findall(r'enter\("([a-z_]+\.[a-z_]+)"\)', (SCRIPT.parents[1] / source).read_text())}
        source = sources[0]
        assert names <= opened and opened - names <= AUX_T_PHASES, source
        with _instrumented() as mode_str:
            compiled = triton.compile(gluon_ast_source(kernel.fn, kernel.signature, kernel.constexprs, kernel.attrs),
                                      target=_gpu_target(SM90),
                                      options={"num_warps": kernel.num_warps, "instrumentation_mode": mode_str})
        ptx = compiled.asm["ptx"]
        assert compiled.metadata.profile_scratch_size > 0, kernel.kernel
        # Every enter and leave reads the clock (both halves) in every partition that runs
        # it (the walk's output phases in each output partition); the kernel reads none itself.
        parts = state_output_ws.output_partitions(32, False)  # the walk's build here: BV = 32, no norm
        copies = {name: parts if name.startswith("output.") else 1 for name in names}
        assert len(re.findall(r"%clock\b", ptx)) == 2 * sum(copies.values()), kernel.kernel


def test_the_script_counts_each_partitions_loop_per_warp_and_chunk_step():
    """Cycles per warp of the phase's own partition and per chunk step; a partition's loop
    is its walk (recorded once around it) beside the sum of the phases within it, or else
    the sum of its top-level phases, those nested in another left out."""
    script = _script()
    tree = [{"frame": {"name": "_fused_fwd_kernel"}, "metrics": {}, "children": [
        {"frame": {"name": "state.walk"}, "metrics": {"cycles": 1200.0}, "children": [
            {"frame": {"name": "state.v_new"}, "metrics": {"cycles": 800.0}},
            {"frame": {"name": "state.store"}, "metrics": {"cycles": 160.0}}]},
        {"frame": {"name": "aux.inverse"}, "metrics": {"cycles": 600.0}, "children": [
            {"frame": {"name": "aux.blocks"}, "metrics": {"cycles": 360.0}}]},
        {"frame": {"name": "aux.scores"}, "metrics": {"cycles": 40.0}}]}]
    warps, steps = {"state": 8, "aux": 4}, 10
    found = script.phases(tree)
    assert [name for name, _ in script.phases(tree, depth=0)] == ["aux.inverse", "aux.scores", "state.walk"]
    assert [name for name, _ in script.phases(tree, depth=1)] == ["aux.blocks", "state.store", "state.v_new"]
    assert script.per_warp_and_step(found, warps, steps) == {"aux.blocks": 9.0, "aux.inverse": 15.0,
                                                             "aux.scores": 1.0, "state.store": 2.0,
                                                             "state.v_new": 10.0, "state.walk": 15.0}
    assert script.partition_loops(tree, warps, steps) == {"state": (15.0, 12.0), "aux": (16.0, 16.0)}
    with pytest.raises(ValueError, match="chain"):
        script.per_warp_and_step([("chain.p", {"cycles": 1})], warps, steps)


def test_the_script_sizes_the_record_buffer_for_every_event_of_the_walk():
    """Proton splits a program's buffer evenly between its warps (a power of two each) and keeps
    8 bytes an event:
    the aux partition's enter and leave of its eleven phases a chunk (22 events) fit, for
    the fused shape's 128 chunks and the walk's 512."""
    script = _script()
    for chunks in (128, 512):
        share = script.buffer_bytes(chunks, 12) // 12
        assert share & (share - 1) == 0 and script.buffer_bytes(chunks, 12) == 12 * share
        assert share // script.EVENT_BYTES >= 22 * chunks
    assert script.chunk_steps("H16-HV32-4x8192") == 4 * 128 * 32
    assert script.chunk_steps("H16-HV32-1x32768") == 512 * 32 * 4
    assert script.chunk_steps("H2-HV4-1x32768") == 512 * 4 * 2
    assert script.partition_warps(False, 128) == {"state": 8, "aux": 4}
    assert script.partition_warps(True, 32) == {"chain": 4, "output": 4 * state_output_ws.output_partitions(32, False)}
