"""The benchmark's shapes and its model of them: the table of Qwen3.5-shaped prefill calls
(:func:`default_shapes`), the tensor-parallel shards of one long prompt (:func:`tp_shapes`,
the ``tp-*`` group), the least bytes any implementation must move (:func:`io_bytes`),
fla's pipeline FLOP count (:func:`flop_count`) and the speed-of-light bound built from them
(:func:`sol_bound_s`). Pure functions, tested on the CPU.
"""

from __future__ import annotations

import fnmatch
import random
from dataclasses import dataclass

import torch

from gdn_dispatch.contract import CHUNK_SIZE

# What Qwen3-Next / Qwen3.5 pass: bf16 activations, the decay g in float32 (it comes out of
# a float32 softplus), beta in the activation dtype, and a float32 recurrent state.
QKV_DTYPE = torch.bfloat16
G_DTYPE = torch.float32
BETA_DTYPE = torch.bfloat16
STATE_DTYPE = torch.float32
HEAD_DIM = 128
HEAD_CONFIGS = ((16, 32), (16, 64))  # (H, HV): Qwen3.5's grouped value heads, 2x and 4x
UNIFORM_BATCHES = ((1, 8192), (1, 32768), (4, 8192), (8, 4096))  # (B, T)
RAGGED_COUNT = 16
RAGGED_MAX_LEN = 8192
# Fixed, not --seed: a shape name must mean the same lengths in every run and report.
RAGGED_SEED = 2025
#: Tensor-parallel shards of Qwen3.5 layers, (H, HV, sequence lengths): the k- and v-heads
#: one GPU holds at TP = 8, 4, 2 (and Qwen3.5-397B's 16/64 at TP = 8), one 32k-token prompt
#: or eight 4k ones, as a varlen call. Few (sequence, head) pairs against the SMs: the calls
#: context parallelism is for.
TP_SHARDS = ((2, 4, (32768,)), (4, 8, (32768,)), (2, 8, (32768,)), (8, 16, (32768,)), (16, 32, (32768,)),
             (2, 4, (4096,) * 8))
#: Name prefix of the tensor-parallel group (``--shapes 'tp*'``).
TP_PREFIX = "tp-"

FLOP_FORMULA = "per token and v-head: 6*K*V + C*(6*K + 4*V) + 2*C*C/3 (fla's pipeline count), C = 64"
BOUND_FORMULA = "bound = max(min_bytes / copy bandwidth, flops / bf16 matmul rate)"


@dataclass(frozen=True)
class BenchShape:
    """One benchmarked call.

    A uniform batch is ``B`` rows of ``T`` tokens (no ``cu_seqlens``); a ragged one has
    ``seqlens`` and is packed as ``B = 1``, ``T = sum(seqlens)`` with ``cu_seqlens``.
    """

    name: str
    H: int
    HV: int
    B: int
    T: int
    K: int = HEAD_DIM
    V: int = HEAD_DIM
    seqlens: tuple[int, ...] | None = None

    @property
    def tokens(self) -> int:
        return self.B * self.T

    @property
    def N(self) -> int:
        """Number of sequences (and of initial/final states)."""
        return self.B if self.seqlens is None else len(self.seqlens)

    @property
    def is_varlen(self) -> bool:
        return self.seqlens is not None

    def describe(self) -> str:
        if self.is_varlen:
            rows = f"{self.N} seqs, {self.tokens} tokens (lengths {min(self.seqlens)}..{max(self.seqlens)})"
        else:
            rows = f"B={self.B} T={self.T}"
        return f"{rows}, H={self.H} HV={self.HV} K={self.K} V={self.V}"


def ragged_lengths(count: int = RAGGED_COUNT, max_len: int = RAGGED_MAX_LEN,
                   seed: int = RAGGED_SEED) -> tuple[int, ...]:
    """``count`` sequence lengths drawn uniformly from ``[1, max_len]``, reproducibly."""
    rng = random.Random(seed)
    return tuple(rng.randint(1, max_len) for _ in range(count))


def default_shapes() -> list[BenchShape]:
    """The default table: each (H, HV) with every uniform batch, then one ragged batch."""
    shapes = []
    lengths = ragged_lengths()
    for H, HV in HEAD_CONFIGS:
        for B, T in UNIFORM_BATCHES:
            shapes.append(BenchShape(name=f"H{H}-HV{HV}-{B}x{T}", H=H, HV=HV, B=B, T=T))
        shapes.append(BenchShape(name=f"H{H}-HV{HV}-ragged{len(lengths)}", H=H, HV=HV, B=1,
                                 T=sum(lengths), seqlens=lengths))
    return shapes


