"""Chunk index tables: which sequence and which chunk of it each program works on.

Every backend launches per-chunk kernels over a flat list of chunks and per-sequence
kernels over sequences; both need the same tables, built here once per call.

A uniform batch (no ``cu_seqlens``) is the special case of ``B`` sequences of ``T`` tokens
packed along one axis of ``B * T`` tokens, which is exactly how a contiguous ``[B, T, ...]``
tensor lies in memory, so backends handle both cases with one code path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkTable:
    """Index tables for one call; all tensors int32 on the call's device.

    Attributes
    ----------
    num_seqs : int, ``N``.
    num_chunks : int, ``NT``, total chunks over all sequences (a sequence of ``L`` tokens
        has ``ceil(L / C)`` chunks; a zero-length sequence has none).
    chunk_size : int, ``C``.
    cu_seqlens : Tensor ``[N + 1]``, token offsets of the sequences in the packed axis.
    chunk_seq : Tensor ``[NT]``, sequence id of each chunk.
    chunk_local : Tensor ``[NT]``, index of each chunk within its sequence.
    seq_chunk_start : Tensor ``[N + 1]``, index of each sequence's first chunk in the
        flat chunk list (a prefix sum of chunks per sequence).
    cu_seqlens_host : Tensor ``[N + 1]`` on the CPU, or None when it was never read back.
    uniform : bool, True when every sequence has the same length (no cu_seqlens given).
    """

    num_seqs: int
    num_chunks: int
    chunk_size: int
    cu_seqlens: torch.Tensor
    chunk_seq: torch.Tensor
    chunk_local: torch.Tensor
    seq_chunk_start: torch.Tensor
    cu_seqlens_host: torch.Tensor | None
    uniform: bool

    def seq_bounds(self, n: int) -> tuple[int, int]:
        """Host-side ``(bos, eos)`` token offsets of sequence ``n`` (needs the host copy)."""
        if self.cu_seqlens_host is None:
            raise RuntimeError("seq_bounds needs cu_seqlens on the host; none was read back")
        return int(self.cu_seqlens_host[n]), int(self.cu_seqlens_host[n + 1])


def _chunk_counts(lengths: torch.Tensor, chunk_size: int) -> torch.Tensor:
    return torch.div(lengths + (chunk_size - 1), chunk_size, rounding_mode="floor")


#: Uniform-batch tables kept by :func:`_uniform_table` (a server sees few (B, T) shapes).
UNIFORM_TABLES = 64


@functools.lru_cache(maxsize=UNIFORM_TABLES)
def _uniform_table(B: int, T: int, chunk_size: int, device: torch.device) -> ChunkTable:
    """The tables of ``B`` sequences of ``T`` tokens, built once per (B, T, device).

    They depend on nothing else and no kernel writes them, so every call of that shape
    shares one copy: building them costs seven small device launches, a noticeable part
    of a short call's host time. Built on the stream current at the first such call.
    """
    nt_per_seq = (T + chunk_size - 1) // chunk_size
    num_chunks = B * nt_per_seq
    cu = torch.arange(0, B + 1, device=device, dtype=torch.int32) * T
    flat = torch.arange(num_chunks, device=device, dtype=torch.int32)
    return ChunkTable(
        num_seqs=B,
        num_chunks=num_chunks,
        chunk_size=chunk_size,
        cu_seqlens=cu,
        chunk_seq=torch.div(flat, max(nt_per_seq, 1), rounding_mode="floor"),
        chunk_local=flat % max(nt_per_seq, 1),
        seq_chunk_start=torch.arange(0, B + 1, device=device, dtype=torch.int32) * nt_per_seq,
        cu_seqlens_host=torch.arange(0, B + 1, dtype=torch.int64) * T,
        uniform=True,
    )


def build_chunk_table(
    B: int,
    T: int,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_host: torch.Tensor | None,
    chunk_size: int,
    device: torch.device,
) -> ChunkTable:
    """Build the tables for ``B`` rows of ``T`` tokens, or for the packed ``cu_seqlens``.

    Parameters
    ----------
    cu_seqlens : Tensor ``[N + 1]`` on ``device`` (validated), or None for a uniform batch.
    cu_seqlens_host : the same values on the CPU; required with ``cu_seqlens``. Only its
        sum of chunk counts is taken from the host (to size the tables); the tables
        themselves are computed on the device from ``cu_seqlens``, so building them never
        waits for the device.
    """
    if cu_seqlens is None:
        device = torch.device(device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Under CUDA-graph capture the tables would only be filled by a replay (and live
            # in the graph's pool): build them per call, uncached.
            return _uniform_table.__wrapped__(B, T, chunk_size, device)
        return _uniform_table(B, T, chunk_size, device)

    if cu_seqlens_host is None:
        raise ValueError("build_chunk_table: cu_seqlens needs its host copy")
    num_seqs = cu_seqlens.numel() - 1
    host_counts = _chunk_counts(cu_seqlens_host[1:].long() - cu_seqlens_host[:-1].long(), chunk_size)
    num_chunks = int(host_counts.sum())

    cu = cu_seqlens.to(torch.int32)
    counts = _chunk_counts(cu[1:] - cu[:-1], chunk_size)
    seq_chunk_start = torch.zeros(num_seqs + 1, device=device, dtype=torch.int32)
    torch.cumsum(counts, 0, out=seq_chunk_start[1:])
    # output_size keeps repeat_interleave from reading the total back from the device.
    chunk_seq = torch.repeat_interleave(
        torch.arange(num_seqs, device=device, dtype=torch.int32), counts, output_size=num_chunks
    )
    chunk_local = torch.arange(num_chunks, device=device, dtype=torch.int32) - seq_chunk_start[chunk_seq.long()]
    return ChunkTable(
        num_seqs=num_seqs,
        num_chunks=num_chunks,
        chunk_size=chunk_size,
        cu_seqlens=cu,
        chunk_seq=chunk_seq.to(torch.int32),
        chunk_local=chunk_local.to(torch.int32),
        seq_chunk_start=seq_chunk_start,
        cu_seqlens_host=cu_seqlens_host,
        uniform=False,
    )
