"""SIGTERM keeps what a rank holds, as Ctrl-C does: under a real torchrun, and in a local gloo world."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import tdgather

from . import sigterm_cases as sc
from .procs import finish_with
from .test_torchrun import torchrun

pytestmark = pytest.mark.world
JOB = str(Path(__file__).with_name("sigterm_job.py"))


def start_job(tmp_path: Path) -> tuple[subprocess.Popen, dict[int, int], Path]:
    """The job under torchrun, once both ranks hold their frames: (torchrun, {rank: pid}, out)."""
    out, ready = tmp_path / "ds", tmp_path / "ready"
    ready.mkdir()
    job = torchrun("--standalone", "--nproc-per-node=2", JOB, str(out), str(ready))
    deadline = time.monotonic() + 120
    while len(list(ready.glob("rank*.pid"))) < 2:
        if job.poll() is not None or time.monotonic() > deadline:
            job.kill()
            pytest.fail("the job did not start:\n" + job.communicate()[0])
        time.sleep(0.1)
    return job, {r: int((ready / f"rank{r}.pid").read_text()) for r in (0, 1)}, out


def assert_rank0_frames_kept(out: Path, failures: tuple = ("Terminated",)) -> tdgather.Dataset:
    ds = tdgather.open(out, incomplete=True)
    mine = sorted(n for n in ds if n.startswith("r0_"))
    assert mine == [f"r0_{i:04d}.jpg" for i in range(500)]
    assert all(torch.equal(ds[n].frames, torch.full((1, 8), float(i))) for i, n in enumerate(mine))
    assert ds.metadata["failure"]["type"] in failures, ds.metadata["failure"]
    return ds


def test_sigterm_to_torchrun_keeps_every_frame(tmp_path):
    job, _, out = start_job(tmp_path)
    job.send_signal(signal.SIGTERM)  # as SLURM or Kubernetes stop a job
    log = finish_with(job, timeout=60)
    assert job.returncode != 0
    assert "tdgather: SIGTERM: keeping what this rank holds" in log, log[-4000:]
    ds = assert_rank0_frames_kept(out)
    assert sorted(n for n in ds if n.startswith("r1_")) == [f"r1_{i:04d}.jpg" for i in range(50)]  # sent on abort
    assert not out.exists()  # no index: incomplete, as the failure table says


def test_sigkill_of_a_rank_makes_torchrun_sigterm_rank0_which_keeps_its_frames(tmp_path):
    job, pids, out = start_job(tmp_path)
    os.kill(pids[1], signal.SIGKILL)  # the OOM killer; torchrun then SIGTERMs rank 0 at once
    log = finish_with(job, timeout=60)
    assert job.returncode != 0
    assert "tdgather: SIGTERM: keeping what this rank holds" in log, log[-4000:]  # rank 0 was SIGTERMed
    assert_rank0_frames_kept(out, failures=("PeerLostError", "Terminated"))  # whichever rank 0 saw first


def test_sigterm_in_a_local_world_keeps_what_rank0_holds_and_exits_143(tmp_path):
    out = sc.run(tmp_path / "ds", "default")
    assert out[0] == {"exit": 143, "after": "SIG_DFL"}, out
    ds = tdgather.open(tmp_path / "ds", incomplete=True)
    assert sorted(ds) == sorted(f"r{r}_{i}.jpg" for r in (0, 1) for i in range(20))


def test_a_sigterm_during_the_abort_does_not_cut_it_short(tmp_path):
    """torchrun SIGTERMs rank 0 when a peer dies: rank 0, already writing what it received, finishes."""
    out = tmp_path / "ds"
    results = sc.run_local_world(sc.case_sigterm_during_abort, 2, str(out), timeout=120)
    assert results[0] == {"error": "PeerError", "sigterm_sent": True}  # not Terminated: the SIGTERM was ignored
    ds = tdgather.open(out, incomplete=True)
    assert ds.metadata["total_frames"] == 400 and ds.metadata["failure"]["rank"] == 1  # every frame, named
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_users_own_sigterm_handler_is_left_alone(tmp_path):
    out = sc.run(tmp_path / "ds", "user")
    assert out[0] == {"handled": True, "after": "user"}, out
    assert len(tdgather.open(tmp_path / "ds")) == 40  # the user's handler chose to finish: a complete dataset


def test_outside_a_collector_sigterm_keeps_its_default_action(tmp_path):
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with tdgather.Collector(tmp_path / "ds"):
        pass  # a local Collector: no frames, but its handler is installed...
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # ...and removed


def test_a_sigterm_while_rank_0_closes_keeps_every_frame_it_received(tmp_path):
    out = tmp_path / "ds"
    results = sc.run_local_world(sc.case_sigterm_while_closing, 3, str(out), timeout=120)
    assert results[0]["error"] == "Terminated", results
    ds = tdgather.open(out, incomplete=True)
    received = {int(k): v for k, v in ds.metadata["frames_per_rank"].items()}
    assert received[0] == 40 and ds.metadata["total_frames"] == sum(received.values())  # all listed, none lost
    assert sum(len(ds[name]) for name in ds) == ds.metadata["total_frames"]
