"""Where a path points: a local directory, or an object store URL (`store_at`).

A URL with a scheme other than ``file`` (``s3://``, ``gs://``, ``az://``, ``memory://``, any fsspec
protocol) is an object store; a ``file://`` URL, a ``str`` or a ``PathLike`` is a local path.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .objects import ObjectStore
from .store import LocalStore, Store

__all__ = ["is_url", "local_path", "store_at"]


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL of an object store: ``scheme://...`` with a scheme other than ``file``."""
    if not isinstance(path, str) or "://" not in path:
        return False
    scheme = path.split("://", 1)[0].lower()
    return bool(re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme)) and scheme != "file"


def local_path(path: Any) -> Path:
    """A local path: a ``file://`` URL's path (the scheme in any case, as `is_url` reads it), or the path as given.

    >>> str(local_path("file:///data/out")), str(local_path("FILE:///data/out")), str(local_path("out"))
    ('/data/out', '/data/out', 'out')
    """
    if isinstance(path, str) and path[: len("file://")].lower() == "file://":
        return Path(path[len("file://") :])
    return Path(path)


def store_at(path: Any, storage_options: dict | None = None) -> Store:
    """The store at ``path``: an object store for a URL (`is_url`), else the local directory.

    Raises:
        ValueError: ``storage_options`` given with a local path.
    """
    if is_url(path):
        return ObjectStore(path, storage_options)
    if storage_options:
        raise ValueError(
            f"storage_options={sorted(storage_options)} is for an object store URL (s3://, gs://, az://, ...); "
            f"got the local path {str(path)!r}: drop storage_options, or pass a URL"
        )
    return LocalStore(local_path(path))
