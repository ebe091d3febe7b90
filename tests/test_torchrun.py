"""examples/predict.py under real torchrun: two "nodes" on loopback give what one node gives."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tdgather

from .procs import finish

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "predict.py")
pytestmark = pytest.mark.world


def free_port() -> int:
    """A port the kernel says is free now (the rendezvous host binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def two_nodes(out: Path, *more: str, second: dict | None = None) -> list[str]:
    """examples/predict.py on two "nodes" of 2 processes: two torchrun invocations that meet on loopback.

    ``second``: environment of the second node only.
    """
    port = free_port()
    nodes = [
        torchrun(
            "--nnodes=2",
            "--nproc-per-node=2",
            f"--node-rank={n}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=tdgather-two-nodes",
            "--max-restarts=0",
            EXAMPLE,
            "--out",
            str(out),
            *more,
            env=second if n else None,
        )
        for n in range(2)
    ]
    return finish(nodes)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> Path:
    """examples/predict.py on one node of 4 processes, rank 0 the one writer."""
    out = tmp_path_factory.mktemp("single") / "one_node"
    single = finish([torchrun("--standalone", "--nproc-per-node=4", EXAMPLE, "--out", str(out))])
    assert "per rank {0: 54, 1: 108, 2: 162, 3: 0}" in single[0]
    return out


def assert_same_frames(got: Path, want: Path) -> None:
    one, two = tdgather.open(want), tdgather.open(got)
    assert sorted(one) == sorted(two) and len(one) == 12
    for name in one:
        a, b = one[name], two[name]
        assert torch.equal(a.frame_idx, b.frame_idx), name
        assert torch.equal(a.frames["depth"], b.frames["depth"]), name
        assert torch.equal(a.frames["seg"], b.frames["seg"]), name


def test_two_nodes_give_the_single_node_result(tmp_path, one_node):
    outs = two_nodes(tmp_path / "two_nodes")
    assert sum("tdgather: 324 frames" in out for out in outs) == 1  # rank 0's summary, on one of the nodes
    assert_same_frames(tmp_path / "two_nodes", one_node)


def test_a_node_on_another_host_sends_over_gloo_and_gives_the_same_result(tmp_path, one_node):
    # its own segment directory makes the second node another host (its host token differs): its
    # ranks send over gloo, the first node's sender through shared memory
    (tmp_path / "other_host_shm").mkdir()
    outs = two_nodes(tmp_path / "two_hosts", second={"TDGATHER_SHM_DIR": str(tmp_path / "other_host_shm")})
    [summary] = [line for out in outs for line in out.splitlines() if line.startswith("tdgather: 324 frames")]
    assert "per rank {0: 54, 1: 108, 2: 162, 3: 0}" in summary
    shared = int(summary.split(", ")[-1].split()[0]) if "shared memory" in summary else 0
    assert 0 < shared  # rank 1, on rank 0's node
    assert_same_frames(tmp_path / "two_hosts", one_node)
    assert not list((tmp_path / "other_host_shm").iterdir())  # nothing left where the second node could write
    with_shared = [
        line for out in two_nodes(tmp_path / "one_host") for line in out.splitlines() if "324 frames" in line
    ]
    assert int(with_shared[0].split(", ")[-1].split()[0]) > shared  # rank 2's chunks too, when it shares the host


def test_a_writer_per_node_gives_the_single_writer_dataset(tmp_path, one_node):
    outs = two_nodes(tmp_path / "per_node", "--writer-per-node")
    assert sum("tdgather: 324 frames" in out for out in outs) == 1
    assert_same_frames(tmp_path / "per_node", one_node)
    ds = tdgather.open(tmp_path / "per_node")
    assert {name.split("-")[1] for name in ds.index["shards"]} == {"00000", "00001"}  # both nodes wrote
    spanning = [n for n in ds if len({s["shard"].split("-")[1] for s in ds.index["files"][n]["segments"]}) > 1]
    assert spanning  # filenames whose frames two nodes wrote read as one sorted Frames
    for key in ("total_frames", "total_bytes", "num_filenames"):
        assert ds.metadata[key] == tdgather.open(one_node).metadata[key]
