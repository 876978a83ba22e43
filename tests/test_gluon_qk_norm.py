"""The qk l2 norm kernels (backends/gluon_common/qk_norm.py): their plans on the CPU, the
reciprocal norms and the normalized rows against torch on a GPU of either Gluon engine."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from gdn_dispatch.testing import poison_cuda_allocator, random_problem, rel_rms_error  # noqa: E402

from gdn_dispatch.backends.gluon_common import qk_norm  # noqa: E402
from gdn_dispatch.backends.gluon_common.plan import plan  # noqa: E402

SM90, SM100 = (9, 0), (10, 0)


@pytest.mark.parametrize("capability", [SM90, SM100], ids=["sm90", "sm100"])
def test_l2_forward_plans_the_norms_between_wy_and_the_fused_kernel(capability):
    p = random_problem(lengths=[1, 63, 64, 65, 130, 0], H=2, HV=4, K=64, V=128, l2=True, seed=2)
    fp = plan(p, capability)
    assert [s.kernel for s in fp.stages] == ["wy_fwd", "qk_rnorm_fwd", "state_output_fwd"]
    norms = fp.stage("qk_rnorm_fwd")
    rows = p.B * p.T * p.H
    assert norms.scalars == {"rows": rows} and norms.constexprs == {"K": 64, "BLOCK_ROWS": qk_norm.BLOCK_ROWS,
                                                              "PICK": False}
    assert norms.grid == (-(-rows // qk_norm.BLOCK_ROWS), 2) and norms.descriptors == ()
    without = plan(random_problem(lengths=[1, 63], H=2, HV=4, seed=2), capability)
    assert [s.kernel for s in without.stages] == ["wy_fwd", "state_output_fwd"]


def test_qk_rnorm_fwd_rejects_mismatched_inputs():
    q = torch.randn(1, 10, 2, 64, dtype=torch.bfloat16)
    launch = qk_norm.plan_qk_rnorm_rows(20, 64)
    for k in (q.half(), q[:, :9].contiguous(), q.transpose(1, 2).contiguous().transpose(1, 2)):
        with pytest.raises(ValueError, match=r"q and k must be \[B, T, H, K\] token rows of one dtype"):
            qk_norm.qk_rnorm_fwd(q, k, launch)


CAPABILITY = torch.cuda.get_device_capability() if torch.cuda.is_available() else None


@pytest.mark.gpu
@pytest.mark.skipif(CAPABILITY is None or CAPABILITY[0] not in (9, 10), reason="needs a CUDA GPU of compute capability 9.0 or 10.x")
@pytest.mark.parametrize("T, H, K, dtype", [(1, 1, 64, torch.bfloat16), (333, 3, 128, torch.float16),
                                            (4099, 16, 128, torch.bfloat16)], ids=["T1-H1-K64", "T333-H3-K128", "T4099-H16"])
def test_qk_rnorm_fwd_matches_torch(T, H, K, dtype):
    gen = torch.Generator(device="cuda").manual_seed(T)
    q = (3 * torch.randn(2, T, H, K, device="cuda", generator=gen)).to(dtype)
    k = (0.1 * torch.randn(2, T, H, K, device="cuda", generator=gen)).to(dtype)
    poison_cuda_allocator()
    rnorm = qk_norm.qk_rnorm_fwd(q, k, qk_norm.plan_qk_rnorm_rows(2 * T * H, K))
    expect = torch.stack([torch.rsqrt((x.double() ** 2).sum(-1) + 1e-6).reshape(2 * T, H) for x in (q, k)], -1)
    assert rnorm.shape == (2 * T, H, 2) and not rnorm.isnan().any()
    assert rel_rms_error(rnorm, expect) <= 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(CAPABILITY is None or CAPABILITY[0] not in (9, 10), reason="needs a CUDA GPU of compute capability 9.0 or 10.x")
@pytest.mark.parametrize("T, H, K, dtype", [(1, 1, 64, torch.bfloat16), (333, 3, 128, torch.float16),
                                            (4099, 16, 128, torch.bfloat16)], ids=["T1-H1-K64", "T333-H3-K128", "T4099-H16"])
def test_qk_l2norm_fwd_matches_torch(T, H, K, dtype):
    """The normalized rows, read through token strides wider than a row (views of one
    projection), against float64 rows rounded once to the dtype."""
    gen = torch.Generator(device="cuda").manual_seed(T + 1)
    qk = torch.randn(2, T, 2 * H * K + 8, device="cuda", generator=gen).to(dtype)
    q = (3 * qk[..., :H * K]).view(2, T, H, K)
    k = (0.1 * qk[..., H * K:2 * H * K]).view(2, T, H, K)
    poison_cuda_allocator()
    launch = qk_norm.plan_qk_l2norm(random_problem(batch=(2, T), H=H, HV=H, K=K, V=K, l2=True), SM90)
    q_hat, k_hat = qk_norm.qk_l2norm_fwd(q, k, launch)
    for x, x_hat in ((q, q_hat), (k, k_hat)):
        expect = x.double() * torch.rsqrt((x.double() ** 2).sum(-1, keepdim=True) + 1e-6)
        assert x_hat.shape == x.shape and x_hat.dtype == dtype and x_hat.is_contiguous()
        assert not x_hat.isnan().any()
        # One rounding to the dtype: within half an ulp of it, relatively.
        assert rel_rms_error(x_hat.double(), expect) <= torch.finfo(dtype).eps


def test_row_plans_are_shared_per_shape():
    # state_output_fwd without rnorm plans the norms itself: one plan (and kept kernel) per shape.
    assert qk_norm.plan_qk_rnorm_rows(640, 128) is qk_norm.plan_qk_rnorm_rows(640, 128)
    assert qk_norm.plan_qk_rnorm_rows(640, 64) is not qk_norm.plan_qk_rnorm_rows(640, 128)
