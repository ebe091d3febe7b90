"""Ragged leaves: a leaf whose first dimension changes from frame to frame (boxes ``[N_i, 4]``).

Everywhere in tdgather (the store, the wire, rank dst's buffers, the shards) a ragged leaf of
T frames is two plain tensors and no padding:

- ``values``: every frame's rows back to back, ``[sum N_i, *shape]``;
- ``offsets``: int64 ``[T + 1]``, frame ``i`` is ``values[offsets[i] : offsets[i + 1]]``.

That is exactly what a jagged nested tensor (``torch.nested``, ``layout=torch.jagged``) holds,
so users give and get those (`Ragged.to_nested` is a view), and `padded` pads one on request.
`Ragged` is the internal column: row slices are views, `index_select` gathers whole frames.

Devices: a `Ragged` keeps its ``offsets`` on the CPU (the store reads them to slice and count rows),
while its ``values`` may sit on a GPU until the store copies them to the host (once, pinned). torch
wants a jagged nested tensor's offsets on its values' device, so `Ragged.to_nested` puts them there;
every helper here makes its index tensors on the device of the tensor it indexes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ShapeMismatchError
from .rows import scatter_rows

__all__ = ["Ragged", "element_index", "joined", "offsets_of", "padded", "values_of"]


class _FxTracingNotice(logging.Filter):
    """Drops one warning torch logs when a jagged nested tensor is built, and only that one.

    ``torch.nested.nested_tensor_from_jagged`` (which `Ragged.to_nested` and a detector's own code
    call) asks ``torch.fx``'s deprecated ``is_fx_tracing()``, which logs "is_fx_tracing will return
    true for both fx.symbolic_trace and torch.export..." once per process: a note to torch's own
    code, shown on every rank of every job that builds a jagged tensor. Nothing in it is for users.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("is_fx_tracing will return true")


logging.getLogger("torch.fx._symbolic_trace").addFilter(_FxTracingNotice())


