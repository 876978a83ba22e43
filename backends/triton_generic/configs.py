"""Launch configurations: a fixed table per stage, reasoned rather than autotuned.

Why fixed: autotuning at the first call costs seconds of compiles per key and makes timings
depend on what ran first. Each choice below is argued in one line; every function takes a
``config=`` override in its host wrapper, so alternatives can be timed against the table
(``python -m gdn_dispatch bench --backends triton_generic``).

Shared memory: a software-pipelined loop keeps ``num_stages`` copies of its streamed tiles in
shared memory, so stages are capped by the part's budget (sm_86/89/120 have ~100 KB per
block, sm_80 ~164 KB, sm_90/100 ~228 KB).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from triton.runtime.errors import OutOfResources

from gdn_dispatch.device import SMEM_OPTIN
from gdn_dispatch.backends.direct_launch import launch_kept
from gdn_dispatch.backends.triton_generic._jit import interpreting, next_pow2

#: Shared memory per block of a part missing from gdn_dispatch.device.SMEM_OPTIN (the
#: smallest of the parts it lists from sm_80 on).
_SMEM_DEFAULT = 99 * 1024


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and launch options of one stage (0: the stage does not tile that dim)."""

    num_warps: int
    num_stages: int = 1
    BK: int = 0
    BV: int = 0
    BH: int = 0
    BKC: int = 0


def smem_budget(capability: tuple[int, int] | None) -> int:
    """Usable shared memory per block, bytes: the opt-in maximum of ``capability``
    (gdn_dispatch.device.SMEM_OPTIN)."""
    if capability is None:  # the interpreter, or "any": assume the roomiest common part
        return SMEM_OPTIN[(9, 0)]
    return SMEM_OPTIN.get(tuple(capability), _SMEM_DEFAULT)


def _stages(wanted: int, per_stage: int, fixed: int, capability) -> int:
    """The most pipeline stages (<= wanted, >= 1) whose buffers fit the shared memory budget.

    ``num_stages = S`` keeps about ``S - 1`` copies of the streamed tiles (``per_stage``
    bytes) next to ``fixed`` bytes (MMA operands staged from registers, the extra buffer of
    a tile an asynchronous MMA still reads); 4 KB of margin for the compiler's scratch.
    """
    budget = smem_budget(capability) - 4096
    stages = wanted
    while stages > 1 and fixed + (stages - 1) * per_stage > budget:
        stages -= 1
    return stages


@functools.cache
def cumsum_config(HV: int) -> LaunchConfig:
    # A [64, BH] fp32 tile: 64 columns at most keeps a program's tile at 16 KB.
    BH = min(next_pow2(HV), 64)
    return LaunchConfig(num_warps=2 if BH <= 16 else 4, BH=BH)


#: Smallest tile edge: ``tl.dot`` needs every operand dimension >= 16; smaller heads are
#: padded to it (masked loads and stores).
MIN_TILE = 16


def _square_tile(K: int, V: int) -> int:
    """The tile edge of a kernel that multiplies both K- and V-wide tiles: the one it would
    use for square heads ``K = V = max(K, V)`` (masks cut the narrower dim).

    Why square: with unequal K and V tiles in one kernel (e.g. BK = 64 next to BV = 16 or
    32), triton 3.6 miscompiled the register-operand products on sm_90 (wrong u and o, and
    out-of-bounds shared-memory reads under compute-sanitizer), while every square shape
    ran right. Padding the narrower head keeps every launch on the square shapes.
    """
    return max(MIN_TILE, next_pow2(max(K, V)))


