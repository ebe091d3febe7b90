"""What `FrameStore.add` takes as filenames and frame indexes, checked: every refusal says what to pass.

Frame indexes are integers (int, numpy integers, integer tensors or arrays), never truncated from
floats or bools; filenames are str that UTF-8 can encode (they travel in JSON headers and the index).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..errors import UnsupportedValueError

__all__ = ["as_index", "check_filenames", "index_value"]


def index_value(x: Any) -> int | None:
    """``x`` as one integer index (an int, a numpy integer, a one-element integer tensor or array), else None."""
    if isinstance(x, bool) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool):
        return None
    if not isinstance(x, torch.Tensor) and hasattr(x, "__array__") and getattr(x, "size", 0) == 1:
        if getattr(getattr(x, "dtype", None), "kind", "") == "b":  # a numpy bool
            return None
        try:
            return operator.index(x)  # a numpy integer (uint64 too) or 0-d integer array
        except TypeError:
            x = torch.as_tensor(x).reshape(())  # a one-element array
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not (x.dtype.is_floating_point or x.dtype.is_complex):
        return int(x.reshape(()).item())  # exact, also a uint64 past int64 (refused by range, not wrapped)
    try:
        return operator.index(x)
    except TypeError:
        return None


_INDEX_RULE = "integers (int, numpy integers, integer tensors or arrays); floats and bools are refused, not truncated"


def as_index(frame_idx: Any, where: str, names: Sequence[str] | None = None) -> torch.Tensor:
    """The frame indices as int64 ``[B]`` on the CPU, refusing anything that is not integral."""
    if not isinstance(frame_idx, torch.Tensor) and hasattr(frame_idx, "__array__") and hasattr(frame_idx, "dtype"):
        frame_idx = torch.as_tensor(frame_idx)  # a numpy array
    if isinstance(frame_idx, torch.Tensor):
        dt = frame_idx.dtype
        if dt.is_floating_point or dt.is_complex or dt == torch.bool:
            raise UnsupportedValueError(f"{where}: expected {_INDEX_RULE}, got a tensor of dtype {dt}")
        if frame_idx.dim() > 1:
            raise ValueError(f"{where}: expected one index per frame (1-d), got shape {list(frame_idx.shape)}")
        frame_idx = frame_idx.detach().reshape(-1).to(device="cpu")
        past = (frame_idx.view(torch.int64) < 0).nonzero() if dt == torch.uint64 else ()  # 2**63 and up would wrap
        if len(past):
            k = int(past[0])
            owner = f" (filename {names[k]!r})" if names is not None else f" (position {k})"
            big = int(frame_idx[k].item())
            raise UnsupportedValueError(f"{where}{owner}: expected an index that fits in int64, got {big}")
        return frame_idx.to(dtype=torch.int64)
    if isinstance(frame_idx, str | bytes) or not isinstance(frame_idx, Sequence | Iterable):
        raise UnsupportedValueError(f"{where}: expected a sequence of {_INDEX_RULE}, got {type(frame_idx).__name__}")
    if type(frame_idx) in (list, tuple) and set(map(type, frame_idx)) == {int}:  # plain ints: one C-level pass
        try:
            return torch.tensor(frame_idx, dtype=torch.int64)
        except (OverflowError, RuntimeError, ValueError):  # one past int64: named below
            pass
    values = []
    for k, i in enumerate(frame_idx):
        value = index_value(i)
        owner = f" (filename {names[k]!r})" if names is not None else f" (position {k})"
        if value is None and len(getattr(i, "shape", ())) and math.prod(i.shape) != 1:
            raise UnsupportedValueError(
                f"{where}{owner}: expected one integer a frame, got a {type(i).__name__} of shape {list(i.shape)}; "
                "give each frame its own (frame_idx, value) pair"
            )
        if value is None:
            raise UnsupportedValueError(f"{where}{owner}: expected {_INDEX_RULE}, got {type(i).__name__} {i!r:.40}")
        if not -(2**63) <= value < 2**63:
            raise UnsupportedValueError(f"{where}{owner}: expected an index that fits in int64, got {value}")
        values.append(value)
    return torch.tensor(values, dtype=torch.int64)


def check_filenames(names: list) -> None:
    """Every filename is a str that UTF-8 can encode: one join and encode, or the first that is not."""
    try:
        "".join(names).encode("utf-8")
    except (TypeError, UnicodeEncodeError):
        for name in names:
            _check_filename(name)
        raise


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