class Ragged:
    """T frames of one ragged leaf: ``values`` and ``offsets`` (which need not start at 0: a row slice).

    ``values`` is a tensor, or (a Collector's spill, written and dropped) `tdgather.core.merge.Rows`.

    >>> r = Ragged.from_list([torch.ones(2, 4), torch.zeros(0, 4), torch.ones(1, 4)])
    >>> len(r), r.lengths.tolist(), r[1:].lengths.tolist()
    (3, [2, 0, 1], [0, 1])
    """

    __slots__ = ("offsets", "values")

    def __init__(self, values: torch.Tensor, offsets: torch.Tensor) -> None:
        self.values, self.offsets = values, offsets

    @staticmethod
    def from_lengths(values: torch.Tensor, lengths: torch.Tensor) -> Ragged:
        """Frames of ``lengths[i]`` rows each, back to back in ``values``."""
        return Ragged(values, offsets_of(lengths))

    @staticmethod
    def from_list(tensors: Sequence[torch.Tensor]) -> Ragged:
        """One frame per tensor (``[N_i, *shape]``, the same ``shape`` and dtype): their rows joined once."""
        lengths = torch.tensor([t.shape[0] for t in tensors], dtype=torch.int64)
        return Ragged.from_lengths(torch.cat([t.detach() for t in tensors]), lengths)

    @staticmethod
    def from_nested(nt: torch.Tensor, where: str) -> Ragged:
        """A nested tensor ``[B, j, *shape]`` (jagged, or strided), without a copy where it is jagged and packed."""
        if getattr(nt, "_ragged_idx", None) is None:  # not jagged (asking .layout costs a __torch_function__)
            frames = list(nt.unbind())
            rows = {tuple(t.shape[1:]) for t in frames}
            if len(rows) > 1 or any(t.dim() == 0 for t in frames):
                raise ShapeMismatchError(
                    f"{where}: a nested tensor whose frames differ in more than their first dim (frame shapes "
                    f"{sorted({tuple(t.shape) for t in frames})[:4]}); only the first dim of a frame may vary: "
                    "pad or crop the other dims, or split the leaf"
                )
            return Ragged.from_list(frames)
        if nt._ragged_idx != 1:
            raise ValueError(
                f"{where}: expected a nested tensor ragged in dim 1 (each frame's first dim), got one ragged in "
                f"dim {nt._ragged_idx}; transpose it so that the varying dim comes first in each frame"
            )
        if getattr(nt, "_lengths", None) is not None:  # a view with holes: pack it
            nt = nt.contiguous()
        # torch's NestedTensor keeps both as attributes; .values() / .offsets() cost ~30 us each through
        # __torch_function__, more than the rest of an add()
        values = getattr(nt, "_values", None)
        offsets = getattr(nt, "_offsets", None)
        if values is None or offsets is None:
            values, offsets = nt.values(), nt.offsets()
        # on a GPU: the offsets (8 bytes a frame) come to the host now, the values stay until the store
        # copies them once, asynchronously, into pinned memory
        return Ragged(values, offsets.to("cpu", torch.int64))

    @staticmethod
    def cat(items: Sequence[Ragged]) -> Ragged:
        """The frames of ``items``, one after the other, in one new column."""
        spans = [r.span() for r in items]
        return Ragged.from_lengths(torch.cat([s for s, _ in spans]), torch.cat([r.lengths for r in items]))

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @property
    def dtype(self) -> torch.dtype:
        """The values' dtype."""
        return self.values.dtype

    @property
    def shape(self) -> torch.Size:
        """``[frames, *shape of one row]`` (what a tensor leaf's ``shape`` gives per batch)."""
        return torch.Size((len(self), *self.values.shape[1:]))

    @property
    def lengths(self) -> torch.Tensor:
        """int64 ``[T]``: the rows of each frame."""
        return self.offsets.diff()

    @property
    def num_rows(self) -> int:
        """Rows of all the frames together (``sum N_i``)."""
        return self.offsets[-1].item() - self.offsets[0].item()

    @property
    def nbytes(self) -> int:
        """Bytes of the frames' rows."""
        return self.num_rows * math.prod(self.values.shape[1:]) * self.values.dtype.itemsize

    def __getitem__(self, s: slice) -> Ragged:
        lo, hi, step = s.indices(len(self))
        if step != 1:
            raise ValueError("Ragged slices take a step of 1")
        return Ragged(self.values, self.offsets[lo : max(lo, hi) + 1])

    def span(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, lengths)`` of exactly these frames: a view of their rows, nothing before or after."""
        if not len(self):
            return self.values[:0], self.lengths
        lo, hi = int(self.offsets[0]), int(self.offsets[-1])
        return self.values[lo:hi], self.lengths

    def index_select(self, dim: int, rows: torch.Tensor) -> Ragged:
        """Frames ``rows`` (of this slice), copied into a new column."""
        if dim != 0:
            raise ValueError("Ragged frames are selected along dim 0")
        lengths = self.lengths[rows]
        index = element_index(self.offsets[:-1][rows], lengths)
        device = getattr(self.values, "device", index.device)  # (values by reference, `merge.Rows`: on the host)
        values = self.values.index_select(0, index.to(device))
        return Ragged.from_lengths(values, lengths)

    def to_nested(self) -> torch.Tensor:
        """These frames as a jagged nested tensor ``[T, j, *shape]`` (a view of the values).

        The nested tensor's offsets are on the values' device, as torch requires (values on a GPU:
        a copy of ``T + 1`` int64 there; the values are not copied).
        """
        values, lengths = self.span()
        offsets = offsets_of(lengths)
        if offsets.device != values.device:
            offsets = offsets.to(values.device)
        return torch.nested.nested_tensor_from_jagged(values, offsets)


def joined(columns: Sequence[Ragged]) -> list[Ragged]:
    """The same frames in fewer columns: neighbouring row slices of one column joined into one slice.

    A group's per-filename slices (`tdgather.core.plan.Group`) come back as one: the sink then writes
    their values as one view and their offsets with one subtraction, not one per filename.
    """
    out: list[Ragged] = []
    for r in columns:
        last = out[-1] if out else None
        o = r.offsets
        if (
            last is not None
            and last.values is r.values
            and last.offsets.untyped_storage().data_ptr() == o.untyped_storage().data_ptr()
            and last.offsets.storage_offset() + last.offsets.numel() - 1 == o.storage_offset()
            and o.stride() == (1,) == last.offsets.stride()
        ):
            both = torch.empty(0, dtype=o.dtype).set_(
                o.untyped_storage(), last.offsets.storage_offset(), (last.offsets.numel() + o.numel() - 1,)
            )
            out[-1] = Ragged(r.values, both)
        else:
            out.append(r)
    return out


def offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    """int64 ``[T + 1]``: 0, then the running total of ``lengths`` (on the device of ``lengths``)."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def values_of(column: Any) -> torch.Tensor:
    """The tensor a column's rows live in: the tensor itself, or a `Ragged`'s values."""
    return column.values if isinstance(column, Ragged) else column