@functools.cache
def intra_config(K: int, V: int, elem: int, capability=None) -> LaunchConfig:
    """kkt + solve + w/u, one program per (chunk, v-head).

    BK = BV (see :func:`_square_tile`), up to 128 for 16-bit data (a [64, 128] operand tile
    is 16 KB), 64 for float32; the inverse stays in registers as a [64, 64] fp32 tile (32
    registers per thread at 4 warps). The K and V loops are one or two trips long, so two
    stages suffice.
    """
    cap = 128 if elem <= 2 else 64
    if capability is None or capability[0] in (9, 10):
        BK = BV = min(_square_tile(K, V), cap)
    else:
        # mma.sync parts (where the miscompile was not seen) keep per-dim tiles: the padded
        # square tile spills there (80 bytes at K = 100, V = 60, fp16 on sm_120, Triton 3.9).
        BK = min(max(MIN_TILE, next_pow2(K)), cap)
        BV = min(max(MIN_TILE, next_pow2(V)), cap)
    per_stage = 64 * max(BK, BV) * elem
    fixed = 64 * 64 * 4 + 64 * max(BK, BV) * elem
    return LaunchConfig(num_warps=4, num_stages=_stages(2, per_stage, fixed, capability), BK=BK, BV=BV)


def state_block_k(K: int) -> int:
    """The state kernel's K extent: the whole (padded) K, since a program keeps its full
    [BK, BV] slice of the state in registers; not a tunable."""
    return max(MIN_TILE, next_pow2(K))


