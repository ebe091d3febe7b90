"""Every Python block of the README and of each docs/ page runs as written, on 2 ranks under torchrun.

Each page is one test: its blocks run in order, in a fresh directory of their own, as a reader
would paste them (the README's reading block reads what its Collector example wrote; a docs page
that reads a dataset first saves one itself), so no page depends on another page's output. The
writer-per-node block runs as two torchrun "nodes" of one process each, meeting on loopback, so
that it has two writers. The Quick start also runs alone, without a process group. The object
storage page's blocks talk to a local S3 server (moto's, started here; skipped without moto or
s3fs), whose endpoint they read from ``TDGATHER_S3_ENDPOINT``.

PAGES says how many blocks each page has: a page added under docs/, or a block added, removed or
no longer collected (a fence that is not exactly ```python at the start of a line), fails
`test_each_page_has_the_blocks_this_test_expects` until the count here is updated.
"""

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .procs import finish
from .s3 import s3_server
from .test_torchrun import free_port

ROOT = Path(__file__).resolve().parents[1]

# page -> the number of ```python blocks it holds (every one runs)
PAGES = {
    "README.md": 3,
    "docs/benchmarks.md": 0,
    "docs/collector.md": 0,
    "docs/design.md": 0,
    "docs/failures.md": 1,
    "docs/format.md": 2,
    "docs/how-it-works.md": 0,
    "docs/inputs.md": 1,
    "docs/integrations.md": 2,
    "docs/many-jobs.md": 4,
    "docs/object-storage.md": 2,
    "docs/ragged.md": 1,
    "docs/reading.md": 4,
    "docs/scaling.md": 1,
}

pytestmark = pytest.mark.world


def blocks(page: str) -> list[str]:
    text = (ROOT / page).read_text(encoding="utf-8")
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def python_fences(page: str) -> int:
    """Every fence that opens a Python block, also one indented or spelled ```py / ``` python."""
    text = (ROOT / page).read_text(encoding="utf-8")
    return len(re.findall(r"^[ \t>]*(?:```|~~~)[ \t]*(?:python3?|py)\b", text, flags=re.M | re.I))


def _dataset(out: Path, *names: str) -> None:
    for name in names:
        assert (out / name / "tdgather.index.json").is_file(), f"{name} was not written"


def _readme(out: Path, logs: str) -> None:
    _dataset(out, "quickstart", "epoch_3")
    assert "video_0.mp4 [0, 1, 2] (20, 1, 16, 16)" in logs, logs[-3000:]


def _ragged(out: Path, logs: str) -> None:
    _dataset(out, "dets")


def _integrations(out: Path, logs: str) -> None:
    _dataset(out, "lightning_0", "lightning_1", "accelerate")


def _scaling(out: Path, logs: str) -> None:
    assert "tensor([0, 1, 2, 3])" in logs, logs[-3000:]
    per_node = sorted(os.listdir(out / "per_node"))
    assert per_node == ["shard-00000-00000.safetensors", "shard-00001-00000.safetensors", "tdgather.index.json"]


def _failures(out: Path, logs: str) -> None:
    _dataset(out, "long_job")


def _format(out: Path, logs: str) -> None:
    _dataset(out, "epoch_3", "dets")
    assert "['g0', 'g0:frame_idx']" in logs, logs[-3000:]


def _many_jobs(out: Path, logs: str) -> None:
    assert "added 7, dropped 2, 16 frames in all" in logs, logs[-3000:]
    assert "['shared.mp4', 'video_0.mp4', 'video_1.mp4'] [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]" in logs, logs[-3000:]
    names = sorted(os.listdir(out / "many_jobs"))  # compacted, then expired: one shard, one snapshot, the job's marks
    assert len(names) == 4 and re.fullmatch(r"shard-00000\.[0-9a-f]{12}-1\.safetensors", names[0]), names
    assert all(re.fullmatch(rf"tdgather\.job-[0-9a-f]{{16}}-000{k}\.json", names[k]) for k in (1, 2)), names
    assert names[3] == "tdgather.snapshot-00000004.json", names
    computed = re.search(r"computed (\d) of 8 task-3 3", logs)
    assert computed and int(computed[1]) < 8, logs[-3000:]  # the second attempt continued the first
    assert "4 3 24" in logs and "(1, 2, 3) (4,) 4" in logs, logs[-3000:]


def _object_storage(out: Path, logs: str) -> None:
    assert not out.exists()  # everything went to the bucket, nothing to the local disk
    assert "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11] (12, 1, 16, 16)" in logs, logs[-3000:]
    assert "verified 1 shard(s)" in logs, logs[-3000:]


def _reading(out: Path, logs: str) -> None:
    _dataset(out, "quickstart")
    assert (out / "quickstart.parquet").is_file()


# what each page's blocks must leave behind, in its own directory's out/ and in their output
CHECKS = {
    "README.md": _readme,
    "docs/failures.md": _failures,
    "docs/format.md": _format,
    "docs/inputs.md": lambda out, logs: None,  # its block asserts its own result
    "docs/integrations.md": _integrations,
    "docs/many-jobs.md": _many_jobs,
    "docs/object-storage.md": _object_storage,
    "docs/ragged.md": _ragged,
    "docs/reading.md": _reading,
    "docs/scaling.md": _scaling,
}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _run(args, cwd, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(args, cwd=cwd, env={**_env(), **(env or {})}, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def _two_nodes(script: Path, cwd: Path) -> list[str]:
    port = free_port()
    rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=readme", "--max-restarts=0"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", *rdzv]
    return finish(
        [
            subprocess.Popen(
                [*cmd, f"--node-rank={n}", str(script)],
                cwd=cwd,
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for n in range(2)
        ],
        timeout=180,
    )


def test_every_page_is_listed():
    pages = ["README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]
    assert sorted(pages) == sorted(PAGES), "add the new page to PAGES (and CHECKS if it has blocks)"
    assert sorted(CHECKS) == sorted(p for p, n in PAGES.items() if n)


@pytest.mark.parametrize("page", sorted(PAGES))
def test_each_page_has_the_blocks_this_test_expects(page):
    found = blocks(page)
    assert len(found) == python_fences(page), f"{page}: a Python block is not a plain ```python fence"
    assert len(found) == PAGES[page], [b.splitlines()[:3] for b in found]


@pytest.mark.parametrize("page", sorted(p for p, n in PAGES.items() if n))
def test_every_python_block_of_the_page_runs_as_written_on_two_ranks(page, tmp_path):
    logs = []
    with contextlib.ExitStack() as servers:
        env = {}
        if page == "docs/object-storage.md":  # a fresh, empty S3 for the page's blocks
            env["TDGATHER_S3_ENDPOINT"] = servers.enter_context(s3_server())["endpoint_url"]
        for k, block in enumerate(blocks(page)):
            script = tmp_path / f"block{k}.py"
            script.write_text(block, encoding="utf-8")
            if "ranks_per_writer=per_node" in block:
                logs += _two_nodes(script, tmp_path)
                continue
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
            logs.append(_run([*torchrun, str(script)], tmp_path, env))
    CHECKS[page](tmp_path / "out", "".join(logs))


def test_the_quick_start_runs_without_a_process_group(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(blocks("README.md")[0], encoding="utf-8")
    out = _run([sys.executable, str(script)], tmp_path)
    assert "tensor([3, 4])" in out and "torch.Size([2, 2, 8])" in out
