"""Rank functions for tests/test_sigterm.py: rank 0 sends itself SIGTERM inside a Collector."""

import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

import tdgather
from tdgather.tools.launch import run_local_world


def case_sigterm(out: str, mode: str) -> dict:
    """``mode`` "default": SIGTERM's default action was in place; "user": the user's own handler was."""
    rank = dist.get_rank()
    handled = []

    def users_handler(signum, frame):
        handled.append(signum)

    if mode == "user":
        signal.signal(signal.SIGTERM, users_handler)
    result: dict = {}
    added = Path(f"{out}.added")  # rank 1 holds its frames: rank 0 is stopped only then (else rank 1's add
    try:  # may meet rank 0's failure first, and it has nothing to keep)
        with tdgather.Collector(out, timeout=60, progress=False) as col:
            col.add([f"r{rank}_{i}.jpg" for i in range(20)], [0] * 20, torch.rand(20, 4))
            if rank:
                added.touch()
            deadline = time.monotonic() + 60
            while not rank and not added.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            if rank == 0:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)  # the handler runs in this thread at once
        result = {"handled": bool(handled)}
    except SystemExit as e:
        result = {"exit": e.code}
    except tdgather.PeerError as e:
        result = {"error": type(e).__name__}
    now = signal.getsignal(signal.SIGTERM)
    result["after"] = "user" if now is users_handler else getattr(now, "name", repr(now))
    return result


def run(out: Path, mode: str) -> list:
    return run_local_world(case_sigterm, 2, str(out), mode, timeout=120)


def case_sigterm_during_abort(out: str) -> dict:
    """Rank 1 raises; rank 0, aborting, gets SIGTERM (as torchrun sends it) while it writes its incomplete record."""
    import functools

    from tdgather.storage.atomic import LocalFS
    from tdgather.storage.writer import DatasetWriter

    sent = []

    class SigtermAtRecord(LocalFS):
        def write_atomic(self, path, chunks, then=None):
            if path.name == "tdgather.incomplete.json":
                sent.append(True)
                os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, at once
            return super().write_atomic(path, chunks, then)

    rank = dist.get_rank()
    sink = functools.partial(DatasetWriter, fs=SigtermAtRecord()) if rank == 0 else None
    try:
        with tdgather.Collector(out, timeout=60, progress=False, sink=sink) as col:
            col.add([f"r{rank}_{i}.jpg" for i in range(200)], [0] * 200, torch.rand(200, 64))
            if rank == 1:
                raise RuntimeError("rank 1 fails")  # rank 0 learns it in close(), and aborts
    except SystemExit as e:
        return {"exit": e.code, "sigterm_sent": bool(sent)}
    except (tdgather.PeerError, RuntimeError) as e:
        return {"error": type(e).__name__, "sigterm_sent": bool(sent)}
    return {"error": None}


def case_sigterm_while_closing(out: str) -> dict:
    """Rank 0 is in close(), waiting for slow senders, when SIGTERM comes: it must keep every frame received.

    Its wait for the writer thread is interrupted by the SIGTERM; the abort that follows must wait for
    that thread again (Python < 3.13's Thread.join, interrupted so, marks a running thread as ended).
    """
    import threading

    rank = dist.get_rank()
    error = None
    try:
        with tdgather.Collector(out, chunk_bytes=300_000, timeout=60, progress=False) as col:
            for b in range(10):
                col.add([f"v{rank}.mp4"] * 4, torch.arange(4) + 4 * b, torch.full((4, 3, 64, 64), float(rank)))
                if rank:
                    time.sleep(0.1)
            if rank == 0:  # in close() by then: its join of the writer thread is what the signal interrupts
                threading.Timer(0.4, os.kill, (os.getpid(), signal.SIGTERM)).start()
    except (tdgather.TdgatherError, tdgather.Terminated) as e:
        error = type(e).__name__
    return {"error": error}
