"""The reciprocal l2 norms of q's and k's rows, once per call (the fused qk l2 norm).

    rnorm[r, h, 0] = 1 / sqrt(sum_k q[r, h, k]^2 + 1e-6)      r = packed token row
    rnorm[r, h, 1] = 1 / sqrt(sum_k k[r, h, k]^2 + 1e-6)

The fused state + output kernel scales by these rows instead of reducing the q and k
tiles itself: there the reduction would sit inside the serial chunk loop and be repeated
by each of a head's V-blocks, while here every row is read once, by programs that run side
by side. wy keeps its own k norms: it reads each k tile once anyway.

One program reduces ``BLOCK_ROWS`` consecutive (token, head) rows of q (axis 1 = 0) or k
(axis 1 = 1) with coalesced 16-byte loads; no shared memory, no matrix engine. q and k are
read in place in token rows (any token stride: views of a fused projection). A stride is a
runtime argument that Triton specializes only by its divisibility by 16 (which keeps the
16-byte loads), so a new stride value compiles nothing.

:func:`qk_l2norm_fwd` writes the normalized rows themselves instead (``x * rnorm`` in q's
dtype, one contiguous ``[2, B, T, H, K]`` buffer): the warp-specialized path
(:mod:`..gluon_sm90.fused`) runs on those copies, as fla does, so that its aux partition,
which paces that kernel, folds no norm into its scores and gate vectors; every fp16 call
with the norm does (:func:`needs_norm_copies`).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from gdn_dispatch.contract import GDNProblem, token_rows_stride

from gdn_dispatch.backends.gluon_common.compat import arg_names
from gdn_dispatch.backends.gluon_common.launch import launch_planned
from gdn_dispatch.backends.gluon_common.launch_plan import (
    NUM_WARPS, PLAN_CACHE_SIZE, BoundLaunch, GridRule, LaunchPlan, pointer_attrs, sig_dtype)
from gdn_dispatch.backends.gluon_common.masks import L2NORM_EPS, tile_layout
from gdn_dispatch.backends.gluon_common.pick import picked_elsewhere

#: Rows (token, head) one program reduces: 16 KB of bf16 at K = 128 per program.
BLOCK_ROWS = 64


@gluon.jit
def _row_block(q, k, rows, H, s_q, s_k, K: gl.constexpr, BLOCK_ROWS: gl.constexpr):
    """Program (row block, which)'s ``[BLOCK_ROWS, K]`` rows of q (which = 0) or k, in
    float32, and their reciprocal norms; with the rows' indices, columns and mask."""
    layout: gl.constexpr = tile_layout(BLOCK_ROWS, K, gl.num_warps())
    which = gl.program_id(1)
    r = gl.program_id(0) * BLOCK_ROWS + gl.arange(0, BLOCK_ROWS, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, K, layout=gl.SliceLayout(0, layout))
    # (token, head) row r of q or k: token r // H at its token stride, head r % H within it.
    token = (r // H).to(gl.int64)
    head = gl.expand_dims((r % H) * K, 1) + gl.expand_dims(c, 0)
    mask = gl.expand_dims(r < rows, 1)
    if which == 0:
        x = gl.load(q + (gl.expand_dims(token * s_q, 1) + head), mask=mask, other=0.0).to(gl.float32)
    else:
        x = gl.load(k + (gl.expand_dims(token * s_k, 1) + head), mask=mask, other=0.0).to(gl.float32)
    norm = gl.rsqrt(gl.sum(x * x, axis=1) + L2NORM_EPS)
    return x, norm, which, r, c, mask


@gluon.jit(do_not_specialize=["rows", "H"])
def _qk_rnorm_fwd_kernel(q, k, rnorm, pick, rows, H, s_q, s_k, K: gl.constexpr, BLOCK_ROWS: gl.constexpr,
                         PICK: gl.constexpr):
    if PICK:
        # A picked call's pipeline (:mod:`.pick`): the census may have picked the warm chain.
        if picked_elsewhere(pick, False):
            return
    x, norm, which, r, c, mask = _row_block(q, k, rows, H, s_q, s_k, K, BLOCK_ROWS)
    # (q, k) pairs side by side: the fused kernel loads both norms of a row together.
    gl.store(rnorm + r.to(gl.int64) * 2 + which, norm, mask=r < rows)


@gluon.jit(do_not_specialize=["rows", "H"])
def _qk_l2norm_fwd_kernel(q, k, out, rows, H, s_q, s_k, K: gl.constexpr, BLOCK_ROWS: gl.constexpr):
    x, norm, which, r, c, mask = _row_block(q, k, rows, H, s_q, s_k, K, BLOCK_ROWS)
    # out [2, rows, K]: q's normalized rows, then k's.
    at = gl.expand_dims((r.to(gl.int64) + which.to(gl.int64) * rows) * K, 1) + gl.expand_dims(c, 0)
    gl.store(out + at, (x * gl.expand_dims(norm, 1)).to(out.dtype.element_ty), mask=mask)


def needs_norm_copies(problem: GDNProblem) -> bool:
    """Whether ``problem`` runs on normalized copies of q and k on every path: fp16 calls
    with the qk l2 norm. Kernels that take raw q and k round products of them to fp16
    before the row norms scale them (the scores ``q k^T``, ``v_new / ||k||``); rows far
    from unit length put those past 65504 or into fp16's subnormals, where the copies'
    rows of length at most 1 keep them in range. bf16's exponent range holds them."""
    return problem.use_qk_l2norm and problem.q.dtype == torch.float16


def l2_flags(dtype: torch.dtype) -> tuple[bool, ...]:
    """The qk l2 norm flags the stages after the norm compile for at ``dtype``: fp16 calls
    with the norm reach them as calls without it (:func:`needs_norm_copies`)."""
    return (False,) if dtype == torch.float16 else (False, True)


def _norm_kernel(name: str):
    """The norm kernel of launch-plan ``name`` and its output argument's name: the
    reciprocal norms, or the normalized rows (read at call time: tests stand in for them)."""
    if name == "qk_rnorm_fwd":
        return _qk_rnorm_fwd_kernel, "rnorm"
    return _qk_l2norm_fwd_kernel, "out"


def plan_qk_rnorm(problem: GDNProblem, device, *, engine=None) -> BoundLaunch:
    """Launch plan of :func:`qk_rnorm_fwd` for ``problem`` (a dry run: no GPU, no tensor read):
    the shared plan of K (:func:`qk_rnorm_plan`) seen with the call's ``B * T * H``
    (token, head) rows.

    Grid: (row blocks of the ``B * T * H`` (token, head) rows, 2: q then k). The kernel
    uses no matrix engine: ``device`` and ``engine`` are accepted for the planners'
    common signature.
    """
    return qk_rnorm_plan(problem.K).bind(problem.B * problem.T * problem.H, problem.N)


def plan_qk_l2norm(problem: GDNProblem, device, *, engine=None) -> BoundLaunch:
    """Launch plan of :func:`qk_l2norm_fwd` for ``problem``: as :func:`plan_qk_rnorm`, the
    same grid over the (token, head) rows."""
    return _norm_plan("qk_l2norm_fwd", problem.K).bind(problem.B * problem.T * problem.H, problem.N)


def qk_rnorm_plan(K: int) -> LaunchPlan:
    """The shared reciprocal-norm plan at head dim K, for any row count (the grid and the
    kernel's ``rows`` follow from ``B * T * H`` at each launch). Memoized: callers outside
    the forward's plan cache (``state_output_fwd`` without ``rnorm``) share it, and with it
    the compiled kernel kept on it (read-only)."""
    return _norm_plan("qk_rnorm_fwd", K)


@functools.lru_cache(maxsize=8)
def _norm_plan(kernel: str, K: int) -> LaunchPlan:
    return LaunchPlan(
        kernel=kernel,
        grid_rule=GridRule(row_block=BLOCK_ROWS, ceil=True, minimum=1, more=(2,)),
        num_warps=NUM_WARPS,
        blocks={"BLOCK_ROWS": BLOCK_ROWS, "K": K},
        constexprs={"K": K, "BLOCK_ROWS": BLOCK_ROWS, **({"PICK": False} if kernel == "qk_rnorm_fwd" else {})},
        row_scalars=("rows",),
        notes=f"B*T*H (token, head) rows of q and of k, {BLOCK_ROWS} per program",
    )


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def plan_qk_rnorm_rows(rows: int, K: int) -> BoundLaunch:
    """The norm plan at head dim K seen with ``rows = B * T * H`` (token, head) rows."""
    return qk_rnorm_plan(K).bind(rows, 0)


def clear_norm_plans() -> None:
    """Forget the memoized norm plans and the kernels kept on them
    (:func:`.plan.clear_plan_cache` calls this)."""
    _norm_plan.cache_clear()
    plan_qk_rnorm_rows.cache_clear()


def qk_rnorm_fwd(q: torch.Tensor, k: torch.Tensor, launch: LaunchPlan | BoundLaunch,
                 pick: torch.Tensor | None = None) -> torch.Tensor:
    """The reciprocal l2 norms of q's and k's rows (one launch).

    Parameters
    ----------
    q, k : Tensor ``[B, T, H, K]``, bf16/fp16, in token rows (any token stride; raw: not yet
        normalized).
    launch : the ``qk_rnorm_fwd`` plan (:func:`qk_rnorm_plan`, or a dry run's
        :func:`plan_qk_rnorm`); the grid and ``rows`` follow from q's shape.
    pick : with a ``PICK`` plan, the pick word (:mod:`.pick`): the launch leaves where it
        names the warm chain.

    Returns
    -------
    rnorm : float32 Tensor ``[B * T, H, 2]``: ``rnorm[..., 0]`` of q's rows, ``rnorm[..., 1]``
        of k's, ``1 / sqrt(sum x^2 + 1e-6)`` (:data:`masks.L2NORM_EPS`).
    """
    B, T, H, _ = q.shape
    rnorm = torch.empty(B * T, H, 2, dtype=torch.float32, device=q.device)
    _launch_norms(q, k, rnorm, launch, pick)
    return rnorm


def qk_l2norm_fwd(q: torch.Tensor, k: torch.Tensor, launch: LaunchPlan | BoundLaunch
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k with every row l2-normalized (one launch, one allocation).

    Parameters
    ----------
    q, k : Tensor ``[B, T, H, K]``, bf16/fp16, in token rows (any token stride).
    launch : the ``qk_l2norm_fwd`` plan (:func:`plan_qk_l2norm`).

    Returns
    -------
    q_hat, k_hat : contiguous Tensors ``[B, T, H, K]`` in q's dtype, ``x / sqrt(sum x^2 +
        1e-6)`` per row rounded once; the two halves of one ``[2, B, T, H, K]`` buffer.
    """
    out = torch.empty((2, *q.shape), dtype=q.dtype, device=q.device)
    _launch_norms(q, k, out, launch)
    return out[0], out[1]


def _launch_norms(q: torch.Tensor, k: torch.Tensor, out: torch.Tensor, launch: LaunchPlan | BoundLaunch,
                  pick: torch.Tensor | None = None) -> None:
    """One launch of ``launch``'s norm kernel over q's and k's rows into ``out`` (``pick``:
    a ``PICK`` plan's pick word)."""
    B, T, H, K = q.shape
    launch = launch.shared
    name = launch.kernel
    s_q, s_k = token_rows_stride(q), token_rows_stride(k)
    if k.shape != q.shape or k.dtype != q.dtype or s_q is None or s_k is None:
        raise ValueError(f"{name}: q and k must be [B, T, H, K] token rows of one dtype, got "
                         f"{q.dtype} {tuple(q.shape)} strides {q.stride()} and {k.dtype} {tuple(k.shape)} "
                         f"strides {k.stride()}")
    if launch.constexprs["K"] != K:
        raise ValueError(f"{name}: planned K = {launch.constexprs['K']}, got q of K = {K}")
    rows = B * T * H
    if rows == 0:
        return
    if launch.constexprs.get("PICK", False) != (pick is not None):
        raise ValueError(f"{name}: a PICK plan needs the pick word, another plan none")
    kernel, _ = _norm_kernel(name)
    tensors, args = norm_launch_args(launch, q, k, out, rows, H, s_q, s_k, pick)
    launch_planned(kernel, launch, tensors, args, rows=rows, num_seqs=0)


def norm_launch_args(launch: LaunchPlan, q, k, out, rows, H, s_q, s_k, pick=None) -> tuple[dict, dict]:
    """The descriptor tensors (none) and runtime arguments of one launch of ``launch``'s
    norm kernel over ``rows`` (token, head) rows (:mod:`.call_program` binds the same lists).
    The reciprocal norms' kernel reads a pick word (``pick``, a ``PICK`` plan's; else ``out``
    stands in)."""
    name = _norm_kernel(launch.kernel)[1]
    picked = {"pick": out if pick is None else pick} if name == "rnorm" else {}
    return {}, {"q": q, "k": k, name: out, **picked, "rows": rows, "H": H, "s_q": s_q, "s_k": s_k}


#: The pipeline's norm kernels: the reciprocal norms of bf16 calls, fp16's normalized copies.
PIPELINE_NORMS = (("qk_rnorm_fwd", torch.bfloat16), ("qk_l2norm_fwd", torch.float16))


def qk_norm_kernels_for_aot(capability: tuple[int, int], backend: str,
                            kernels_dtypes: tuple[tuple[str, torch.dtype], ...] = PIPELINE_NORMS) -> list:
    """The norm kernels ``kernels_dtypes`` (kernel name, q's dtype) at K in {64, 128}: the
    pipeline's (:data:`PIPELINE_NORMS`) by default; the warp-specialized path adds bf16's
    normalized rows."""
    from gdn_dispatch.aot import AotKernel

    kernels = []
    for name, dtype in kernels_dtypes:
        fn, out_name = _norm_kernel(name)
        for K in (64, 128):
            ptr = "*" + sig_dtype(dtype)
            out_type = "*fp32" if out_name == "rnorm" else ptr
            signature = {"q": ptr, "k": ptr, out_name: out_type, "rows": "i32", "H": "i32", "s_q": "i32",
                         "s_k": "i32", "K": "constexpr", "BLOCK_ROWS": "constexpr"}
            picked = out_name == "rnorm"
            if picked:
                signature.update(pick=out_type, PICK="constexpr")
            signature = {name: signature[name] for name in arg_names(fn)}
            constexprs = {"K": K, "BLOCK_ROWS": BLOCK_ROWS, **({"PICK": False} if picked else {})}
            kernels.append(AotKernel(
                backend=backend, kernel=name, specialization=f"K{K}-{sig_dtype(dtype)}",
                fn=fn, signature=signature, constexprs=constexprs,
                dialect="gluon", num_warps=NUM_WARPS,
                # Token strides H * K of contiguous inputs, and of most fused projections, are
                # multiples of 16, as a launch specializes them.
                attrs=pointer_attrs(fn, ["q", "k", out_name, "s_q", "s_k", *(["pick"] if picked else [])]),
            ))
    return kernels
