"""Where a path points: a local directory, or an object store URL (`store_at`).

A URL with a scheme other than ``file`` (``s3://``, ``gs://``, ``az://``, ``memory://``, any fsspec
protocol) is an object store; a ``file://`` URL, a ``str`` or a ``PathLike`` is a local path.
A store tdgather serves itself is named in `STORES` by its scheme (a new store: one entry there).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .objects import ObjectStore
from .store import LocalStore, Store

__all__ = ["STORES", "is_url", "local_path", "store_at"]

# URL scheme -> the store for its URLs, made as ``store(url, storage_options)``; a scheme not here goes
# to fsspec (`ObjectStore`). Each entry must pass tests/store_conformance.py.
STORES: dict[str, Callable[[str, dict | None], Store]] = {}


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL of an object store: ``scheme://...`` with a scheme other than ``file``."""
    if not isinstance(path, str) or "://" not in path:
        return False
    scheme = path.split("://", 1)[0].lower()
    return bool(re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme)) and scheme != "file"


def local_path(path: Any) -> Path:
    """A local path: a ``file:`` URL's path, or the path as given.

    The URL forms of RFC 8089: ``file:///p``, ``file://localhost/p``, ``file:/p``; the scheme in any
    case, as `is_url` reads it.

    >>> [str(local_path(u)) for u in ("file:///data/out", "FILE:///d", "file://localhost/d", "file:/d", "out")]
    ['/data/out', '/d', '/d', '/d', 'out']

    Raises:
        ValueError: a ``file://`` URL naming another host (a path on this machine is wanted).
    """
    if not isinstance(path, str) or path[:5].lower() != "file:":
        return Path(path)
    rest = path[5:]
    if rest.startswith("//"):
        host, slash, tail = rest[2:].partition("/")
        if host.lower() not in ("", "localhost"):
            raise ValueError(
                f"{path!r}: a file URL of host {host!r}; expected a path on this machine (file:///path or "
                "file://localhost/path), or an object store URL for a remote location"
            )
        return Path(slash + tail)
    if rest.startswith("/"):
        return Path(rest)
    return Path(path)


def store_at(path: Any, storage_options: dict | None = None) -> Store:
    """The store at ``path``: an object store for a URL (`is_url`), else the local directory.

    Raises:
        ValueError: ``storage_options`` given with a local path.
    """
    if is_url(path):
        return STORES.get(path.split("://", 1)[0].lower(), ObjectStore)(path, storage_options)
    if storage_options:
        raise ValueError(
            f"storage_options={sorted(storage_options)} is for an object store URL (s3://, gs://, az://, ...); "
            f"got the local path {str(path)!r}: drop storage_options, or pass a URL"
        )
    return LocalStore(local_path(path))