def tp_shapes() -> list[BenchShape]:
    """The tensor-parallel group: each of :data:`TP_SHARDS` as a varlen call (``B = 1``),
    named ``tp-H{H}-HV{HV}-{N}x{length}``."""
    return [BenchShape(name=f"{TP_PREFIX}H{H}-HV{HV}-{len(lengths)}x{lengths[0]}", H=H, HV=HV, B=1,
                       T=sum(lengths), seqlens=lengths) for H, HV, lengths in TP_SHARDS]


def shapes_for(patterns: str | None, *, listing: bool = False) -> list[BenchShape]:
    """What ``--shapes`` names: without patterns the default table (every group when
    ``listing``, for ``--list-shapes``), else the shapes of every group that match
    (:func:`select_shapes`)."""
    if not patterns:
        return default_shapes() + (tp_shapes() if listing else [])
    return select_shapes(default_shapes() + tp_shapes(), patterns)


def select_shapes(shapes: list[BenchShape], patterns: str | None) -> list[BenchShape]:
    """The shapes named by a comma-separated list of names or glob patterns, in table order.

    Raises ValueError naming a pattern that matches nothing, with the valid names.
    """
    if not patterns:
        return list(shapes)
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    names = [s.name for s in shapes]
    for pattern in wanted:
        if not fnmatch.filter(names, pattern):
            raise ValueError(f"--shapes: {pattern!r} matches no shape; valid names: {', '.join(names)}")
    return [s for s in shapes if any(fnmatch.fnmatchcase(s.name, p) for p in wanted)]


# --------------------------------------------------------------------------- bytes, flops, bound


def io_bytes(shape: BenchShape) -> tuple[int, int]:
    """``(read, written)``: the least traffic any implementation needs, in bytes.

    Read once: q, k ``[B, T, H, K]`` and v ``[B, T, HV, V]`` (bf16), g (fp32), beta (bf16)
    ``[B, T, HV]``, the initial state ``[N, HV, K, V]`` (fp32). Written once: o
    ``[B, T, HV, V]`` (bf16) and the final state ``[N, HV, K, V]`` (fp32).
    """
    n, hv = shape.tokens, shape.HV
    qkv = QKV_DTYPE.itemsize
    state = shape.N * hv * shape.K * shape.V * STATE_DTYPE.itemsize
    read = (2 * n * shape.H * shape.K * qkv + n * hv * shape.V * qkv
            + n * hv * (G_DTYPE.itemsize + BETA_DTYPE.itemsize) + state)
    written = n * hv * shape.V * qkv + state
    return read, written


def min_bytes(shape: BenchShape) -> int:
    """Inputs read once plus outputs written once, in bytes (see :func:`io_bytes`)."""
    return sum(io_bytes(shape))


def flop_count(shape: BenchShape, chunk: int = CHUNK_SIZE) -> float:
    """fla's pipeline FLOPs: ``(6KV + C(6K + 4V) + 2C^2/3)`` per token and v-head.

    The terms: ``6KV`` for the state pass (``w h``, ``k^T v_new``) and ``q h``; ``C(6K + 4V)``
    for the intra-chunk ``k k^T``, ``q k^T`` and the ``T``-products forming w, u and the
    causal ``(q k^T) v_new``; ``2C^2/3`` for the triangular inverse. Partial chunks of ragged
    sequences are counted as if full-width per token, which is what the kernels compute.
    """
    K, V, C = shape.K, shape.V, chunk
    per_token = 6 * K * V + C * (6 * K + 4 * V) + 2 * C * C / 3
    return float(shape.tokens * shape.HV * per_token)


def sol_bound_s(nbytes: float, flops: float, bandwidth: float, matmul_rate: float) -> tuple[float, str]:
    """The speed-of-light time in seconds, and which ceiling sets it ("memory" or "compute").

    ``bandwidth`` in bytes/s (read + written), ``matmul_rate`` in FLOP/s.
    """
    memory, compute = nbytes / bandwidth, flops / matmul_rate
    return (memory, "memory") if memory >= compute else (compute, "compute")
