"""Page-locking an shm file's mapping, so that a GPU copies into it directly (``cudaHostRegister``).

A device-to-host copy runs at the link's speed, and without holding up the caller, only into
page-locked memory; into ordinary pages CUDA copies through a staging buffer of its own while the
caller waits. A Collector's sender copies CUDA batches straight into its ring's shm files
(`tdgather.comm.arena.Arena`), so each ring file's whole mapping is registered once, through
torch's binding of the CUDA runtime, and unregistered before the mapping is closed.

Each call runs on a short-lived thread of its own: a failed call sets the CUDA runtime's "last
error" of the thread that made it, and the next kernel launch on that thread would raise it. Where
registering fails (no CUDA, a driver or kernel that refuses a shared file's pages), `register`
returns None, logs it once, and the batches take the store's own pinned copy as before.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
from collections.abc import Callable

import torch

__all__ = ["Register", "Unpin", "register"]

log = logging.getLogger("tdgather")

Unpin = Callable[[], None]
Register = Callable[[mmap.mmap, torch.device], Unpin | None]  # `register`, or a test's double of it
_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process
_said: list[str] = []


def _on_own_thread(device: torch.device, call: Callable[[], object]) -> int:
    """``call()``'s CUDA error code (0: success), made on a thread of its own with ``device`` current.

    A new thread's current device is the first: set, so that no context is made on a GPU the rank does not use.
    """
    out: list[int] = []

    def run() -> None:
        torch.cuda.set_device(device)
        out.append(int(call()))

    thread = threading.Thread(target=run, name="tdgather-pin", daemon=True)
    thread.start()
    thread.join()
    return out[0] if out else -1


def _error_string(cudart, err: int) -> str:
    with contextlib.suppress(Exception):  # the binding's enum names success alone
        return str(cudart.cudaGetErrorString(err))
    return "no message"


def register(mm: mmap.mmap, device: torch.device) -> Unpin | None:
    """Page-lock all of ``mm`` for copies from CUDA ``device``; the call that undoes it, or None where it cannot."""
    if not len(mm) or not torch.cuda.is_available():
        return None
    view = torch.frombuffer(mm, dtype=torch.uint8)
    ptr, size = view.data_ptr(), view.numel()
    del view  # no export of the mapping stays: it can still be closed
    cudart = torch.cuda.cudart()
    err = _on_own_thread(device, lambda: cudart.cudaHostRegister(ptr, size, _PORTABLE))
    if err:
        if not _said:
            _said.append(str(err))
            log.info(
                "tdgather: cudaHostRegister of a %d-byte shm file failed (CUDA error %d: %s); CUDA batches are "
                "copied into pinned memory of the store's own, then into shared memory",
                size,
                err,
                _error_string(cudart, err),
            )
        return None

    def unpin() -> None:
        with contextlib.suppress(Exception):  # a copy still landing in it lands first (after a CUDA error: none)
            torch.cuda.synchronize(device)
        _on_own_thread(device, lambda: cudart.cudaHostUnregister(ptr))

    return unpin
