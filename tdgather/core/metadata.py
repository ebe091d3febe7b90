"""The user's ``metadata=``: checked when a Collector is made (on every rank) or `tdgather.save` is called.

It is stored in the index as ``metadata["user"]``, a namespace of its own: tdgather's keys
(``run``, ``total_frames``, ``duplicates``...) sit beside it and never replace a user's key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["USER_KEY", "user_metadata"]

USER_KEY = "user"  # where the index keeps the user's metadata
_MAX_DEPTH = 32


def user_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """A JSON copy of the user's metadata, numpy scalars as Python numbers; refuse what JSON cannot hold.

    >>> import numpy as np
    >>> user_metadata({"lr": np.float32(0.1), "epochs": np.int64(3), "tags": ("a", "b")})
    {'lr': 0.1, 'epochs': 3, 'tags': ['a', 'b']}

    Raises:
        TypeError: a key that is not a str, or a value that is not JSON (naming its key and type).
        ValueError: a float that is NaN or infinite (JSON has neither).
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata: expected a dict of JSON values, got {type(metadata).__name__}")
    return _json(metadata, "metadata", 0)


def _json(value: Any, where: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise ValueError(f"{where}: nested deeper than {_MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)  # an IntEnum, say, as its number
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: expected a finite number (JSON has no NaN or infinity), got {value!r}")
        return float(value)
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():  # np.float32(0.1), np.int64(3)
        if value.dtype.kind == "f":  # the shortest decimal of its own precision: 0.1, not 0.10000000149011612
            return _json(float(str(value)), where, depth)
        return _json(value.item(), where, depth)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: keys must be str (JSON objects), got {type(k).__name__} key {k!r}")
            out[k] = _json(v, f"{where}[{k!r}]", depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [_json(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
    raise TypeError(
        f"{where}: expected a JSON value (str, int, float, bool, None, or a list or str-keyed dict of them), "
        f"got {kind}; convert it first (str(path), array.tolist(), tensor.item())"
    )
