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


def torchrun(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_nodes_give_the_single_node_result(tmp_path):
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
            str(tmp_path / "two_nodes"),
        )
        for n in range(2)
    ]
    outs = finish(nodes)
    single = finish([torchrun("--standalone", "--nproc-per-node=4", EXAMPLE, "--out", str(tmp_path / "one_node"))])
    assert sum("tdgather: 324 frames" in out for out in outs) == 1  # rank 0's summary, on one of the nodes
    assert "per rank {0: 54, 1: 108, 2: 162, 3: 0}" in single[0]
    one, two = tdgather.open(tmp_path / "one_node"), tdgather.open(tmp_path / "two_nodes")
    assert sorted(one) == sorted(two) and len(one) == 12
    for name in one:
        a, b = one[name], two[name]
        assert torch.equal(a.frame_idx, b.frame_idx), name
        assert torch.equal(a.frames["depth"], b.frames["depth"]), name
        assert torch.equal(a.frames["seg"], b.frames["seg"]), name
