"""The forms `FrameStore.add` and `FrameStore.update` take beyond filenames and frame indexes, and their refusals.

- ``ragged=``: True, a dotted key or several (`ragged_spec`);
- ``update``'s ``{filename: (frame_idx, value)}`` or ``{filename: [(frame_idx, value), ...]}``
  (`as_pairs`), its frames collected by layout (`Bucket`; a flat dict of tensors by its keys,
  dtypes and shapes, `tree_key`) and joined into one batch each (`join_frames`);
- a list of frames that differ, split into one batch per filename (`by_filename`);
- a filename whose layout does not fit the one it is held or was saved with (`mismatch`), or
  that has a ragged leaf once every leaf is declared fixed (`declared_fixed`).

Filenames and frame indexes themselves are checked by `tdgather.core.inputs`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ShapeMismatchError, UnsupportedValueError
from .flatten import flatten
from .frames import Layout, RaggedSpec
from .inputs import index_value
from .promote import SAME_LAYOUT, ragged_hint
from .ragged import Ragged

__all__ = [
    "Bucket",
    "as_pairs",
    "by_filename",
    "declared_fixed",
    "frame_label",
    "join_frames",
    "mismatch",
    "not_a_pair",
    "ragged_spec",
    "tree_key",
]


def as_pairs(name: str, entry: Any) -> Iterable[Any]:
    """The ``(frame_idx, value)`` pairs of one entry of `FrameStore.update`'s dict: one pair or a list of them."""
    if isinstance(entry, tuple) and len(entry) == 2 and not isinstance(entry[0], tuple | list):
        return (entry,)  # one (frame_idx, value) pair; the index is checked with the others
    if isinstance(entry, list | tuple):
        return entry  # each item is unpacked (and checked) by the caller
    raise not_a_pair(name, entry)


def frame_label(name: str, frame_idx: Any) -> str:
    """How an error names a frame of `FrameStore.update`'s dict: its filename, and its frame_idx if an integer.

    >>> frame_label("a.mp4", 3), frame_label("a.mp4", [3, 4])
    ("filename 'a.mp4', frame_idx 3", "filename 'a.mp4'")
    """
    on_host = not isinstance(frame_idx, torch.Tensor) or frame_idx.is_cpu  # no device sync for a label
    value = index_value(frame_idx) if on_host else None
    return f"filename {name!r}" if value is None else f"filename {name!r}, frame_idx {value}"


def not_a_pair(name: str, got: Any) -> UnsupportedValueError:
    """The refusal of an entry of `FrameStore.update`'s dict that is not a pair or a list of pairs."""
    return UnsupportedValueError(
        f"filename {name!r}: expected (frame_idx, value) or a list of (frame_idx, value) pairs, "
        f"got {type(got).__name__}"
    )


def ragged_spec(ragged: bool | str | Iterable[str]) -> RaggedSpec:
    """``add(ragged=...)`` as `flatten` takes it: True, or the dotted keys."""
    if ragged is True:
        return True
    names = (ragged,) if isinstance(ragged, str) else tuple(ragged) if isinstance(ragged, Iterable) else (ragged,)
    if not all(isinstance(x, str) for x in names):
        raise TypeError(f"expected ragged=True or dotted keys (str), got {ragged!r:.80}")
    return frozenset(names)


def by_filename(names: list[str], idx: torch.Tensor, frames: Any, ragged: RaggedSpec, error: Exception) -> list[tuple]:
    """A list of frames that differ, as one batch per filename: ``(names, frame_idx, layout, tensors, json)``.

    Frames of different filenames may differ; frames of one filename that do not fit raise ``error``,
    naming the filename and frame_idx.
    """
    k = getattr(error, "frame", None)
    if k is None or not isinstance(frames, list | tuple):
        raise error
    positions: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        positions.setdefault(name, []).append(i)
    if len(positions) == 1:
        raise ShapeMismatchError(f"filename {names[k]!r}, frame_idx {int(idx[k])}: {error}") from None
    out = []
    for name, pos in positions.items():
        try:
            out.append(
                ([name] * len(pos), idx[pos], *flatten([frames[i] for i in pos], len(pos), "add() frames", ragged))
            )
        except ShapeMismatchError as e:
            j = getattr(e, "frame", None)
            if j is None:
                raise
            raise ShapeMismatchError(f"filename {name!r}, frame_idx {int(idx[pos[j]])}: {e}") from None
    return out


