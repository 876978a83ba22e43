"""The blocked chunk inverse (backends/gluon_common/blocked_inverse.py).

CPU: its algebra, step for step in float64 torch (the same masks and block products),
against ``torch.linalg.inv`` on A tiles of random and strongly correlated keys, and the
same algebra with every product's inputs rounded to tf32 against the power product the
module rejects, and rounded to fp16 (:data:`F16_OPERANDS`) against tf32, with the fp16
tables (:data:`HALF_TABLES`) against fp32 ones, and the diagonal blocks by the series
(:data:`DIAGONAL_SERIES`) against the doubling. GPU (sm_90 / sm_100): the kernel (each
operand type, table type and diagonal form) on one tile per program against float64,
every element written (NaN-poisoned output and tables), and with A past fp16's range
(the redo by rows of :func:`lost_half_range`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gdn_dispatch.testing import call_in_fresh_process

pytest.importorskip("triton.experimental.gluon")

CAPABILITY = torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def chunk_a(n: int, cosine: float, seed: int, device="cpu") -> torch.Tensor:
    """A tiles as the kernels form them: strictly lower beta_i (k_i . k_j) 2^(g_i - g_j),
    unit keys whose pairwise cosine is about ``cosine`` (0: random)."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(n, 1, 128, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(cosine ** 0.5 * torch.nn.functional.normalize(shared, dim=-1)
                                      + (1 - cosine) ** 0.5 * torch.nn.functional.normalize(
                                          torch.randn(n, 64, 128, generator=gen, dtype=torch.float64), dim=-1),
                                      dim=-1)
    beta = torch.rand(n, 64, 1, generator=gen, dtype=torch.float64)
    g = torch.cumsum(-0.1 * torch.rand(n, 64, generator=gen, dtype=torch.float64), dim=1)
    a = beta * (k @ k.transpose(1, 2)) * torch.exp2(g[:, :, None] - g[:, None, :])
    return torch.tril(a, -1).to(device)


def _tf32(x: torch.Tensor) -> torch.Tensor:
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(torch.float32).to(x.dtype)


def _f16(x: torch.Tensor) -> torch.Tensor:
    return x.half().to(x.dtype)