@functools.lru_cache(maxsize=1024)  # NHV follows the number of sequences
def state_config(K: int, V: int, NHV: int, elem: int, capability=None,
                 sm_count: int = 132) -> LaunchConfig:
    """The chunk-state recurrence, one program per (sequence, v-head, BV slice of V).

    The whole K extent of the state is one fp32 register tile [BK, BV]. The recurrence is
    serial in chunks, so a program's time is its chunk count times the latency of one
    chunk step, and parallelism comes only from N * HV * (V / BV) programs; every V slice
    of a head re-reads the head's w and k tiles. Measured on the H200 (K = V = 128, bf16,
    benchmarks/RESULTS.md), with P = N * HV * ceil(V / 64) the programs at BV = 64:

    * P < SMs / 2 (one long sequence of 32 heads): BV = 32, to have enough programs at all;
    * P < SMs: BV = 64 and three stages, so the next chunk's tiles load during this one;
    * otherwise BV = 64 and two stages: two programs share an SM, which hides the latency
      that the third stage would, and halving the re-reads of w and k is what counts.

    Other parts keep three stages. BK * BV is capped at 8192 (64 fp32 registers per thread at 4 warps), 4096 for float32.
    """
    BK = state_block_k(K)
    limit = 8192 if elem <= 2 else 4096
    programs_bv64 = NHV * -(-V // 64)
    if programs_bv64 < sm_count // 2:
        wanted_bv, wanted_stages = 32, 3
    elif programs_bv64 < sm_count:
        wanted_bv, wanted_stages = 64, 3
    else:
        wanted_bv, wanted_stages = 64, 2
    if capability is not None and capability[0] not in (9, 10):
        # Measured on sm_90 only; mma.sync parts keep three stages, which also keeps ptxas
        # from spilling the BV = 64 tile on sm_80.
        wanted_stages = 3
        if tuple(capability) == (8, 7):
            # ptxas spills the BV = 64 tile there at three stages (12 bytes with the l2 norm,
            # Triton 3.6; sm_80 with the same shared memory spills none), at two none.
            wanted_stages = 2
    BV = max(MIN_TILE, min(next_pow2(V), wanted_bv, limit // BK))
    per_stage = (2 * 64 * BK + 64 * BV) * elem + 64 * 4
    fixed = (64 * BK + BK * BV + 64 * BV) * elem
    return LaunchConfig(num_warps=4, num_stages=_stages(wanted_stages, per_stage, fixed, capability), BK=BK, BV=BV)


@functools.cache
def output_config(K: int, V: int, elem: int, capability=None) -> LaunchConfig:
    """The output, one program per (chunk, v-head, BV slice of V).

    On wgmma parts tiles sized for square heads (:func:`_square_tile`). BV = V up to 128 (64 for float32) so that q k^T is formed once per chunk and head in
    the common case; BK = 64 keeps the streamed q, k and h tiles at 8 + 8 + 16 KB per stage
    (32 for float32, and on parts without wgmma, whose mma.sync accumulators then fit the
    register file: 255 registers and spills at BK = 64 on sm_120).
    """
    wgmma = capability is None or capability[0] in (9, 10)
    if wgmma:
        edge = _square_tile(K, V)
        BK, BV = min(edge, 64 if elem <= 2 else 32), min(edge, 128 if elem <= 2 else 64)
    else:
        # mma.sync parts: BK = 32 is never square; the V tile follows V, as at BV = 128 the
        # padded tile of a narrower V spills (32 bytes at K = 100, V = 60, fp16 on sm_80).
        BK = min(max(MIN_TILE, next_pow2(K)), 32)
        BV = max(MIN_TILE, min(next_pow2(V), 128 if elem <= 2 else 64))
    per_stage = (2 * 64 * BK + BK * BV) * elem
    fixed = (64 * 64 + 64 * BV) * elem + per_stage
    return LaunchConfig(num_warps=4, num_stages=_stages(2, per_stage, fixed, capability), BK=BK, BV=BV)


@functools.cache
def fuse_solve_into_wu(capability=None) -> bool:
    """Whether the orchestrator forms (I + A)^-1 inside the w/u kernel (True) or stores it
    with kkt_solve_fwd and reads it back in wu_fwd (False). Fused saves a [T, HV, 64] write
    and read and one read of k; the split form lets each kernel run at higher occupancy.
    The H200 script times both ("wu" in its config sweep): fused wins there (0.70 against
    0.83 ms at 32k tokens, HV = 32). On sm_100 the fused kernel spills registers under the
    tcgen05 lowering (192 bytes at K = V = 128 with the l2-norm; 4 or 8 warps, 64- or
    128-wide tiles alike), so that part takes the split form (compiled, not timed: there is
    no Blackwell part here, and gluon_sm100 is what runs there). sm_12x likewise: with the
    block-merged 16 x 16 inverse (tests/test_numerics.py) the fused kernel takes 255
    registers and spills 8 bytes there at K = 100, fp16 (mma.sync lowering)."""
    return capability is None or capability[0] not in (10, 12)


@functools.cache
def _device_facts(index: int) -> tuple[tuple[int, int], int]:
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count


def device_facts(device: torch.device) -> tuple[tuple[int, int] | None, int]:
    """(compute capability, SM count) of ``device``; (None, 1) for CPU tensors (interpreter)."""
    if device.type != "cuda":
        return None, 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_facts(index)


#: Pipeline depth that fit, per launch key, where ``_stages``'s estimate asked for too many.
_FITTED_STAGES: dict[tuple, int] = {}


def _launch_key(kernel, cfg: LaunchConfig, kwargs: dict) -> tuple:
    spec = tuple((k, v.dtype if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()
                 if not isinstance(v, float))
    return kernel.fn.__name__, cfg, spec


def launch(kernel, grid, cfg: LaunchConfig, **kwargs) -> None:
    """``kernel[grid](**kwargs)`` with ``cfg``'s warps and pipeline stages.

    On a GPU the compiled kernel of each launch specialization is kept and later launches
    call it directly (:func:`gdn_dispatch.backends.direct_launch.launch_kept`); under the
    interpreter every launch is Triton's. ``kwargs`` names every parameter of ``kernel``.
    """
    if interpreting():
        _jit_launch(kernel, grid, cfg, kwargs)
        return
    launch_kept(kernel, grid, (cfg.num_warps, cfg.num_stages), kwargs,
                lambda: _jit_launch(kernel, grid, cfg, kwargs))


def _jit_launch(kernel, grid, cfg: LaunchConfig, kwargs: dict):
    """``kernel[grid](**kwargs)`` through Triton's JIT; returns the compiled kernel.

    ``_stages`` sizes the pipeline from a model of the kernel's shared memory; where the
    compiler finds the buffers larger than the part allows (it raises OutOfResources when
    the kernel is first loaded), the launch takes one stage fewer, down to one, and the
    depth that fit is kept per launch key, so later launches go straight to it.
    """
    stages = cfg.num_stages
    if _FITTED_STAGES:
        stages = _FITTED_STAGES.get(_launch_key(kernel, cfg, kwargs), stages)
    while True:
        try:
            return kernel[grid](**kwargs, num_warps=cfg.num_warps, num_stages=stages)
        except OutOfResources as exc:
            if stages <= 1 or "shared memory" not in str(exc):
                raise
            stages -= 1
            _FITTED_STAGES[_launch_key(kernel, cfg, kwargs)] = stages
