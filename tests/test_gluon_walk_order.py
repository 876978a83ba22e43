"""The order in which the warp-specialized Gluon kernels walk a batch's sequences
(backends/gluon_common/recurrence.py: ``longest_first``, which ``walk_program`` maps their
programs through).

CPU: the host rule (``gdn_dispatch.varlen.walk_order``) on hand-made batches. GPU (sm_90 /
sm_100): a kernel that records each program's sequence, against that rule, over seeded
random lengths with ties, empty sequences and both cu_seqlens dtypes (triton_generic's
plain-Triton twin of the search is checked the same way in tests/test_triton_generic.py,
under the interpreter too). The kernels that walk in this order are checked end to end by
tests/test_gluon_fused.py and tests/test_fuzz.py on ragged batches (every output element
written and matching the reference).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402

from gdn_dispatch.testing import random_walk_lengths  # noqa: E402
from gdn_dispatch.varlen import LONGEST_FIRST_SEQS, walk_order  # noqa: E402

from gdn_dispatch.backends.gluon_common.recurrence import longest_first  # noqa: E402

CAPABILITY = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
BT = 64


def test_the_order_puts_long_sequences_first_and_keeps_ties_in_batch_order():
    assert walk_order([70, 0, 640, 64, 100, 1], BT) == [2, 0, 4, 3, 5, 1]
    assert walk_order([5], BT) == [0]
    big = [1] * (LONGEST_FIRST_SEQS + 1)
    big[-1] = 10_000
    assert walk_order(big, BT) == list(range(len(big)))


@gluon.jit
def _walk_order_kernel(cu_seqlens, out, BT: gl.constexpr):
    p = gl.program_id(0)
    gl.store(out + p, longest_first(cu_seqlens, gl.num_programs(0), p, BT))


@pytest.mark.gpu
@pytest.mark.skipif(CAPABILITY is None or CAPABILITY[0] not in (9, 10),
                    reason="needs a CUDA GPU of compute capability 9.0 or 10.x")
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=["cu32", "cu64"])
@pytest.mark.parametrize("n", [1, 2, 7, 64, 255, 256, 257, 400])
def test_programs_walk_the_sequences_longest_first(n, cu_dtype):
    gen = torch.Generator().manual_seed(1000 + n)
    for _ in range(3):
        lengths = random_walk_lengths(gen, n)
        cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(cu_dtype).cuda()
        out = torch.full((n,), -1, dtype=torch.int32, device="cuda")
        _walk_order_kernel[(n,)](cu, out, BT, num_warps=4)
        got = out.tolist()
        assert sorted(got) == list(range(n)), "not a permutation of the batch"
        assert got == walk_order(lengths, BT)
