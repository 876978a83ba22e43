"""Chunk slots: which sequence and which chunk of it each per-chunk program works on.

A call's packed token axis holds ``T_total = B * T`` tokens in ``N`` sequences with offsets
``cu[0..N]`` (a uniform batch is ``N = B`` sequences of ``T`` tokens: ``cu[n] = n * T``, which
is exactly how a contiguous ``[B, T, ...]`` tensor lies in memory, so uniform and varlen
calls take one code path). With ``C = 64`` the chunk length:

* sequence ``n`` owns the *chunk slots* ``[s_n, s_{n+1})`` with ``s_n = cu[n] // C + n``;
* its chunk ``j`` (``0 <= j < ceil(len_n / C)``) is slot ``s_n + j``; the other slots of its
  range are *idle*: the programs launched for them exit at once;
* ``s_{n+1} - s_n = (cu[n] % C + len_n) // C + 1 >= ceil(len_n / C)``, so every chunk has a
  slot, and ``s`` is strictly increasing;
* the slot count ``NS = T_total // C + N`` is known on the host from shapes alone.

A per-chunk program at slot ``c`` finds its sequence by a binary search over ``cu_seqlens``
in the kernel: the largest ``n`` with ``cu[n] // C + n <= c`` (about ``log2(N)`` loads).
Per-chunk buffers (the state at each chunk start) are indexed by slot. So no chunk table
is built per call, grids are sized on the host from ``NS``, and a call that has only a
device ``cu_seqlens`` needs no device-to-host copy at all.

The per-sequence programs of the warp-specialized Gluon kernels and of triton_generic's
state kernel (one per sequence, v-head and V-block) walk the sequences *longest first*:
program position ``p`` takes the ``p``-th sequence by chunk count, most first, ties in
batch order (:func:`walk_order`), found by a bisection over the chunk counts in the
kernel. The scheduler starts programs in id order as SMs free up, so a long sequence late
in a ragged batch would otherwise run on alone after the rest. Batches of one sequence or
more than :data:`LONGEST_FIRST_SEQS` keep batch order.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch


def num_slots(total_tokens: int, num_seqs: int, chunk_size: int) -> int:
    """``NS = T_total // C + N``: the chunk slots of a call (see the module docstring)."""
    return total_tokens // chunk_size + num_seqs


