"""Stage 1, the per-rank frame store: predictions in, groups of batches out (by layout).

Frames are grouped by `Layout` (structure, dtypes, per-frame shapes), so a
group is a variable-length stack of same-shaped frames: it needs no padding.
Filenames are interned to ids.

What the store keeps of a batch given to `FrameStore.add`:

- CUDA tensors are copied to the host once, asynchronously, into pinned memory;
- CPU tensors are copied (``copy=True``, the default), because inference loops often
  reuse their output buffers, and ``inference_mode`` tensors carry no version counter
  that could tell; with ``copy=False`` they are kept by reference, and the caller must
  not modify them until they are sent;
- either way, a view of a much larger storage (``out[:, :2]``) is compacted, so the
  store holds, and the memory budget counts, only the frames' own bytes;
- conjugate and negative views are resolved, so the bits sent are the values seen.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import ShapeMismatchError, UnsupportedValueError
from .frames import Layout, flatten
from .plan import Part

__all__ = ["FrameStore", "as_store"]


@dataclass
class _Chunk:
    file_ids: torch.Tensor  # int64 [B]
    frame_idx: torch.Tensor  # int64 [B]
    tensors: list[torch.Tensor]  # [B, *leaf.shape], on the CPU
    json: list[list]  # B values per JSON leaf


class _Bucket:
    """Frames of one layout collected by `FrameStore.update`, before they are stacked."""

    __slots__ = ("idx", "json", "layout", "leaves", "names")

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.names: list[str] = []
        self.idx: list = []
        self.leaves: list[list] = [[] for _ in layout.leaves]
        self.json: list[list] = [[] for _ in layout.nontensor]


def _this_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class FrameStore:
    """The frames one rank holds, before they are sent.

    Args:
        copy: copy CPU tensors given to `add` (default), so the loop may reuse its output
            buffers; with False they are kept by reference and must not change until sent.

    Example:
        >>> store = FrameStore()
        >>> store.add(["a.mp4", "a.mp4"], [1, 0], torch.zeros(2, 3))
        >>> store.update({"b.mp4": (0, torch.ones(3))})
        >>> len(store), store.nbytes
        (3, 36)
    """

    def __init__(self, copy: bool = True) -> None:
        self.copy = copy
        self._ids: dict[str, int] = {}
        self._names: list[str] = []
        self._file_layout: list[Layout] = []
        self._layouts: dict[Layout, Layout] = {}
        self._chunks: dict[Layout, list[_Chunk]] = {}
        self._copies: list = []  # CUDA events of pending device-to-host copies
        self.num_frames = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return self.num_frames

    def add(self, filenames: str | Sequence[str], frame_idx: torch.Tensor | Sequence[int], frames: Any) -> None:
        """Add a batch of B frames (B may be 0).

        Args:
            filenames: B names (a list or tuple of str, as a DataLoader collates them), or one
                name for all B frames.
            frame_idx: B integers: an integer tensor or array, or a list of ints, numpy integers
                or one-element integer tensors. Floats and bools are refused, never truncated.
            frames: ``Tensor[B, ...]``, or a dict / TensorDict / tensorclass with batch dim B.
        """
        idx = _as_index(frame_idx, "add() frame_idx")
        count = idx.numel()
        names = [filenames] * count if isinstance(filenames, str) else list(filenames)
        if len(names) != count:
            raise ValueError(
                f"add(): got {len(names)} filenames and {count} frame indices; expected one filename and one "
                "frame_idx per frame (and frames with that batch dimension)"
            )
        layout, tensors, json = flatten(frames, count, "add() frames")
        self._append(names, idx, layout, tensors, json, self.copy)

    def update(self, predictions: Mapping[str, Any]) -> None:
        """Add ``{filename: (frame_idx, value)}`` or ``{filename: [(frame_idx, value), ...]}``."""
        fast: dict[tuple, _Bucket] = {}  # plain tensors by (dtype, shape): no Layout hashed per frame
        other: dict[Layout, _Bucket] = {}
        for name, entry in predictions.items():
            for pair in _pairs(name, entry):
                try:
                    fi, value = pair
                except (TypeError, ValueError):
                    raise _not_a_pair(name, pair) from None
                if type(value) is torch.Tensor and not value.is_nested:
                    bucket = fast.get((value.dtype, value.shape))
                    if bucket is None:
                        layout = flatten(value, None, f"filename {name!r}")[0]
                        bucket = fast[(value.dtype, value.shape)] = _Bucket(layout)
                    bucket.names.append(name)
                    bucket.idx.append(fi)
                    bucket.leaves[0].append(value)
                else:
                    layout, tensors, json = flatten(value, None, f"filename {name!r}")
                    bucket = other.get(layout) or other.setdefault(layout, _Bucket(layout))
                    bucket.names.append(name)
                    bucket.idx.append(fi)
                    for lst, t in zip(bucket.leaves, tensors, strict=True):
                        lst.append(t)
                    for lst, v in zip(bucket.json, json, strict=True):
                        lst.append(v)
        for b in [*fast.values(), *other.values()]:
            idx = _as_index(b.idx, "frame_idx", b.names)
            self._append(b.names, idx, b.layout, [_stack(ts) for ts in b.leaves], b.json, copy=False)  # stacked

    def _append(
        self, names: list[str], idx: torch.Tensor, layout: Layout, tensors: list, json: list, copy: bool
    ) -> None:
        if not idx.numel():
            return
        layout = self._layouts.setdefault(layout, layout)
        for name in dict.fromkeys(names):
            fid = self._ids.get(name)
            if fid is None:
                _check_filename(name)
                self._ids[name] = len(self._names)
                self._names.append(name)
                self._file_layout.append(layout)
            elif self._file_layout[fid] is not layout:
                rank = _this_rank()
                raise ShapeMismatchError(
                    f"filename {name!r}: frames on rank {rank} have {self._file_layout[fid].describe()} "
                    f"and {layout.describe()} (ranks [{rank}]); every frame of a filename must have "
                    "the same structure, shape and dtype"
                )
        ids = self._ids
        file_ids = torch.tensor([ids[n] for n in names], dtype=torch.int64)
        tensors = [self._keep(t.detach(), copy) for t in tensors]
        self._chunks.setdefault(layout, []).append(_Chunk(file_ids, idx, tensors, json))
        self.num_frames += idx.numel()
        self.nbytes += idx.numel() * layout.frame_nbytes

    def _keep(self, t: torch.Tensor, copy: bool) -> torch.Tensor:
        """What the store holds of ``t`` (see the module docstring): a CPU tensor of its own bytes."""
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()  # a new tensor already: no further copy needed
            copy = False
        if t.device.type == "cpu":
            if copy:
                return t.clone(memory_format=torch.contiguous_format)
            if t.untyped_storage().nbytes() > 2 * t.numel() * t.element_size() + 4096:
                return t.clone(memory_format=torch.contiguous_format)  # a view of a larger storage
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(t.device))
        self._copies.append(event)
        return host

    def synchronize(self) -> None:
        """Wait until every device-to-host copy made by `add` has landed."""
        for event in self._copies:
            event.synchronize()
        self._copies.clear()

    @property
    def names(self) -> list[str]:
        """The filenames added so far, in order of first appearance (their ids)."""
        return self._names

    def groups(self) -> list[tuple[Layout, list[_Chunk]]]:
        """The chunks of every layout, in the order added (after every device copy has landed)."""
        self.synchronize()
        return list(self._chunks.items())

    def parts(self, rank: int) -> list[Part]:
        """The frames as one `Part` per layout, viewing the stored batches: no copy."""
        return [
            Part(
                rank,
                layout,
                self._names,
                torch.cat([c.file_ids for c in chunks]),
                torch.cat([c.frame_idx for c in chunks]),
                [[v for c in chunks for v in c.json[j]] for j in range(len(layout.nontensor))],
                [c.tensors for c in chunks],
            )
            for layout, chunks in self.groups()
        ]

    @property
    def num_chunks(self) -> int:
        """Batches held (each ``add`` or ``update`` layout group is one)."""
        return sum(len(c) for c in self._chunks.values())


def as_store(predictions: FrameStore | Mapping[str, Any]) -> FrameStore:
    """Return ``predictions`` as a `FrameStore` (a store passes through)."""
    if isinstance(predictions, FrameStore):
        return predictions
    if not isinstance(predictions, Mapping):
        raise UnsupportedValueError(
            "expected a dict {filename: (frame_idx, tensor)}, {filename: [(frame_idx, tensor), ...]} "
            f"or a tdgather.FrameStore, got {type(predictions).__name__}"
        )
    store = FrameStore()
    store.update(predictions)
    return store


def _pairs(name: str, entry: Any) -> Iterable[Any]:
    if isinstance(entry, tuple) and len(entry) == 2 and not isinstance(entry[0], tuple | list):
        return (entry,)  # one (frame_idx, value) pair; the index is checked with the others
    if isinstance(entry, list | tuple):
        return entry  # each item is unpacked (and checked) by the caller
    raise _not_a_pair(name, entry)


def _not_a_pair(name: str, got: Any) -> UnsupportedValueError:
    return UnsupportedValueError(
        f"filename {name!r}: expected (frame_idx, value) or a list of (frame_idx, value) pairs, "
        f"got {type(got).__name__}"
    )


def _index_value(x: Any) -> int | None:
    """``x`` as one integer index (an int, a numpy integer, a one-element integer tensor or array), else None."""
    if isinstance(x, bool) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool):
        return None
    if not isinstance(x, torch.Tensor) and hasattr(x, "__array__") and getattr(x, "size", 0) == 1:
        x = torch.as_tensor(x).reshape(())  # a one-element numpy array
        if x.dtype == torch.bool:
            return None
    try:
        return operator.index(x)
    except TypeError:
        return None


_INDEX_RULE = "integers (int, numpy integers, integer tensors or arrays); floats and bools are refused, not truncated"


def _as_index(frame_idx: Any, where: str, names: Sequence[str] | None = None) -> torch.Tensor:
    """The frame indices as int64 ``[B]`` on the CPU, refusing anything that is not integral."""
    if not isinstance(frame_idx, torch.Tensor) and hasattr(frame_idx, "__array__") and hasattr(frame_idx, "dtype"):
        frame_idx = torch.as_tensor(frame_idx)  # a numpy array
    if isinstance(frame_idx, torch.Tensor):
        dt = frame_idx.dtype
        if dt.is_floating_point or dt.is_complex or dt == torch.bool:
            raise UnsupportedValueError(f"{where}: expected {_INDEX_RULE}, got a tensor of dtype {dt}")
        if frame_idx.dim() > 1:
            raise ValueError(f"{where}: expected one index per frame (1-d), got shape {list(frame_idx.shape)}")
        return frame_idx.detach().reshape(-1).to(device="cpu", dtype=torch.int64)
    if isinstance(frame_idx, str | bytes) or not isinstance(frame_idx, Sequence | Iterable):
        raise UnsupportedValueError(f"{where}: expected a sequence of {_INDEX_RULE}, got {type(frame_idx).__name__}")
    values = []
    for k, i in enumerate(frame_idx):
        value = _index_value(i)
        owner = f" (filename {names[k]!r})" if names is not None else f" (position {k})"
        if value is None:
            raise UnsupportedValueError(f"{where}{owner}: expected {_INDEX_RULE}, got {type(i).__name__} {i!r:.40}")
        if not -(2**63) <= value < 2**63:
            raise UnsupportedValueError(f"{where}{owner}: expected an index that fits in int64, got {value}")
        values.append(value)
    return torch.tensor(values, dtype=torch.int64)


def _check_filename(name: Any) -> None:
    """A filename must be a str that UTF-8 can encode (it travels in JSON headers and the index)."""
    if not isinstance(name, str):
        raise UnsupportedValueError(
            f"expected str filenames, got {type(name).__name__} {name!r:.80}; pass the names as a list of str "
            "(a DataLoader's default collate gives one)"
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UnsupportedValueError(
            f"filename {name!r:.200} cannot be encoded as UTF-8 ({e.reason} at position {e.start}); it looks like "
            "os.fsdecode() of a non-UTF-8 name: pass a UTF-8 name, for example name.encode('utf-8', "
            "'surrogateescape').decode('utf-8', 'backslashreplace')"
        ) from None


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    try:
        return torch.stack(tensors)  # on CUDA: one stack there, then one copy to the host
    except RuntimeError:  # frames on several devices
        return torch.stack([t.cpu() for t in tensors])
