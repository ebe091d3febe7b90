"""Every Python block of the README runs as written, on 2 ranks under torchrun (and the Quick start alone).

The blocks run in order in one directory, as a reader would paste them: the safe_open recipe reads
what the Collector example wrote. The writer-per-node block runs as two torchrun "nodes" of one
process each, meeting on loopback, so that it has two writers.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .procs import finish
from .test_torchrun import free_port

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.S | re.M)

pytestmark = pytest.mark.world


def _run(args, cwd):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def _two_nodes(script: Path, cwd: Path) -> list[str]:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=readme", "--max-restarts=0"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", *rdzv]
    return finish(
        [
            subprocess.Popen(
                [*cmd, f"--node-rank={n}", str(script)],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for n in range(2)
        ],
        timeout=180,
    )


def test_the_readme_has_the_blocks_this_test_expects():
    assert len(BLOCKS) == 12, [b.splitlines()[:3] for b in BLOCKS]


def test_every_python_block_runs_as_written_on_two_ranks(tmp_path):
    for k, block in enumerate(BLOCKS):
        script = tmp_path / f"block{k}.py"
        script.write_text(block, encoding="utf-8")
        if "ranks_per_writer=per_node" in block:
            outs = _two_nodes(script, tmp_path)
            assert "tensor([0, 1, 2, 3])" in "".join(outs)
            continue
        _run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)], tmp_path
        )
    assert (tmp_path / "out" / "quickstart" / "tdgather.index.json").is_file()
    assert (tmp_path / "out" / "dets" / "tdgather.index.json").is_file()
    per_node = sorted(os.listdir(tmp_path / "out" / "per_node"))
    assert per_node == ["shard-00000-00000.safetensors", "shard-00001-00000.safetensors", "tdgather.index.json"]
    for ds in ["lightning_0", "lightning_1", "accelerate", "long_job"]:
        assert (tmp_path / "out" / ds / "tdgather.index.json").is_file()
    assert (tmp_path / "out" / "quickstart.parquet").is_file()


def test_the_quick_start_runs_without_a_process_group(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(BLOCKS[0], encoding="utf-8")
    out = _run([sys.executable, str(script)], tmp_path)
    assert "tensor([3, 4])" in out and "torch.Size([2, 2, 8])" in out