def model(A: torch.Tensor, rnd=lambda x: x, half_tables=False, series=False) -> torch.Tensor:
    """The module's algorithm on one [64, 64] tile; ``rnd`` rounds every product's inputs;
    ``half_tables``: T's block diagonals 0 to 2 come back through fp16 tables
    (:data:`HALF_TABLES`); ``series``: the diagonal blocks' inverses by the series in 4 x 4
    blocks (:data:`DIAGONAL_SERIES`)."""
    mm = lambda x, y: rnd(x) @ rnd(y)  # noqa: E731
    blk = lambda M, r, c: M[16 * r:16 * r + 16, 16 * c:16 * c + 16]  # noqa: E731
    i = torch.arange(16)[:, None]
    j = torch.arange(16)[None, :]
    X = []
    for r in range(4):
        D = blk(A, r, r)
        four = (i // 4 == j // 4)
        d = torch.where(four, D, 0.0)
        p = torch.where(four, mm(d, D), 0.0)
        q = torch.where(four, mm(p, D), 0.0)
        x = torch.eye(16, dtype=A.dtype) - d + p - q
        if series:
            L = torch.where(four, 0.0, mm(x, D))
            Lx, L2 = mm(L, x), mm(L, L)
            x = x - Lx + mm(L2, x) - mm(L2, Lx)
        else:
            for level in (2, 3):
                below = (i // (2 << level) == j // (2 << level)) & (i // (1 << level) != j // (1 << level))
                y = torch.where(below, mm(x, D), 0.0)
                x = x - mm(y, x)
        X.append(x)
    T = torch.zeros(64, 64, dtype=A.dtype)
    for r in range(4):
        T[16 * r:16 * r + 16, 16 * r:16 * r + 16] = X[r]
    # M[r][d] = -X_r A[r, r - d]; T[r, c] = sum over m of M[r][r - m] T[m, c], its
    # terms added from m = c up.
    M = [{d: mm(-X[r], blk(A, r, r - d)) for d in range(1, r + 1)} for r in range(4)]
    for dd in (1, 2, 3):
        for r in range(dd, 4):
            acc = mm(M[r][dd], blk(T, r - dd, r - dd))
            for m in range(r - dd + 1, r):
                acc = acc + mm(M[r][r - m], blk(T, m, r - dd))
            T[16 * r:16 * r + 16, 16 * (r - dd):16 * (r - dd) + 16] = acc
    if half_tables:
        r, c = torch.arange(64)[:, None] // 16, torch.arange(64)[None, :] // 16
        T = torch.where(r - c < 3, _f16(T), T)
    return T


def power_model(A: torch.Tensor, rnd) -> torch.Tensor:
    """The rejected form: diagonal blocks by (I - D)(I + D^2)(I + D^4)(I + D^8)."""
    out = model(A, rnd)
    for r in range(4):
        D = A[16 * r:16 * r + 16, 16 * r:16 * r + 16]
        mm = lambda x, y: rnd(x) @ rnd(y)  # noqa: E731
        D2 = mm(D, D)
        D4 = mm(D2, D2)
        D8 = mm(D4, D4)
        x = torch.eye(16, dtype=A.dtype) - D
        for p in (D2, D4, D8):
            x = x + mm(x, p)
        out[16 * r:16 * r + 16, 16 * r:16 * r + 16] = x
    return out


def _rel(x, ref):
    return float((x - ref).norm() / ref.norm())


@pytest.mark.parametrize("series", [False, True], ids=["doubling", "series"])
@pytest.mark.parametrize("cosine", [0.0, 0.5, 0.9])
def test_the_algebra_inverts_i_plus_a(cosine, series):
    A = chunk_a(8, cosine, seed=3)
    eye = torch.eye(64, dtype=torch.float64)
    for t in range(A.shape[0]):
        ref = torch.linalg.inv(eye + A[t])
        assert _rel(model(A[t], series=series), ref) < 1e-12


def unit_key_a(n: int, cosine: float, seed: int) -> torch.Tensor:
    """A tiles at the hard end: beta = 1 and no decay, unit keys of pairwise cosine about
    ``cosine`` (every entry of A near ``cosine``)."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.nn.functional.normalize(torch.randn(n, 1, 128, generator=gen, dtype=torch.float64), dim=-1)
    own = torch.nn.functional.normalize(torch.randn(n, 64, 128, generator=gen, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(cosine ** 0.5 * shared + (1 - cosine) ** 0.5 * own, dim=-1)
    return torch.tril(k @ k.transpose(1, 2), -1)


@pytest.mark.parametrize("tiles", ["decayed", "unit-beta"])
@pytest.mark.parametrize("cosine", [0.0, 0.9, 0.99, 0.999])
def test_series_diagonal_blocks_are_as_accurate_as_doubling(cosine, tiles):
    """:data:`DIAGONAL_SERIES`: with fp16 inputs the series' terms (L^2, L^3 of a block
    strictly lower in 4 x 4 blocks) stay small enough that T's error is the doubling's
    within 10%, at decayed tiles and at beta = 1 with no decay."""
    A = chunk_a(8, cosine, seed=8) if tiles == "decayed" else unit_key_a(8, cosine, seed=8)
    eye = torch.eye(64, dtype=torch.float64)
    for t in range(A.shape[0]):
        ref = torch.linalg.inv(eye + A[t])
        doubling, series = _rel(model(A[t], _f16), ref), _rel(model(A[t], _f16, series=True), ref)
        assert series <= 1.1 * doubling and series < 2e-3, (series, doubling)


@pytest.mark.parametrize("cosine", [0.0, 0.9, 0.99])
def test_f16_products_round_as_tf32_ones(cosine):
    """:data:`F16_OPERANDS`: fp16 inputs carry tf32's mantissa, so the algebra's error is
    tf32's (within 10%) and near the rounding; the tiles' entries stay inside fp16's range."""
    A = chunk_a(8, cosine, seed=6)
    eye = torch.eye(64, dtype=torch.float64)
    for t in range(A.shape[0]):
        ref = torch.linalg.inv(eye + A[t])
        err16, err32 = _rel(model(A[t], _f16), ref), _rel(model(A[t], _tf32), ref)
        assert err16 < 2e-3 and err16 <= 1.1 * err32, (err16, err32)
        assert float(ref.abs().max()) < 1e3 and float(A[t].abs().max()) <= 1.0


@pytest.mark.parametrize("cosine", [0.0, 0.9, 0.99])
def test_half_tables_round_three_diagonals_of_t_once_more(cosine):
    """:data:`HALF_TABLES`: the products read the same fp16 operands, so T differs from the
    fp32 tables' only in its block diagonals 0 to 2, by their fp16 rounding (2^-11 of each
    entry, 2^-25 below fp16's normal range), and stays as accurate (T leaves every kernel as bf16 / fp16)."""
    A = chunk_a(8, cosine, seed=7)
    eye = torch.eye(64, dtype=torch.float64)
    r, c = torch.arange(64)[:, None] // 16, torch.arange(64)[None, :] // 16
    for t in range(A.shape[0]):
        ref = torch.linalg.inv(eye + A[t])
        full, half = model(A[t], _f16), model(A[t], _f16, half_tables=True)
        assert torch.equal(half[r - c == 3], full[r - c == 3])
        # fp16's unit roundoff, and half its smallest subnormal below its normal range.
        assert bool(((half - full).abs() <= torch.clamp(full.abs() * 2.0 ** -11, min=2.0 ** -25)).all())
        assert not torch.equal(half, full)
        assert _rel(half, ref) <= 1.05 * _rel(full, ref) + 2.0 ** -11


def rows_model(A: torch.Tensor, step: int = 8) -> torch.Tensor:
    """:func:`inverse_by_rows` step for step on one tile: in place, row i of T over row i
    of A, A's row i and the buffer's rows read 8 at a time (rows i and up still hold A,
    multiplied by A's zeros at j >= i)."""
    buf = A.clone()
    n = buf.shape[0]
    for i in range(n):
        acc = torch.zeros(n, dtype=A.dtype)
        for j0 in range(0, -(-i // step) * step, step):
            acc += buf[i, j0:j0 + step] @ buf[j0:j0 + step, :]
        buf[i] = (torch.arange(n) == i).to(A.dtype) - acc
    return buf


@pytest.mark.parametrize("scale", [1.0, 2e5], ids=["unit", "past-fp16-range"])
@pytest.mark.parametrize("cosine", [0.0, 0.9])
def test_rows_redo_inverts_i_plus_a_in_place(cosine, scale):
    """The redo's forward substitution (:func:`inverse_by_rows`), in place and in steps of
    8 rows, is ``(I + A)^-1``: to 1e-12 in float64, to 1e-5 in float32 (its arithmetic)
    with A's row 1 past fp16's range."""
    A = chunk_a(8, cosine, seed=11)
    A[:, 1] *= scale
    eye = torch.eye(64, dtype=torch.float64)
    for t in range(A.shape[0]):
        ref = torch.linalg.inv(eye + A[t])
        assert _rel(rows_model(A[t]), ref) < 1e-12
        assert _rel(rows_model(A[t].float()).double(), ref) < 1e-5


def test_tf32_products_keep_correlated_keys_accurate():
    """At key cosine 0.9, tf32 inputs: the doubling stays near tf32's rounding; the power
    product (what this module does not use) loses T to cancellation."""
    A = chunk_a(6, 0.9, seed=4)
    eye = torch.eye(64, dtype=torch.float64)
    worst_doubling, worst_power = 0.0, 0.0
    for t in range(A.shape[0]):
        ref = torch.linalg.inv(eye + A[t])
        worst_doubling = max(worst_doubling, _rel(model(A[t], _tf32), ref))
        worst_power = max(worst_power, _rel(power_model(A[t], _tf32), ref))
    assert worst_doubling < 2e-3
    assert worst_power > 3 * worst_doubling


def kernel_error(cosine: float, scale: float = 1.0) -> tuple[int, float]:
    """(unwritten elements, relative error against float64) of the kernel on 512 tiles, in
    a process of its own with the build's flags set (:data:`KERNEL_BUILDS`; they are jit
    globals, fixed at their first compile), redone by rows where the result lost fp16's
    range (:func:`lost_half_range`, as the kernels that run it do). The tables' buffer is
    NaN on entry, so that a read of a slot the inverse did not write this call shows in T.
    ``scale``: A's row 1 multiplied by it (its key and beta that much larger)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from gdn_dispatch.backends.gluon_common import blocked_inverse
    from gdn_dispatch.backends.gluon_common.blocked_inverse import (
        blocked_unit_lower_inverse, fp16_products, lost_half_range, table_layout, unit_lower_inverse_by_rows)
    from gdn_dispatch.backends.gluon_common.compat import thread_barrier
    from gdn_dispatch.backends.gluon_sm90.engine import wgmma_layout

    @gluon.jit
    def tile_kernel(a_ptr, t_ptr):
        ACC: gl.constexpr = wgmma_layout(64, 64, 4)
        r = gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
        c = gl.arange(0, 64, layout=gl.SliceLayout(0, ACC))
        off = gl.program_id(0).to(gl.int64) * 4096 + gl.expand_dims(r, 1) * 64 + gl.expand_dims(c, 0)
        tables = gl.allocate_shared_memory(gl.float32, [16, 16, 16], table_layout())
        nan = gl.full([4, 16, 16], float("nan"), gl.float32, blocked_inverse.block_mma_layout())
        for q in gl.static_range(4):
            tables.slice(4 * q, 4).store(nan)
        thread_barrier()
        t = blocked_unit_lower_inverse(gl.load(a_ptr + off), tables)
        if fp16_products():
            if lost_half_range(t):
                t = unit_lower_inverse_by_rows(gl.load(a_ptr + off), tables)
        gl.store(t_ptr + off, t)

    A = chunk_a(512, cosine, seed=5)
    A[:, 1] *= scale
    ref = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + A)
    a = A.float().cuda()
    t = torch.full_like(a, float("nan"))
    tile_kernel[(A.shape[0],)](a, t, num_warps=4)
    return int(torch.isnan(t).sum()), _rel(t.double().cpu(), ref)


#: The kernel's builds the GPU test runs: (F16_OPERANDS, HALF_TABLES, DIAGONAL_SERIES) by
#: name.
KERNEL_BUILDS = {"tf32": (False, False, False), "f16": (True, False, False), "f16-half-tables": (True, True, False),
                 "f16-series": (True, False, True), "f16-all": (True, True, True)}


@pytest.mark.gpu
@pytest.mark.skipif(CAPABILITY is None or CAPABILITY[0] not in (9, 10),
                    reason="needs a CUDA GPU of compute capability 9.0 or 10.x")
@pytest.mark.parametrize("build", list(KERNEL_BUILDS))
@pytest.mark.parametrize("cosine, scale", [(0.0, 1.0), (0.9, 1.0), (0.9, 2e5)],
                         ids=["cosine-0", "cosine-0.9", "past-fp16-range"])
def test_kernel_matches_float64(cosine, scale, build):
    flags = [f"gluon_common.blocked_inverse.{name}={int(value)}"
             for name, value in zip(("F16_OPERANDS", "HALF_TABLES", "DIAGONAL_SERIES"), KERNEL_BUILDS[build])]
    unwritten, err = call_in_fresh_process(Path(__file__), f"m.kernel_error({cosine}, {scale})", flags, timeout=600)
    assert unwritten == 0, "elements left unwritten"
    # Past the range (A and T up to about 2e5 in 319 of the tiles): the CPU model's tf32
    # error is 5e-4 there; an fp16 result without the redo is not finite.
    assert err < (2e-4 if cosine == 0.0 else 2e-3)