def slot_starts(cu: list[int], chunk_size: int) -> list[int]:
    """``s_n = cu[n] // C + n`` for ``n = 0..N``: sequence ``n``'s first slot (host copy)."""
    return [offset // chunk_size + n for n, offset in enumerate(cu)]


#: Batches of up to this many sequences are walked longest first (the kernels hold the chunk
#: counts in one register vector of this length).
LONGEST_FIRST_SEQS = 256


def walk_order(lengths: list[int], chunk_size: int) -> list[int]:
    """The sequences in the order per-sequence programs walk them (module docstring): host
    copy of the kernels' rule."""
    n = len(lengths)
    if n == 1 or n > LONGEST_FIRST_SEQS:
        return list(range(n))
    chunks = [-(-length // chunk_size) for length in lengths]
    return sorted(range(n), key=lambda i: (-chunks[i], i))


@dataclass(frozen=True)
class ChunkTable:
    """How a call's tokens form sequences and chunk slots.

    Attributes
    ----------
    num_seqs : int, ``N``.
    num_slots : int, ``NS = B * T // C + N``, the chunk slots per-chunk kernels launch over.
    chunk_size : int, ``C``.
    cu_seqlens : int32/int64 Tensor ``[N + 1]`` on the call's device: token offsets of the
        sequences in the packed axis (the caller's tensor for a varlen call).
    cu_seqlens_host : int Tensor ``[N + 1]`` on the CPU, or None when the caller gave no host
        copy (nothing is read back to make one).
    uniform : bool, True when every sequence has the same length (no cu_seqlens given).
    longest : int or None, the longest sequence's length as the builder read it from the
        host offsets (a uniform batch's ``T``; the contract's check of ``cu_seqlens_cpu``),
        else None. Read it through :meth:`longest_length`.
    aligned : bool or None, whether every offset is a multiple of ``C`` (no sequence ends
        inside a chunk), as the builder read it, else None. Read it through
        :meth:`chunk_aligned`.
    nonempty : int or None, how many sequences hold tokens, as the builder counted them,
        else None. Read it through :meth:`nonempty_seqs`.
    """

    num_seqs: int
    num_slots: int
    chunk_size: int
    cu_seqlens: torch.Tensor
    cu_seqlens_host: torch.Tensor | None
    uniform: bool
    longest: int | None = None
    aligned: bool | None = None
    nonempty: int | None = None

    def longest_length(self) -> int | None:
        """The longest sequence's length, or None when the host has no copy of the offsets."""
        if self.longest is not None or self.cu_seqlens_host is None:
            return self.longest
        offsets = self.cu_seqlens_host.tolist()  # a Python list: this runs on a call's host path
        return max((b - a for a, b in zip(offsets, offsets[1:])), default=0)

    def chunk_aligned(self) -> bool | None:
        """Whether every offset is a multiple of ``chunk_size``, or None when the host has no
        copy of the offsets."""
        if self.aligned is not None or self.cu_seqlens_host is None:
            return self.aligned
        return not any(offset % self.chunk_size for offset in self.cu_seqlens_host.tolist())

    def nonempty_seqs(self) -> int | None:
        """How many sequences hold tokens, or None when the host has no copy of the offsets."""
        if self.nonempty is not None or self.cu_seqlens_host is None:
            return self.nonempty
        offsets = self.cu_seqlens_host.tolist()
        return sum(b > a for a, b in zip(offsets, offsets[1:]))

    def seq_bounds(self, n: int) -> tuple[int, int]:
        """Host-side ``(bos, eos)`` token offsets of sequence ``n`` (needs the host copy)."""
        if self.cu_seqlens_host is None:
            raise RuntimeError("seq_bounds needs cu_seqlens on the host; the call gave no host copy")
        return int(self.cu_seqlens_host[n]), int(self.cu_seqlens_host[n + 1])


#: Uniform-batch tables kept by :func:`_uniform_table` (a server sees few (B, T) shapes).
UNIFORM_TABLES = 64


@functools.lru_cache(maxsize=UNIFORM_TABLES)
def _uniform_table(B: int, T: int, chunk_size: int, device: torch.device) -> ChunkTable:
    """The table of ``B`` sequences of ``T`` tokens, built once per (B, T, device).

    It depends on nothing else and no kernel writes it, so every call of that shape shares
    one device copy of the offsets (written on the stream current at the first call). They
    come from a device arange, not a host-to-device copy: the copy would be illegal from
    pageable memory under CUDA-graph capture, where :func:`build_chunk_table` builds the
    table per call through this same function.
    """
    host = torch.arange(0, B + 1, dtype=torch.int64) * T
    return ChunkTable(num_seqs=B, num_slots=num_slots(B * T, B, chunk_size), chunk_size=chunk_size,
                      cu_seqlens=torch.arange(0, B + 1, device=device, dtype=torch.int32) * T,
                      cu_seqlens_host=host, uniform=True, longest=T, aligned=T % chunk_size == 0)


def kept_uniform_offsets(B: int, T: int, chunk_size: int, device: torch.device) -> torch.Tensor | None:
    """The device offsets of ``B`` sequences of ``T`` tokens that :func:`build_chunk_table`
    keeps for every call of that shape, or None under CUDA-graph capture (where it builds
    them per call)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    return _uniform_table(B, T, chunk_size, device).cu_seqlens


def build_chunk_table(
    B: int,
    T: int,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_host: torch.Tensor | None,
    chunk_size: int,
    device: torch.device,
    *,
    longest: int | None = None,
    aligned: bool | None = None,
) -> ChunkTable:
    """The table of ``B`` rows of ``T`` tokens, or of the packed ``cu_seqlens``.

    Parameters
    ----------
    cu_seqlens : int32/int64 Tensor ``[N + 1]`` on ``device`` (validated), or None for a
        uniform batch. Kept as it is: kernels read either index dtype.
    cu_seqlens_host : the same values on the CPU, or None. Not needed: the slot count
        depends only on ``B * T`` and ``N``.
    longest, aligned : the longest sequence's length and whether every offset is a
        multiple of ``chunk_size``, when the caller has read them from the host copy (the
        contract's check does), kept on the table for the planners, which read them on every
        call; else the table reads the host copy when asked.

    Nothing here launches device work for a varlen call, nor reads device memory.
    """
    if cu_seqlens is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Under CUDA-graph capture the offsets would only be filled by a replay (and
            # live in the graph's pool): build them per call, uncached.
            return _uniform_table.__wrapped__(B, T, chunk_size, device)
        return _uniform_table(B, T, chunk_size, device)
    N = cu_seqlens.shape[0] - 1
    if cu_seqlens_host is None:
        longest = aligned = None
    return new_table(num_seqs=N, num_slots=num_slots(B * T, N, chunk_size), chunk_size=chunk_size,
                     cu_seqlens=cu_seqlens, cu_seqlens_host=cu_seqlens_host, uniform=False, longest=longest,
                     aligned=aligned, nonempty=None)


_TABLE_FIELDS = frozenset(f.name for f in dataclasses.fields(ChunkTable))


def new_table(**fields) -> ChunkTable:
    """``ChunkTable(**fields)`` with every field given, without the frozen dataclass's
    per-field ``object.__setattr__`` (~2 µs of a call's host path); the object is the same."""
    if fields.keys() != _TABLE_FIELDS:
        raise TypeError(f"new_table: expected the fields {sorted(_TABLE_FIELDS)}, got {sorted(fields)}")
    table = object.__new__(ChunkTable)
    table.__dict__.update(fields)
    return table
