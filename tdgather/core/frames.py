"""The data model shared by every stage: `Frames` and `Layout`.

A frame's value is a tensor, a nested dict / TensorDict / tensorclass of
tensors, or such a tree with plain JSON values (str, int, float, bool, None)
among its leaves. Its `Layout` is the structure, dtypes, per-frame shapes (one
`Leaf` each tensor leaf), and the per-frame batch dims of a TensorDict whose
batch size has dims past the frames', ``[B, 3]``. `tdgather.core.flatten`
turns a value into its layout and leaves; `tdgather.core.rebuild` turns leaves
back into a value.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import tensorclass

from .dtypes import dtype_from_name, dtype_name

__all__ = [
    "Frames",
    "Layout",
    "Leaf",
    "Path",
    "RaggedSpec",
]

Path = tuple[str, ...]
RaggedSpec = bool | frozenset[str]  # the leaves named ragged by the caller (dotted paths), or True: all


@tensorclass
class Frames:
    """The frames of one filename, ordered by ``frame_idx``.

    Attributes:
        frame_idx: LongTensor ``[T]``, strictly increasing.
        frames: ``Tensor[T, ...]``, or a TensorDict / tensorclass with batch size ``[T]`` (``[T, 3]``
            where each frame was given with batch dims ``[3]``). A ragged leaf (its first dim
            differs per frame) is a jagged nested tensor ``[T, j, ...]``.
    """

    frame_idx: torch.Tensor
    frames: Any

    @classmethod
    def _of(cls, frame_idx: torch.Tensor, frames: Any) -> Frames:
        """``Frames(frame_idx=frame_idx, frames=frames, batch_size=[T])``, built without its checks where they hold.

        The constructor checks each field against the batch size (about 10 us, as much as building a
        small frame); here ``frame_idx`` is ``[T]`` and ``frames``' leading dim (a tensor's shape, a
        TensorDict's or tensorclass's batch size) ``T``, checked once, and the fields are stored as
        the constructor stores them. Otherwise the constructor builds it (and raises as it does).
        """
        from tensordict import TensorDict

        size = frame_idx.shape[:1]
        shape = frames.shape if isinstance(frames, torch.Tensor) else getattr(frames, "batch_size", None)
        new = getattr(TensorDict, "_new_unsafe", None)
        if new is None or frame_idx.dim() != 1 or shape is None or shape[:1] != size:
            return cls(frame_idx=frame_idx, frames=frames, batch_size=list(size))
        try:
            out = cls._from_tensordict(new({"frame_idx": frame_idx, "frames": frames}, batch_size=size))
        except (TypeError, AttributeError):  # a tensordict whose private constructors changed
            return cls(frame_idx=frame_idx, frames=frames, batch_size=list(size))
        object.__setattr__(out, "_is_initialized", True)  # as the constructor leaves it
        return out

    def at(self, frame_idx: Any) -> Frames:
        """The frame whose ``frame_idx`` is this one (``clip[i]`` is the i-th row, another frame when indexes skip).

        >>> clip = Frames(frame_idx=torch.tensor([0, 5, 10]), frames=torch.arange(3.0), batch_size=[3])
        >>> clip.at(5).frames, clip[1].frames
        (tensor(1.), tensor(1.))

        Raises:
            KeyError: no frame has that index (the message gives the range held).
            TypeError: ``frame_idx`` is not an integer (a float is never truncated).
        """
        try:
            if isinstance(frame_idx, bool):
                raise TypeError
            want = operator.index(frame_idx)
        except TypeError:
            raise TypeError(f"frame_idx: expected an integer, got {type(frame_idx).__name__} {frame_idx!r}") from None
        row = -1
        if -(2**63) <= want < 2**63:  # else no int64 frame index can be it
            row = int(torch.searchsorted(self.frame_idx, torch.tensor(want, dtype=self.frame_idx.dtype)))
        if not 0 <= row < self.frame_idx.numel() or int(self.frame_idx[row]) != want:
            held = self.frame_idx.numel()
            span = f"{int(self.frame_idx[0])}..{int(self.frame_idx[-1])}" if held else "none"
            raise KeyError(f"frame_idx {want}: no such frame here ({held} frames, frame_idx {span})")
        return self[row]


@dataclass(frozen=True)
class Leaf:
    """One tensor leaf of a frame: where it sits, its dtype and its per-frame shape.

    A ragged leaf has ``N_i`` rows in frame ``i``; ``shape`` is then the shape of one row.
    """

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    ragged: bool = False

    @property
    def row_nbytes(self) -> int:
        """Bytes of one frame (a fixed leaf) or of one row (a ragged leaf)."""
        return math.prod(self.shape) * self.dtype.itemsize

    def dims(self) -> str:
        """The per-frame shape as messages show it: ``[3, 4]``, or ``[*, 4]`` when ragged."""
        return "[" + ", ".join(["*"] * self.ragged + [str(d) for d in self.shape]) + "]"


@dataclass(frozen=True)
class Layout:
    """The structure of one frame; frames of one filename must share it.

    Attributes:
        kind: ``"tensor"`` for a plain tensor, ``"tree"`` for a dict, TensorDict or tensorclass.
        cls: ``"module:qualname"`` of a tensorclass, else None.
        leaves: the tensor leaves, sorted by path.
        nontensor: the paths of JSON leaves, sorted.
        batch_dims: a TensorDict's or tensorclass's batch dims in one frame (``(3,)`` for a batch
            of batch size ``[B, 3]``), which every leaf's shape starts with; ``()`` for a plain
            dict, and for a tree with a ragged leaf (whose rows change per frame: the dims are
            dropped, here, wherever a leaf is made ragged).
    """

    kind: str
    cls: str | None
    leaves: tuple[Leaf, ...]
    nontensor: tuple[Path, ...] = ()
    batch_dims: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.batch_dims and self.ragged:  # e.g. `tdgather.core.promote.promote` made a leaf ragged
            object.__setattr__(self, "batch_dims", ())

    def describe(self) -> str:
        """Return a short human description, as used in error messages.

        >>> Layout("tensor", None, (Leaf((), torch.float32, (3, 4)),)).describe()
        'float32[3, 4]'
        >>> Layout("tree", None, (Leaf(("boxes",), torch.float32, (4,), ragged=True),)).describe()
        '{boxes: float32[*, 4]}'
        >>> Layout("tree", None, (Leaf(("logits",), torch.float32, (3, 10)),), batch_dims=(3,)).describe()
        '{logits: float32[3, 10]} with batch dims [3]'
        """
        if self.kind == "tensor":
            leaf = self.leaves[0]
            return f"{dtype_name(leaf.dtype)}{leaf.dims()}"
        parts = [f"{'.'.join(leaf.path)}: {dtype_name(leaf.dtype)}{leaf.dims()}" for leaf in self.leaves]
        parts += [f"{'.'.join(p)}: json" for p in self.nontensor]
        name = self.cls.rsplit(":", 1)[-1] if self.cls else ""
        dims = f" with batch dims {list(self.batch_dims)}" if self.batch_dims else ""
        return f"{name}{{{', '.join(parts)}}}{dims}"

    def to_json(self) -> dict:
        """The JSON form used in wire headers, shard metadata and the index.

        ``batch_dims`` is there only when it has dims: a layout without is written as before it existed.
        """
        return {
            "kind": self.kind,
            "cls": self.cls,
            "leaves": [
                {"path": list(x.path), "dtype": dtype_name(x.dtype), "shape": list(x.shape)}
                | ({"ragged": True} if x.ragged else {})
                for x in self.leaves
            ],
            "json": [list(p) for p in self.nontensor],
        } | ({"batch_dims": list(self.batch_dims)} if self.batch_dims else {})

    @staticmethod
    def from_json(obj: dict) -> Layout:
        """Inverse of `to_json` for trusted input (the receive path validates first).

        >>> lay = Layout("tensor", None, (Leaf((), torch.bool, (2,)),))
        >>> Layout.from_json(lay.to_json()) == lay
        True
        >>> crops = Layout("tree", None, (Leaf(("x",), torch.float32, (3, 4)),), batch_dims=(3,))
        >>> crops.to_json()["batch_dims"], Layout.from_json(crops.to_json()) == crops
        ([3], True)
        """
        leaves = tuple(
            Leaf(tuple(x["path"]), dtype_from_name(x["dtype"]), tuple(x["shape"]), bool(x.get("ragged")))
            for x in obj["leaves"]
        )
        nontensor = tuple(tuple(p) for p in obj["json"])
        return Layout(obj["kind"], obj["cls"], leaves, nontensor, tuple(obj.get("batch_dims", ())))

    @functools.cached_property
    def frame_nbytes(self) -> int:
        """Bytes of tensor data in one frame, ragged leaves not counted (their size varies)."""
        return sum(leaf.row_nbytes for leaf in self.leaves if not leaf.ragged)

    @functools.cached_property
    def ragged(self) -> bool:
        """Whether a leaf is ragged."""
        return any(leaf.ragged for leaf in self.leaves)
