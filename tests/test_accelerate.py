"""examples/accelerate_predict.py under real `accelerate launch` (2 CPU processes, gloo) against one process.

21 samples (3 videos of 7 frames) do not split evenly over 2 processes, so the prepared DataLoader's
``even_batches`` tops the last batches up with repeats of the first samples. Rank 0 must drop exactly
those repeats and write the dataset a single process writes: same filenames, same frame indexes,
every frame once, and the same bits wherever a sample ran in the same batch. The example's
``--split`` path (``split_between_processes``, no DataLoader) runs in the single process.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tdgather

from .procs import finish

pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "accelerate_predict.py")
pytestmark = pytest.mark.world
FRAMES = 7  # per video, 3 videos: 21 samples
LAST = ("video_0002.mp4", 6)  # sample 20, alone in the single process's last batch when the batch size is 4


def free_port() -> int:
    """A port the kernel says is free now (accelerate's rendezvous binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",  # the same kernels in every process and in the single-process runs
        "PYTHONUNBUFFERED": "1",
    }


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(args, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def accelerate_launch(out: Path, *args: str) -> str:
    """The example on 2 CPU processes: the launcher's multi-process path, with nothing a CPU lacks."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", str(free_port())]
    return finish([start(*launch, EXAMPLE, "--out", str(out), *args)])[0]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict[str, tdgather.Dataset]:
    """One process, no launcher (the three runs at once): batches of 3, of 4, and the ``--split`` path."""
    root = tmp_path_factory.mktemp("single")
    runs = {"b3": ["--batch", "3"], "b4": ["--batch", "4"], "split": ["--split", "--batch", "3"]}
    procs = [start(sys.executable, EXAMPLE, "--out", str(root / k), *args) for k, args in runs.items()]
    for summary in finish(procs):
        assert "21 frames" in summary and "0 duplicates dropped" in summary and "per rank {0: 21}" in summary
    return {k: tdgather.open(root / k) for k in runs}


def check_every_sample_once(ds: tdgather.Dataset) -> None:
    assert sorted(ds) == ["video_0000.mp4", "video_0001.mp4", "video_0002.mp4"]
    for name in ds:
        assert ds[name].frame_idx.tolist() == list(range(FRAMES)), name
    assert ds.metadata["total_frames"] == 3 * FRAMES


def test_a_whole_padding_batch_is_dropped_and_the_rest_is_bit_identical(single, tmp_path):
    # batches of 3: 7 full batches; rank 0 runs 0, 2, 4, 6 and rank 1 runs 1, 3, 5 and a repeat of batch 0
    summary = accelerate_launch(tmp_path / "two", "--batch", "3")
    assert "21 frames" in summary and "per rank {0: 12, 1: 12}" in summary, summary
    assert "3 duplicates dropped (3 exact, 0 inexact" in summary, summary  # the same batch, the same bits
    two = tdgather.open(tmp_path / "two")
    assert two.metadata["duplicates_dropped"] == 3
    assert two.metadata["duplicates"] == {"exact": 3, "inexact": 0, "max_abs_diff": 0.0}
    check_every_sample_once(two)
    ref = single["b3"]  # every sample ran in the same batch of 3 there
    for name in ref:
        a, b = ref[name], two[name]
        assert torch.equal(a.frame_idx, b.frame_idx), name
        assert torch.equal(a.frames["depth"], b.frames["depth"]), name
        assert torch.equal(a.frames["logits"], b.frames["logits"]), name


def test_a_topped_up_last_batch_loses_its_repeats(single, tmp_path):
    # batches of 4 (the default): 6 batches, the last one [20] alone; rank 1 runs it as [20, 0, 1, 2]
    summary = accelerate_launch(tmp_path / "two")
    assert "21 frames" in summary and "per rank {0: 12, 1: 12}" in summary, summary
    two = tdgather.open(tmp_path / "two")
    assert two.metadata["duplicates_dropped"] == 3 and "3 duplicates dropped" in summary
    check_every_sample_once(two)
    ref = single["b4"]  # the same batches of 4, but for the last one: [20] there, [20, 0, 1, 2] here
    for name in ref:
        a, b = ref[name], two[name]
        assert torch.equal(a.frame_idx, b.frame_idx), name
        for t in range(FRAMES):
            for leaf in ("depth", "logits"):
                x, y = a[t].frames[leaf], b[t].frames[leaf]
                if (name, t) == LAST:  # a batch of 1 against a batch of 4: batched kernels, last-bit differences
                    torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
                else:
                    assert torch.equal(x, y), (name, t, leaf)


def test_split_between_processes_takes_the_same_batches_in_one_process(single):
    # one process: split_between_processes hands it the whole list, batched by 3 as the DataLoader does
    # (2 processes under accelerate launch get 11 and 10 samples, contiguous, with no repeats to drop)
    split, ref = single["split"], single["b3"]
    check_every_sample_once(split)
    for name in ref:
        assert torch.equal(split[name].frames["depth"], ref[name].frames["depth"]), name
        assert torch.equal(split[name].frames["logits"], ref[name].frames["logits"]), name
