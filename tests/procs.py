"""Launcher subprocesses for tests (torchrun, accelerate launch): wait for all, fail clearly."""

import subprocess

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
