"""Stage 2a, pack: a store as one data message and its pieces, without copying large batches.

The data message carries the frame index (per layout group: frame_idx, the filename of each
row as (file id, row count) runs, and each ragged leaf's rows per frame) in the order the store
holds the rows. Every tensor leaf then follows as pieces, rows in that same order (a ragged
leaf's values: its frames' rows back to back, no padding):

- a batch of at least `PIECE_MIN` bytes goes on the wire as it is (cut into pieces of at most
  `PIECE_MAX` bytes, whole rows), with no copy;
- smaller batches are joined into pieces of about `PIECE_TARGET` bytes, through a reused
  buffer of the sender (`tdgather.comm.protocol.send_frames`).

A piece is two gloo messages (its prelude, then its bytes), and gloo sends each only once the
receiver has posted for it: a round trip each. Measured on 2 cores (``benchmarks.suite``, mixed
workload), joining batches under 1 MiB instead of 256 KiB made `gather` 1.1-1.5x faster; a
batch of 1 MiB or more still goes uncopied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.dtypes import dtype_name
from ..core.framestore import FrameStore
from ..core.part import Part
from .wire import ALIGN, index_offsets

__all__ = ["PIECE_MAX", "PIECE_MIN", "PIECE_TARGET", "Packed", "pack"]

PIECE_MIN = 1 << 20
PIECE_TARGET = 4 << 20
PIECE_MAX = 8 << 20


@dataclass
class Packed:
    """A store ready to send: the data message's header and payload, and the pieces after it."""

    header: dict
    index: torch.Tensor | None  # uint8: the payload of the data message
    pieces: list[list[torch.Tensor]]  # each piece: batches' rows sent as one message (joined when several)
    frames: int
    parts: list[Part] = field(default_factory=list)  # the store's parts, the rows in the pieces' order


def pack(store: FrameStore) -> Packed:
    """Describe ``store`` as a data message and its pieces (batches are referenced, not copied)."""
    groups, index, pieces, specs = [], [], [], []
    parts = store.parts(0)
    for part in parts:  # the frame index joined once; the batches as they are held
        layout, ids, idx = part.layout, part.file_ids, part.frame_idx
        run_ids, run_rows = torch.unique_consecutive(ids, return_counts=True)
        fits = bool(idx.min() >= -(2**31)) and bool(idx.max() < 2**31)
        index_dtype = torch.int32 if fits else torch.int64
        cuts, elems, lengths = [], [], []
        for j, leaf in enumerate(layout.leaves):
            columns = [c[j] for c in part.chunks]  # a ragged leaf's: its values
            if leaf.ragged:
                lengths.append(part.lengths[j])
            counts, leaf_pieces = _cut(columns, leaf.row_nbytes)
            cuts.append(counts)
            elems.append(sum(t.shape[0] for t in columns))
            pieces += leaf_pieces
        json = part.json
        groups.append(
            {
                "layout": layout.to_json(),
                "rows": idx.numel(),
                "index": dtype_name(index_dtype),
                "runs": run_ids.numel(),
                "json": json,
                "pieces": cuts,
                "elems": elems,
            }
        )
        index.append((idx.to(index_dtype), torch.stack([run_ids, run_rows], dim=1), lengths))
        specs.append((idx.numel(), index_dtype.itemsize, run_ids.numel(), len(lengths)))
    payload = None
    if specs:
        offsets = index_offsets(specs)
        payload = torch.zeros(offsets[-1], dtype=torch.uint8)
        for k, (idx, runs, lengths) in enumerate(index):
            at = offsets[3 * k + 2]
            places = [(offsets[3 * k], idx), (offsets[3 * k + 1], runs)]
            for n in lengths:
                places.append((at, n))
                at += -(-n.numel() * 8 // ALIGN) * ALIGN
            for start, t in places:
                payload[start : start + t.numel() * t.element_size()].view(t.dtype).copy_(t.reshape(-1))
    header = {"files": store.names, "groups": groups}
    return Packed(header, payload, pieces, len(store), parts)


def _cut(tensors: list[torch.Tensor], row_bytes: int) -> tuple[list[int], list[list[torch.Tensor]]]:
    """Cut one leaf's batches into pieces: row counts, and the tensors of each piece."""
    counts: list[int] = []
    pieces: list[list[torch.Tensor]] = []
    if not row_bytes:
        return counts, pieces
    bundle: list[torch.Tensor] = []
    rows = 0

    def flush() -> None:
        nonlocal bundle, rows
        if bundle:
            counts.append(rows)
            pieces.append(bundle)
            bundle, rows = [], 0

    max_rows = max(1, PIECE_MAX // row_bytes)
    for t in tensors:
        n = t.shape[0]
        if n * row_bytes >= PIECE_MIN:
            flush()
            for start in range(0, n, max_rows):
                counts.append(min(max_rows, n - start))
                pieces.append([t[start : start + max_rows]])
        elif n:
            bundle.append(t)
            rows += n
            if rows * row_bytes >= PIECE_TARGET:
                flush()
    flush()
    return counts, pieces