class Bucket:
    """Frames of one layout collected by `FrameStore.update`, before they are joined into a batch.

    Each leaf holds one tensor a frame; ``how`` joins them: ``"stack"`` (every leaf fixed),
    ``"ragged"`` (a plain tensor's rows ``[N_i, ...]``) or ``"rows"`` (each leaf as its layout
    says: a ragged leaf's rows joined, a fixed leaf's frames stacked).
    """

    __slots__ = ("how", "idx", "json", "layout", "leaves", "names")

    def __init__(self, layout: Layout, how: str = "stack") -> None:
        self.layout, self.how = layout, how
        self.names: list[str] = []
        self.idx: list = []
        self.leaves: list[list] = [[] for _ in layout.leaves]
        self.json: list[list] = [[] for _ in layout.nontensor]

    def add(self, name: str, frame_idx: Any, tensors: list, json: list | tuple = ()) -> None:
        """One frame: its filename, frame_idx, a tensor per leaf and a value per JSON leaf (where it has them)."""
        self.names.append(name)
        self.idx.append(frame_idx)
        for values, t in zip(self.leaves, tensors, strict=True):
            values.append(t)
        for values, v in zip(self.json, json, strict=True):
            values.append(v)

    def join(self, j: int) -> str:
        """How leaf ``j``'s frames are joined (`join_frames`)."""
        if self.how != "rows":
            return self.how
        return "ragged" if self.layout.leaves[j].ragged else "stack"


def join_frames(tensors: list, how: str) -> Any:
    """Frames as one batch, as `Bucket` ``how`` says."""
    if tensors and isinstance(tensors[0], Ragged):
        try:
            return Ragged.cat(tensors)  # on CUDA: the values joined there, then one copy to the host
        except RuntimeError:  # frames on several devices: their rows to the host first
            return Ragged.cat([Ragged.from_lengths(v.cpu(), n) for v, n in (r.span() for r in tensors)])
    join = {"stack": torch.stack, "ragged": Ragged.from_list}[how]
    try:
        return join(tensors)  # on CUDA: one stack there, then one copy to the host
    except RuntimeError:  # frames on several devices
        return join([t.cpu() for t in tensors])


def tree_key(value: dict, spec: RaggedSpec) -> tuple[tuple, list[torch.Tensor]] | None:
    """A frame given as a flat dict of plain tensors: its `Bucket` key and its tensors in `flatten`'s order.

    The key holds each key, dtype and shape (of a leaf ``spec`` makes ragged, the shape past the
    first dim), so the frames of one key share one layout and only the first need be flattened
    (and checked). None for any other frame (an empty or nested dict, a key not a str, a value
    not a dense tensor): `flatten` takes it.
    """
    if not value or not all(type(k) is str for k in value):
        return None
    key, tensors = [], []
    for k in sorted(value):
        t = value[k]
        if type(t) is not torch.Tensor or t.layout is not torch.strided or t.is_nested or t.is_meta:
            return None
        ragged = t.dim() > 0 and (spec is True or (bool(spec) and k in spec))
        key.append((k, t.dtype, t.shape[1:] if ragged else t.shape, ragged))
        tensors.append(t)
    return tuple(key), tensors


def declared_fixed(name: str, layout: Layout) -> ShapeMismatchError:
    """The refusal of a filename with a ragged leaf after ``ragged=False`` declared every leaf fixed."""
    leaves = [".".join(x.path) or "<tensor>" for x in layout.leaves if x.ragged]
    return ShapeMismatchError(
        f"filename {name!r} on rank {_this_rank()}: every leaf is declared fixed (ragged=False), but {leaves} "
        f"vary in their first dim ({layout.describe()}); drop ragged=False to store them as ragged leaves"
    )


def mismatch(name: str, first: Layout, second: Layout, saved: bool = False) -> ShapeMismatchError:
    """The refusal of a filename held (or ``saved`` by the run resumed) with ``first``, given with ``second``."""
    rank = _this_rank()
    if saved:
        return ShapeMismatchError(
            f"filename {name!r} on rank {rank}: the run being resumed saved its frames with {first.describe()}, "
            f"these have {second.describe()}; a resumed run must give each filename the layout it was saved "
            "with (the same model and outputs), or start over with resume=False, overwrite=True"
            f"{ragged_hint(first, second)}"
        )
    return ShapeMismatchError(
        f"filename {name!r}: frames on rank {rank} have {first.describe()} and {second.describe()} "
        f"(ranks [{rank}]); {SAME_LAYOUT}"
        f"{ragged_hint(first, second)}"
    )


def _this_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