def element_index(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The rows ``starts[i] .. starts[i] + lengths[i] - 1`` of every frame ``i``, back to back (int64).

    On the device of ``starts`` and ``lengths`` (one device for both; the total is read on the host).

    >>> element_index(torch.tensor([5, 0, 9]), torch.tensor([2, 0, 3])).tolist()
    [5, 6, 9, 10, 11]
    """
    total = int(lengths.sum()) if lengths.numel() else 0
    if not total:
        return torch.empty(0, dtype=torch.int64, device=starts.device)
    before = torch.cumsum(lengths, 0) - lengths
    steps = torch.arange(total, device=starts.device)
    return torch.repeat_interleave(starts - before, lengths, output_size=total) + steps


def padded(x: Any, value: float | bool = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A ragged leaf as ``(padded [T, max N_i, *shape], lengths int64 [T])``, for every dtype tdgather stores.

    ``x`` is a jagged nested tensor (what tdgather returns for a ragged leaf) or a `Ragged`; or a
    plain tensor ``[T, N, ...]``, a leaf whose frames all had N rows, returned as it is with
    lengths N: code that pads a leaf works whether or not its counts happened to differ.
    torch's ``to_padded_tensor`` does the same for the dtypes it implements; this one also pads
    uint64 and the float8 kinds, and returns the lengths.

    >>> nt = torch.nested.nested_tensor_from_jagged(torch.arange(3.0), torch.tensor([0, 2, 2, 3]))
    >>> p, n = padded(nt, value=-1)
    >>> p.tolist(), n.tolist()
    ([[0.0, 1.0], [-1.0, -1.0], [2.0, -1.0]], [2, 0, 1])
    >>> p, n = padded(torch.ones(2, 3, 4))  # every frame had 3 boxes
    >>> p.shape, n.tolist()
    (torch.Size([2, 3, 4]), [3, 3])
    """
    if isinstance(x, torch.Tensor) and not x.is_nested and x.dim() >= 2:
        _check_fill(value, x.dtype)
        return x, torch.full((x.shape[0],), x.shape[1], dtype=torch.int64)
    if not (isinstance(x, Ragged) or (isinstance(x, torch.Tensor) and x.is_nested)):
        got = f"a tensor of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(
            f"padded(): expected a ragged leaf, a jagged nested tensor (as tdgather returns it) or a tensor "
            f"[T, N, ...], got {got}; a list of tensors pads with torch.nn.utils.rnn.pad_sequence"
        )
    r = x if isinstance(x, Ragged) else Ragged.from_nested(x, "padded()")
    values, lengths = r.span()
    _check_fill(value, values.dtype)
    t = lengths.numel()
    width = int(lengths.max()) if t else 0
    out = torch.full((t, width, *values.shape[1:]), value, dtype=values.dtype, device=values.device)
    flat = out.view(t * width, *values.shape[1:])
    starts = torch.arange(t, dtype=torch.int64) * width
    if values.shape[0]:
        scatter_rows(flat, element_index(starts, lengths).to(values.device), values)
    return out, lengths


def _check_fill(value: Any, dtype: torch.dtype) -> None:
    """Refuse a padding value that ``dtype`` cannot hold (torch would wrap it round, or fail deep inside)."""
    number = isinstance(value, (bool, int, float))
    if dtype.is_floating_point or dtype.is_complex:
        ok, want = number, "a number"
    elif dtype == torch.bool:
        ok, want = number and value in (0, 1), "0, 1 or a bool"
    else:
        info = torch.iinfo(dtype)
        ok = number and float(value).is_integer() and info.min <= value <= info.max
        want = f"an integer in [{info.min}, {info.max}]"
    if not ok:
        raise ValueError(f"padded(): value={value!r} does not fit the leaf's {dtype}: expected {want}")
