"""Launcher subprocesses for tests (torchrun, accelerate launch): wait for all, fail clearly."""

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    """Wait for every command (killing them all past the timeout); their outputs, after checking each exited 0."""
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("did not finish in time:\n" + "\n".join(p.communicate()[0] for p in procs))
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"{p.args} failed:\n{out[-6000:]}"
    return outs


def kill_later(pid_file: str, after: float) -> None:
    """SIGKILL the rank that stopped itself, once the others had time to notice (what torchrun would do)."""
    time.sleep(after)
    with contextlib.suppress(OSError, ValueError):
        os.kill(int(Path(pid_file).read_text()), signal.SIGKILL)


def finish_with(proc: subprocess.Popen, timeout: float) -> str:
    """Wait for a command that is expected to fail; its output (killed, and the test failed, past the timeout)."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"did not end within {timeout:g} s:\n" + proc.communicate()[0][-6000:])
