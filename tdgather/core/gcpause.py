"""Python's cyclic garbage collector paused around work that allocates a few objects per filename."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collection_paused"]


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """The cyclic collector off for the block (as it was before, after).

    Placing, merging and writing allocate a few objects per filename; in a process holding many
    objects (a model, a dataset, the store's batches), that sets off full collections costing
    more than the work itself (saving 8,000 filenames: 0.35 s with them, 0.16 s without).
    Nothing here makes cycles.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
