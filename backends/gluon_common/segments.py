"""A segmented call's segment offsets on the host, and what the planners read of them.

Pass 1 writes the segment offsets on the device (:mod:`.segment_map`);
the host needs some of their facts before it launches anything: whether a segment ends
inside a chunk (the fused kernel's tail flag) and how many segment slots hold tokens (pass
2's V-block). :func:`segment_host_offsets` computes the offsets from a call's host copy of
``cu_seqlens``; :func:`uniform_segment_facts` gives the facts of a uniform batch (or one
packed sequence) from its counts alone, :func:`ragged_segment_facts` those of a packed
batch from its host offsets, as a route needs them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from gdn_dispatch.contract import CHUNK_SIZE
from gdn_dispatch.varlen import ChunkTable


class SegmentOffsets(NamedTuple):
    """The segment offsets on the host (int64 ``[NSEG + 1]``) and what the planners read of
    them: the longest segment, whether every offset is a multiple of the chunk, how many
    segment slots hold tokens."""

    offsets: torch.Tensor
    longest: int
    aligned: bool
    nonempty: int


def segment_host_offsets(chunks: ChunkTable, seg_len: int) -> SegmentOffsets | None:
    """The segment offsets pass 1 writes on the device, computed on the host from the
    call's host copy of ``cu_seqlens``, with what the planners read of them from the same
    pass (a segmented call's host path reads them once); None without a host copy.

    The fused kernel's tail flag reads them: segments end inside a chunk exactly where the
    call's sequences do, which only host offsets show (without them the flag is on).
    """
    if chunks.cu_seqlens_host is None:
        return None
    if chunks.uniform or chunks.num_seqs == 1:
        # One packed prompt (a long prompt's call on a tensor-parallel shard) is a uniform
        # batch of one row.
        # Its one length is the longest, which the contract read from the host copy.
        return _uniform_segment_offsets(chunks.num_seqs, chunks.longest_length() if chunks.num_seqs else 0,
                                        seg_len)
    return _offsets_read(_segment_offsets(chunks.cu_seqlens_host.tolist(), seg_len))


def _offsets_read(offsets: list[int]) -> SegmentOffsets:
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    return SegmentOffsets(torch.tensor(offsets, dtype=torch.int64), max(lengths, default=0),
                          not any(x % CHUNK_SIZE for x in offsets), sum(n > 0 for n in lengths))


def _segment_offsets(cu: list[int], seg_len: int) -> list[int]:
    # Sequence n owns slots cu[n] // L + n .. cu[n + 1] // L + n; its j-th starts at
    # cu[n] + j L, clamped to its end (gdn_dispatch.context_parallel).
    out = []
    for bos, eos in zip(cu, cu[1:]):
        out.extend(min(bos + j * seg_len, eos) for j in range(eos // seg_len - bos // seg_len + 1))
    out.append(cu[-1])
    return out


@functools.lru_cache(maxsize=64)
def _uniform_segment_offsets(B: int, T: int, seg_len: int) -> SegmentOffsets:
    """Uniform batches recur with few shapes: their offsets are read once per shape."""
    return _offsets_read(_segment_offsets([n * T for n in range(B + 1)], seg_len))


def segment_facts(host: SegmentOffsets | None) -> tuple[bool, int | None]:
    """What pass 2's plan reads of the segment offsets: whether a segment ends inside a
    chunk (assumed without a host copy), and how many segment slots hold tokens (None: not
    known)."""
    return (True, None) if host is None else (not host.aligned, host.nonempty)


def uniform_segment_facts(B: int, T: int, seg_len: int) -> tuple[bool, int]:
    """:func:`segment_facts` of ``B`` sequences of ``T`` tokens (one packed sequence: B = 1)
    from the counts alone: row ``n``'s segments start at ``n T + j L`` (``L`` a multiple of
    the chunk), so they all start on a chunk exactly when ``T`` is a multiple of it, and
    ``ceil(T / L)`` of each row's slots hold tokens."""
    return T % CHUNK_SIZE != 0, B * -(-T // seg_len)


def ragged_segment_facts(offsets: list[int], seg_len: int) -> tuple[bool, int]:
    """:func:`segment_facts` of a packed batch from its host offsets ``cu`` (a list) without
    forming the segment offsets: sequence ``n``'s segments start at ``cu[n] + j L`` (``L``
    a multiple of the chunk), so they all start on a chunk exactly when every offset does,
    and ``ceil(len_n / L)`` of its slots hold tokens."""
    return (any(offset % CHUNK_SIZE for offset in offsets),
            sum(-(-(b - a) // seg_len) for a, b in zip(offsets, offsets[1:])))
