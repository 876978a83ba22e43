"""Differential fuzz: random admitted calls for every backend on this machine, each against
the float32 reference (``reference.oracle``: o compared before any rounding to the
call's dtype, so a 16-bit output's error is not measured against a second rounding).

Every case is drawn from a seed and printed in full on failure (``FuzzCase.describe()``
gives the call to paste into a reproduction). What varies: K and V drawn independently
from the head-dim classes the backend's registry row admits (K < V, K > V, padded and
exact tiles), ragged lengths from {0, 1, 15, 63, 64, 65, 127, 2049} (2049 on a GPU only),
uniform and varlen batches, grouped value heads (HV / H of 1, 2, 4; on a GPU also two
specializations of 128 value heads at K = V, where gluon_sm90 takes its warp-specialized
path), both state layouts,
the in-kernel l2 norm, initial and final state on and off, every admitted dtype, and for a
backend that runs context parallelism a forced segment count on about a third of the
calls (drawn from a stream of its own, so the other draws stay as they were); those calls
again as chained segments of the same length (:func:`_chained_plans`), and gluon_sm90's on
its warm chain (its one-kernel build over the segment slots, ``warm_chain.WARM_CHAIN``).

Kernels specialize on the head shape and the feature flags, so a case draws those from a
pool of a dozen *specializations* per seed, and its lengths and data freshly: hundreds of
calls then cost a few dozen compiles (GPU tier: ``pytest -m gpu tests/test_fuzz.py``,
300 cases per GPU backend over two seeds; on sm_90 the path's cases again with each of its
off-by-default builds, :data:`PATH_VARIANTS`, and at K < V and K > V on the path,
:data:`SMALL_HEAD_DIMS`). The CPU tier runs triton_generic under
``TRITON_INTERPRET=1`` at small sizes, and the reference's chunked form against its
per-token recurrence.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from dataclasses import dataclass

import pytest
import torch

from gdn_dispatch import chunk_gated_delta_rule, reference
from gdn_dispatch.contract import make_problem
from gdn_dispatch.registry import load_registry
from gdn_dispatch.testing import fused_projection_views, poison_cuda_allocator, random_call, rel_rms_error

#: Relative RMS error per output tensor, by q/k/v dtype (DESIGN.md's bounds).
TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-3, torch.float16: 5e-3}

SEEDS = (0, 1)
#: Share of the calls of a context-parallel backend that force a segment count (1-6).
CP_SHARE = 0.3
GPU_CASES_PER_SEED = 150
SPECS_PER_SEED = 12

#: Head dims drawn for a row without an exact ``head_dims`` list: below the 16-wide MMA
#: minimum, non-powers of two, powers of two up to the largest admitted.
HEAD_DIM_CLASSES = (8, 16, 24, 48, 64, 100, 128, 192, 256)
CPU_HEAD_DIM_CLASSES = (4, 8, 16, 24, 32)
LENGTHS = (0, 1, 15, 63, 64, 65, 127, 2049)
CPU_LENGTHS = (0, 1, 15, 63, 64, 65)
#: (H, HV / H) pairs: grouped value heads 1, 2 and 4.
HEADS = ((1, 1), (1, 2), (2, 2), (2, 4), (4, 1), (1, 4))
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class FuzzSpec:
    """What a kernel specializes on: head shape, dtype and feature flags."""

    K: int
    V: int
    H: int
    HV: int
    dtype: str
    layout: str
    l2: bool
    h0: bool
    final: bool
    pool: bool = False


@dataclass(frozen=True)
class FuzzCase:
    """One call: a spec, its token layout (``lengths`` for varlen, ``batch`` for uniform)
    and the seed of its data."""

    backend: str
    spec: FuzzSpec
    lengths: tuple[int, ...] | None
    batch: tuple[int, int] | None
    data_seed: int
    fused: bool = False
    context_parallel: str | int = "auto"

    def describe(self) -> str:
        s = self.spec
        shape = f"lengths={list(self.lengths)}" if self.lengths is not None else f"batch={self.batch}"
        return (f"backend={self.backend!r}: random_call({shape}, H={s.H}, HV={s.HV}, K={s.K}, V={s.V}, "
                f"dtype=torch.{s.dtype}, seed={self.data_seed}, initial_state={s.h0}, "
                f"state_layout={s.layout!r}, normalize_qk={not s.l2}) with use_qk_l2norm_in_kernel={s.l2}, "
                f"output_final_state={s.final}, state pool={s.pool}, fused-projection views={self.fused}, "
                f"context_parallel={self.context_parallel!r}")


def _row(name: str):
    return next(r for r in load_registry() if r.name == name)


def _draw_spec(rng: random.Random, row, dims: tuple[int, ...]) -> FuzzSpec:
    admitted = row.head_dims or tuple(d for d in dims if d <= row.max_head_dim)
    H, ratio = rng.choice(HEADS)
    return FuzzSpec(
        K=rng.choice(admitted), V=rng.choice(admitted), H=H, HV=H * ratio,
        dtype=rng.choice(row.dtypes), layout=rng.choice(row.state_layouts),
        l2=rng.random() < 0.5, h0=rng.random() < 0.7, final=rng.random() < 0.8,
        pool="state_pool" in row.features and rng.random() < 0.3,
    )


def _draw_layout(rng: random.Random, lengths: tuple[int, ...], max_tokens: int):
    """Varlen (1-5 sequences) or a uniform batch (1-3 rows), at most ``max_tokens`` tokens."""
    while True:
        if rng.random() < 0.6:
            seqs = tuple(rng.choice(lengths) for _ in range(rng.randint(1, 5)))
            if sum(seqs) <= max_tokens:
                return seqs, None
        else:
            B, T = rng.randint(1, 3), rng.choice([t for t in lengths if t > 0])
            if B * T <= max_tokens:
                return None, (B, T)


def draw_cases(backend: str, seed: int, count: int, *, cpu: bool = False) -> list[FuzzCase]:
    """``count`` cases of ``backend`` from ``seed``: a pool of specializations, then per case
    a spec of the pool, a token layout and a data seed."""
    rng = random.Random(f"{backend}-{seed}")
    row = _row(backend)
    dims = CPU_HEAD_DIM_CLASSES if cpu else HEAD_DIM_CLASSES
    pool = [_draw_spec(rng, row, dims) for _ in range(SPECS_PER_SEED)]
    # Make the pool hold K < V and K > V whenever the row admits more than one dim.
    admitted = row.head_dims or tuple(d for d in dims if d <= row.max_head_dim)
    lo, hi = min(admitted), max(admitted)
    pool[0] = FuzzSpec(lo, hi, 1, 2, row.dtypes[0], "kv", False, True, True)
    pool[1] = FuzzSpec(hi, lo, 2, 4, row.dtypes[-1], row.state_layouts[-1], True, True, True)
    if not cpu:
        # Many value heads at K = V: a batch of them fills a GPU's SMs, which is where
        # gluon_sm90 takes its warp-specialized path (one sequence x 128 v-heads already),
        # with the qk l2 norm (folded into the path's kernels at two v-heads per q/k head)
        # and without; the l2 spec reads its states from a pool on odd seeds.
        pool[2] = FuzzSpec(hi, hi, 64, 128, row.dtypes[0], row.state_layouts[-1], True, True, True,
                           pool="state_pool" in row.features and seed % 2 == 1)
        pool[3] = FuzzSpec(hi, hi, 64, 128, row.dtypes[-1], "kv", False, False, True,
                           pool="state_pool" in row.features)
    max_tokens = 200 if cpu else 6000
    cp_rng = random.Random(f"{backend}-{seed}-context-parallel")
    runs_cp = "context_parallel" in row.features
    cases = []
    for i in range(count):
        lengths, batch = _draw_layout(rng, CPU_LENGTHS if cpu else LENGTHS, max_tokens)
        cp = cp_rng.randint(1, 6) if runs_cp and cp_rng.random() < CP_SHARE else "auto"
        cases.append(FuzzCase(backend, pool[i % len(pool)], lengths, batch, data_seed=rng.randrange(1 << 30),
                              fused=rng.random() < 0.25, context_parallel=cp))
    return cases


def run_case(case: FuzzCase, device: str) -> dict[str, float]:
    """Run ``case`` on its backend and on the reference; the relative RMS errors of o and of
    the final state (when asked)."""
    s = case.spec
    call = random_call(lengths=list(case.lengths) if case.lengths is not None else None, batch=case.batch,
                       H=s.H, HV=s.HV, K=s.K, V=s.V, dtype=DTYPES[s.dtype], device=device,
                       seed=case.data_seed, initial_state=s.h0, state_layout=s.layout, normalize_qk=not s.l2)
    flags = dict(use_qk_l2norm_in_kernel=s.l2, output_final_state=s.final)
    ref_call = dict(call)
    cp_flag = {"context_parallel": case.context_parallel}
    if case.fused:
        call = {**call, **fused_projection_views(call)}
    pool_args, pool_ref = {}, None
    if s.pool:
        pool_args, ref_call["initial_state"], pool_ref = _pool_for(call, s, case.data_seed, device)
        call = {**call, "initial_state": pool_args.pop("pool")}
        if pool_ref is not None:
            flags["output_final_state"] = True
    if device == "cuda":
        poison_cuda_allocator()
    o, ht = _call_backend(call, {**flags, **cp_flag}, pool_args, case.backend)
    o_ref, ht_ref = reference.oracle(make_problem(**ref_call, **flags))
    errors = {"o": rel_rms_error(o, o_ref)}
    if pool_ref is not None:
        live = pool_args["state_indices"] >= 0
        pool_ref[pool_args["state_indices"][live].long()] = ht_ref[live].to(pool_ref.dtype)
        errors["pool"] = rel_rms_error(call["initial_state"], pool_ref)
        if not s.final:
            ht, ht_ref = None, None
    assert o.shape == o_ref.shape and o.dtype == ref_call["q"].dtype, case.describe()
    if ht_ref is not None:
        assert ht is not None and ht.shape == ht_ref.shape and ht.dtype == torch.float32, case.describe()
        errors["final_state"] = rel_rms_error(ht, ht_ref)
    else:
        assert ht is None, case.describe()
    return errors


def _pool_dtype(seed: int) -> torch.dtype:
    return torch.bfloat16 if seed % 2 else torch.float32


def _pool_for(call: dict, s: FuzzSpec, seed: int, device: str):
    """A pool of N + 2 rows (float32 or bfloat16 by seed), indices with a -1, the gathered
    initial states for the reference, and a copy of the pool to scatter the reference into
    (None when the call does not write back: every other seed)."""
    N = call["cu_seqlens"].numel() - 1 if call.get("cu_seqlens") is not None else call["q"].shape[0]
    gen = torch.Generator().manual_seed(seed)
    dims = (s.K, s.V) if s.layout == "kv" else (s.V, s.K)
    pool_dtype = _pool_dtype(seed)
    pool = (0.1 * torch.randn(N + 2, s.HV, *dims, generator=gen)).to(pool_dtype).to(device)
    idx = torch.randperm(N + 2, generator=gen)[:N].to(torch.int32)
    if N > 1:
        idx[int(torch.randint(N, (1,), generator=gen))] = -1
    idx = idx.to(device)
    h0 = torch.zeros(N, s.HV, *dims, device=device)
    live = idx >= 0
    h0[live] = pool[idx[live].long()].float()
    inplace = seed % 3 != 0
    args = {"pool": pool, "state_indices": idx, "inplace_final_state": inplace}
    return args, h0, (pool.clone() if inplace else None)


def _call_backend(call: dict, flags: dict, pool_args: dict, backend: str):
    if not pool_args:
        return chunk_gated_delta_rule(**call, **flags, backend=backend)
    from gdn_dispatch.device import default_probe
    from gdn_dispatch.registry import select

    problem = make_problem(**call, **flags, **pool_args, backend=backend)
    selection = select(default_probe().for_torch_device(problem.device), problem)
    return selection.module.forward(problem, selection)


def _check(case: FuzzCase, device: str) -> None:
    errors = run_case(case, device)
    tol = TOL[DTYPES[case.spec.dtype]]
    # A bfloat16 pool holds the final states rounded to bfloat16: the kernel's and the
    # reference's roundings of nearby float32 values differ by up to one bf16 step.
    tols = {name: max(tol, TOL[_pool_dtype(case.data_seed)]) if name == "pool" else tol for name in errors}
    bad = {name: err for name, err in errors.items() if not err <= tols[name]}
    assert not bad, f"{bad} above {tols} for {case.describe()}"


def on_sm90_path(c: FuzzCase) -> bool:
    """Whether gluon_sm90 runs case ``c`` on its warp-specialized path on a 132-SM
    H100/H200, as its planner decides (the case's shapes on the meta device: planning reads
    no values)."""
    from gdn_dispatch.backends.gluon_common.forward import plan_call
    from gdn_dispatch.device import assumed_device

    s = c.spec
    B, T = (1, sum(c.lengths)) if c.lengths is not None else c.batch
    N = len(c.lengths) if c.lengths is not None else B

    def meta(*shape, dtype=DTYPES[s.dtype]):
        return torch.empty(shape, dtype=dtype, device="meta")

    state = (N, s.HV, s.K, s.V) if s.layout == "kv" else (N, s.HV, s.V, s.K)
    p = make_problem(meta(B, T, s.H, s.K), meta(B, T, s.H, s.K), meta(B, T, s.HV, s.V),
                     meta(B, T, s.HV, dtype=torch.float32), meta(B, T, s.HV, dtype=torch.float32),
                     initial_state=meta(*state, dtype=torch.float32) if s.h0 else None,
                     output_final_state=s.final, state_layout=s.layout, use_qk_l2norm_in_kernel=s.l2,
                     cu_seqlens=[0, *itertools.accumulate(c.lengths)] if c.lengths is not None else None,
                     context_parallel=c.context_parallel)
    return plan_call(p, assumed_device("sm_90")).launches.fused


# --- GPU tier -----------------------------------------------------------------------------

HAS_GPU = torch.cuda.is_available()


def _gpu_backends() -> list[str]:
    if not HAS_GPU:
        return ["triton_generic"]  # listed so the skipped tier is visible in the report
    cap = torch.cuda.get_device_capability()
    names = ["triton_generic"]
    if cap == (9, 0):
        names.append("gluon_sm90")
    if cap in ((10, 0), (10, 3)):
        names.append("gluon_sm100")
    return names


def _gpu_params(pick=enumerate, tag: str = ""):
    """The GPU draw of every GPU backend, as ``(index, case)`` pairs ``pick`` keeps of each
    seed's cases (all by default), with ``tag`` in their ids."""
    for backend in _gpu_backends():
        for seed in SEEDS:
            for i, case in pick(draw_cases(backend, seed, GPU_CASES_PER_SEED)):
                yield pytest.param(case, id=f"{backend}{tag}-s{seed}-{i:03d}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU; the CPU tier below runs the interpreter")
@pytest.mark.parametrize("case", list(_gpu_params()))
def test_fuzz_gpu(case, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("GDN_BACKEND", raising=False)
    _check(case, "cuda")


#: The warp-specialized path's builds that its defaults leave out (gluon_sm90.fused flags),
#: run on the seeds' path cases: (name, {flag: value}, which cases it changes). The qk l2
#: norm on normalized copies of q and k where the default folds it in (groups of up to
#: fused.QK_NORM_ON_CHIP_MAX_GROUP v-heads); the chunk inverses formed by the T kernel in a
#: launch of its own (fused.AUX_T off), alone and with the state chain's output product
#: issued after the chain's update (fused.EARLY_O1 off); the one launch with its causal
#: scores formed in the aux partition (fused.STATE_SCORES off), each on every path case.
PATH_VARIANTS = (("norm-copies", {"QK_NORM_ON_CHIP": False}, lambda c: c.spec.l2 and _norm_on_chip_group(c)),
                 ("t-kernel", {"AUX_T": False}, lambda c: True),
                 ("aux-scores", {"STATE_SCORES": False}, lambda c: True),
                 ("late-o1", {"EARLY_O1": False, "AUX_T": False}, lambda c: True))


def _norm_on_chip_group(case) -> bool:
    """Whether the case's group (v-heads per q/k head) is one the default folds the norm in for."""
    from gdn_dispatch.backends.gluon_sm90 import fused

    return case.spec.HV // case.spec.H <= fused.QK_NORM_ON_CHIP_MAX_GROUP


def _path_variant_params():
    if not HAS_GPU or torch.cuda.get_device_capability() != (9, 0):
        yield pytest.param(None, None, id="gluon_sm90-path-variants")
        return
    for name, flags, changes in PATH_VARIANTS:
        for seed in SEEDS:
            for i, case in enumerate(draw_cases("gluon_sm90", seed, GPU_CASES_PER_SEED)):
                if on_sm90_path(case) and changes(case):
                    yield pytest.param(case, flags, id=f"gluon_sm90-{name}-s{seed}-{i:03d}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case, flags", list(_path_variant_params()))
def test_fuzz_gpu_path_variants(case, flags, monkeypatch):
    """The path's off-by-default builds on the fuzz's path cases (tails, pools, both
    layouts, grouped heads, the qk l2 norm), against the reference as the default build."""
    _check_path_build(case, monkeypatch, flags)


def _check_path_build(case, monkeypatch, flags: dict, on_path: bool = False) -> None:
    """:func:`_check` on the GPU with gluon_sm90.fused's build ``flags`` set (name ->
    value; plans made afresh under them and after); with ``on_path`` the case must take
    the warp-specialized path under them."""
    from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache
    from gdn_dispatch.backends.gluon_sm90 import fused

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("GDN_BACKEND", raising=False)
    for flag, value in flags.items():
        monkeypatch.setattr(fused, flag, value)
    clear_plan_cache()
    try:
        assert on_sm90_path(case) or not on_path
        _check(case, "cuda")
    finally:
        clear_plan_cache()


#: Head dims the path takes with fused.SMALL_HEADS (K < V and K > V): the seeds' path
#: cases again at each, with that flag and, on every other case, fused.AUX_T (every
#: other one of those with fused.STATE_SCORES too, as shipped; the others with the T
#: kernel, or the scores in the aux partition).
SMALL_HEAD_DIMS = ((64, 128), (128, 64))


def small_head_cases(cases) -> list[tuple[FuzzCase, dict]]:
    """``(case, flags)``: each path case of ``cases`` at every pair of :data:`SMALL_HEAD_DIMS`
    (same lengths, layout, pool, norm and data seed), with the gluon_sm90.fused build
    flags it runs under."""
    import dataclasses

    out = []
    for i, case in enumerate(c for c in cases if on_sm90_path(c)):
        flags = {"SMALL_HEADS": True, "AUX_T": i % 2 == 1, "STATE_SCORES": i % 4 == 3}
        for K, V in SMALL_HEAD_DIMS:
            out.append((dataclasses.replace(case, spec=dataclasses.replace(case.spec, K=K, V=V)), flags))
    return out


def _small_head_params():
    if not HAS_GPU or torch.cuda.get_device_capability() != (9, 0):
        yield pytest.param(None, None, id="gluon_sm90-small-heads")
        return
    for seed in SEEDS:
        pairs = small_head_cases(draw_cases("gluon_sm90", seed, GPU_CASES_PER_SEED))
        for i, (case, flags) in enumerate(pairs):
            yield pytest.param(case, flags, id=f"gluon_sm90-small-heads-s{seed}-{i:03d}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case, flags", list(_small_head_params()))
def test_fuzz_gpu_small_heads(case, flags, monkeypatch):
    """The path at K < V and K > V (fused.SMALL_HEADS; fused.AUX_T on every other case,
    fused.STATE_SCORES on every other one of those) on the fuzz's path cases against the
    reference."""
    _check_path_build(case, monkeypatch, flags, on_path=True)


def test_small_head_cases_take_the_path_with_their_flag(monkeypatch):
    """The small-head fuzz cases: K < V and K > V, tails, a pool, both layouts, the norm on
    and off; on the path with fused.SMALL_HEADS, off it without."""
    from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache
    from gdn_dispatch.backends.gluon_sm90 import fused

    pairs = [p for seed in SEEDS for p in small_head_cases(draw_cases("gluon_sm90", seed, GPU_CASES_PER_SEED))]
    cases = [c for c, _ in pairs]
    assert len(cases) >= 40 and {(c.spec.K, c.spec.V) for c in cases} == set(SMALL_HEAD_DIMS)
    assert any(f["AUX_T"] for _, f in pairs) and not all(f["AUX_T"] for _, f in pairs)
    assert any(f["STATE_SCORES"] for _, f in pairs) and all(f["AUX_T"] for _, f in pairs if f["STATE_SCORES"])
    assert not all(f["STATE_SCORES"] for _, f in pairs if f["AUX_T"])
    assert {(c.spec.K, c.spec.V) for c, f in pairs if f["STATE_SCORES"]} == set(SMALL_HEAD_DIMS)
    assert any(c.spec.pool for c in cases) and {c.spec.layout for c in cases} == {"kv", "vk"}
    assert {c.spec.l2 for c in cases} == {False, True}
    assert any(c.lengths and {1, 63, 65} & set(c.lengths) for c in cases)
    monkeypatch.setattr(fused, "SMALL_HEADS", False)
    clear_plan_cache()
    assert not any(on_sm90_path(c) for c in cases[:6])
    monkeypatch.setattr(fused, "SMALL_HEADS", True)
    clear_plan_cache()
    assert all(on_sm90_path(c) for c in cases)
    clear_plan_cache()


def _forced_cases(cases):
    """The draw's calls with a forced segment count."""
    return [(i, c) for i, c in enumerate(cases) if isinstance(c.context_parallel, int)]


def _bf16_maps_cases(cases):
    """The draw's calls that :data:`..segment_map.BF16_MAPS` changes: forced segments on
    16-bit data."""
    return [(i, c) for i, c in enumerate(cases)
            if isinstance(c.context_parallel, int) and c.spec.dtype != "float32"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU; the CPU tier below runs the interpreter")
@pytest.mark.parametrize("case", list(_gpu_params(_bf16_maps_cases, "-bf16-maps")))
def test_fuzz_gpu_bf16_maps(case, monkeypatch):
    """Context parallelism's off-by-default build (the maps in two bf16 parts) on the
    draw's forced-segment 16-bit calls, against the reference as the default build."""
    from gdn_dispatch.backends.triton_generic import segment_map

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("GDN_BACKEND", raising=False)
    monkeypatch.setattr(segment_map, "BF16_MAPS", True)
    _check(case, "cuda")


def _chained_plans(monkeypatch, picked: bool = False) -> None:
    """Every segmented plan made from now on chained (the same segments, handed over instead
    of mapped and scanned; ``picked``: the device picks between them and "off"): the
    planners' one memoized entry returns the plan it would, chained where it is on (routes
    then decline the call and the forwards launch it)."""
    from gdn_dispatch import context_parallel

    planned = context_parallel._plan_kept

    def chained(*args):
        plan = planned(*args)
        return dataclasses.replace(plan, chained=True, picked=picked) if plan.enabled else plan

    monkeypatch.setattr(context_parallel, "_plan_kept", chained)


def _check_chained(case, monkeypatch, warm: bool, picked: bool = False) -> None:
    """``case`` as chained segments (:func:`_chained_plans`; ``picked``: picked on the
    device) with gluon_sm90's warm chain on or off, on the GPU against the reference; plans
    computed afresh."""
    from gdn_dispatch.backends.gluon_common import warm_chain
    from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("GDN_BACKEND", raising=False)
    _chained_plans(monkeypatch, picked)
    monkeypatch.setattr(warm_chain, "WARM_CHAIN", warm)
    clear_plan_cache()
    try:
        _check(case, "cuda")
    finally:
        clear_plan_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU; the CPU tier below runs the interpreter")
@pytest.mark.parametrize("case", list(_gpu_params(_forced_cases, "-chained")))
def test_fuzz_gpu_chained(case, monkeypatch):
    """The draw's forced-segment calls as chained segments on the pipeline's passes (the
    warm chain off), against the reference."""
    _check_chained(case, monkeypatch, warm=False)


def _sm90_forced_cases(cases):
    """The draw's forced-segment calls of gluon_sm90 (the backend with a warm chain)."""
    return [(i, c) for i, c in _forced_cases(cases) if c.backend == "gluon_sm90"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU; the CPU tier below runs the interpreter")
@pytest.mark.parametrize("case", list(_gpu_params(_sm90_forced_cases, "-warm-chained")))
def test_fuzz_gpu_warm_chained(case, monkeypatch):
    """gluon_sm90's forced-segment calls as chained segments with the warm chain on (its
    one-kernel build over the segment slots, where the call's class has that build),
    against the reference."""
    _check_chained(case, monkeypatch, warm=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU; the CPU tier below runs the interpreter")
@pytest.mark.parametrize("case", list(_gpu_params(_sm90_forced_cases, "-picked")))
def test_fuzz_gpu_picked(case, monkeypatch):
    """gluon_sm90's forced-segment calls as picked plans: the census, then the warm chain
    or the unsegmented pipeline as it picks (a class without a warm chain runs "off"),
    against the reference."""
    _check_chained(case, monkeypatch, warm=True, picked=True)


# --- CPU tier -----------------------------------------------------------------------------

CPU_CASES_PER_SEED = 8


@pytest.mark.parametrize("case", [pytest.param(c, id=f"triton_generic-s{seed}-{i:02d}")
                                  for seed in SEEDS
                                  for i, c in enumerate(draw_cases("triton_generic", seed, CPU_CASES_PER_SEED, cpu=True))])
def test_fuzz_triton_generic_interpreted(case, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("GDN_BACKEND", raising=False)
    _check(case, "cpu")


@pytest.mark.parametrize("case", [pytest.param(c, id=f"triton_generic-bf16-maps-s{seed}-{i:02d}")
                                  for seed in SEEDS
                                  for i, c in _bf16_maps_cases(draw_cases("triton_generic", seed, CPU_CASES_PER_SEED,
                                                                          cpu=True))])
def test_fuzz_triton_generic_interpreted_bf16_maps(case, monkeypatch):
    """The CPU tier's forced-segment 16-bit calls again with the maps in two bf16 parts."""
    from gdn_dispatch.backends.triton_generic import segment_map

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("GDN_BACKEND", raising=False)
    monkeypatch.setattr(segment_map, "BF16_MAPS", True)
    _check(case, "cpu")


@pytest.mark.parametrize("case", [pytest.param(c, id=f"triton_generic-chained-s{seed}-{i:02d}")
                                  for seed in SEEDS
                                  for i, c in _forced_cases(draw_cases("triton_generic", seed, CPU_CASES_PER_SEED,
                                                                       cpu=True))])
def test_fuzz_triton_generic_interpreted_chained(case, monkeypatch):
    """The CPU tier's forced-segment calls again as chained segments."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("GDN_BACKEND", raising=False)
    _chained_plans(monkeypatch)
    _check(case, "cpu")


@pytest.mark.parametrize("seed", SEEDS)
def test_fuzz_reference_chunked_equals_recurrent(seed):
    """The reference's two forms agree on random calls (its chunked form is the oracle)."""
    for case in draw_cases("reference", seed, 20, cpu=True):
        s = case.spec
        call = random_call(lengths=list(case.lengths) if case.lengths is not None else None, batch=case.batch,
                           H=s.H, HV=s.HV, K=s.K, V=s.V, dtype=torch.float32, seed=case.data_seed,
                           initial_state=s.h0, state_layout=s.layout, normalize_qk=not s.l2)
        problem = make_problem(**call, use_qk_l2norm_in_kernel=s.l2, output_final_state=True)
        o, ht = reference.forward(problem)
        o_rec, ht_rec = reference.forward_recurrent(problem)
        assert rel_rms_error(o, o_rec) <= 1e-5, case.describe()
        assert rel_rms_error(ht, ht_rec) <= 1e-5, case.describe()


def test_draws_cover_the_classes():
    """The GPU draw holds K < V, K > V, every grouping, both layouts, l2 on and off,
    zero-length and 2049-token sequences, and uniform batches; and is reproducible."""
    cases = [c for seed in SEEDS for c in draw_cases("triton_generic", seed, GPU_CASES_PER_SEED)]
    specs = {c.spec for c in cases}
    assert any(s.K < s.V for s in specs) and any(s.K > s.V for s in specs)
    assert {s.HV // s.H for s in specs} >= {1, 2, 4}
    assert {s.layout for s in specs} == {"kv", "vk"} and {s.l2 for s in specs} == {False, True}
    assert {s.dtype for s in specs} == {"bfloat16", "float16", "float32"}
    lengths = {n for c in cases if c.lengths for n in c.lengths}
    assert {0, 1, 63, 64, 65, 2049} <= lengths
    assert any(c.batch for c in cases) and any(c.lengths for c in cases)
    assert any(s.pool for s in specs) and any(c.fused for c in cases)
    forced = [c for c in cases if isinstance(c.context_parallel, int)]
    assert forced and any(c.lengths and max(c.lengths) > 64 * c.context_parallel for c in forced)
    assert any(s.pool for s in {c.spec for c in forced})
    # Forced segments on 16-bit data (the bf16-maps build's cases), on the CPU tier too.
    assert len(_bf16_maps_cases(cases)) >= 20
    assert _bf16_maps_cases([c for seed in SEEDS for c in draw_cases("triton_generic", seed, CPU_CASES_PER_SEED,
                                                                     cpu=True)])
    assert draw_cases("triton_generic", 0, 10) == draw_cases("triton_generic", 0, 10)
    gluon_cases = [c for seed in SEEDS for c in draw_cases("gluon_sm90", seed, GPU_CASES_PER_SEED)]
    gluon = {c.spec for c in gluon_cases}
    assert {(s.K, s.V) for s in gluon} == {(64, 64), (64, 128), (128, 64), (128, 128)} or \
        {(s.K, s.V) for s in gluon} >= {(64, 128), (128, 64)}
    # Calls gluon_sm90 runs on its warp-specialized path on a 132-SM H100/H200, as its
    # planner decides (K = V = 128, no forced segments, (sequence, v-head) pairs >= 3/4 of
    # the SMs); with tails, a pool, both layouts and the qk l2 norm on and off among them,
    # and the norm on chip with a pool.
    wide = [c for c in gluon_cases if on_sm90_path(c)]
    assert len(wide) >= 20
    assert any(c.spec.pool for c in wide) and {c.spec.layout for c in wide} == {"kv", "vk"}
    assert {c.spec.l2 for c in wide} == {False, True}
    assert any(c.spec.l2 and c.spec.pool and c.spec.HV == 2 * c.spec.H for c in wide)  # the norm on chip, pooled
    assert any(c.lengths and {1, 63, 65} & set(c.lengths) for c in wide)


@pytest.mark.parametrize("backend", ["gluon_sm90", "gluon_sm100"])
def test_gluon_draws_force_context_parallel(backend):
    """The Gluon rows run segments, so their draws force segment counts as triton_generic's
    do: some cut a long sequence into several, with pools and both layouts among them."""
    cases = [c for seed in SEEDS for c in draw_cases(backend, seed, GPU_CASES_PER_SEED)]
    forced = [c for c in cases if isinstance(c.context_parallel, int)]
    assert 0.15 * len(cases) <= len(forced) <= 0.45 * len(cases)
    assert any(c.lengths and max(c.lengths) > 64 * c.context_parallel for c in forced)
    assert any(c.batch for c in forced) and any(c.lengths and 0 in c.lengths for c in forced)
    specs = {c.spec for c in forced}
    assert any(s.pool for s in specs) and {s.layout for s in specs} == {"kv", "vk"}
