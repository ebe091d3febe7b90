"""`PredictionWriter` under real Lightning Trainers: ``ddp`` and ``ddp_spawn`` on 2 gloo ranks.

The four 2-process runs (tests/lightning_cases.py: ``many``, ``spawn``, ``fail``, ``writers``) start at once, in their
own interpreters (Lightning's ddp launcher re-executes ``sys.argv``); the 1-process reference runs in this
process meanwhile. Datasets of 9, 3, 7 and 12 samples do not split evenly over 2 ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tdgather

pytest.importorskip("lightning")

import lightning as L  # noqa: E402

from tdgather.integrations.lightning import PredictionWriter  # noqa: E402
from tests import lightning_cases  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CASES = str(ROOT / "tests" / "lightning_cases.py")


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, subprocess.Popen]]:
    """The 2-process runs, started together; each test waits for its own."""
    procs = {}
    for case in ("many", "spawn", "fail", "writers", "shuffled"):
        out = tmp_path_factory.mktemp(case)
        args = [sys.executable, CASES, case, str(out), "2"]
        procs[case] = (
            out,
            subprocess.Popen(args, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        )
    yield procs
    for _, p in procs.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


def _finish(run: tuple[Path, subprocess.Popen], rc: int = 0) -> tuple[Path, str]:
    out, p = run
    try:
        log = p.communicate(timeout=240)[0]
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("did not finish in time:\n" + p.communicate()[0][-6000:])
    assert p.returncode == rc, f"{p.args} exited {p.returncode}:\n{log[-6000:]}"
    return out, log


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """The ``many`` case on one device, in this process: the reference."""
    out = tmp_path_factory.mktemp("single")
    lightning_cases.run("many", out, 1)
    return out


def _assert_same(a: tdgather.Dataset, b: tdgather.Dataset) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name].frame_idx, b[name].frame_idx), name
        fa, fb = a[name].frames, b[name].frames
        if isinstance(fa, torch.Tensor):
            assert torch.equal(fa, fb), name
        else:
            assert sorted(fa.keys()) == sorted(fb.keys()) and all(torch.equal(fa[k], fb[k]) for k in fa.keys()), name


@pytest.mark.world
@pytest.mark.timeout(300)
def test_ddp_three_dataloaders_equal_one_process(runs, single):
    out, _ = _finish(runs["many"])
    for k in range(3):
        _assert_same(tdgather.open(out / f"preds_{k}"), tdgather.open(single / f"preds_{k}"))
    fields, fallback = tdgather.open(out / "preds_0"), tdgather.open(out / "preds_2")
    assert sorted(fields) == ["clip_1_0.mp4", "clip_1_1.mp4", "clip_1_2.mp4"]
    assert fields["clip_1_1.mp4"].frame_idx.tolist() == [0, 1, 2] and fields["clip_1_1.mp4"].frames["y"].shape == (3, 6)
    assert list(fallback) == ["dataloader_2"] and fallback["dataloader_2"].frame_idx.tolist() == list(range(7))
    x = torch.stack(lightning_cases.samples(7, fields=False, seed=3))
    model = lightning_cases.Elementwise()
    with torch.no_grad():
        assert torch.equal(fallback["dataloader_2"].frames, model.predict_step(x, 0))
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["error"] for r in records] == [None, None]


def test_a_url_with_storage_options_gives_the_same_datasets(tmp_path, single):
    lightning_cases.run("memory", tmp_path, 1)
    for k in range(3):
        _assert_same(tdgather.open(f"memory://{tmp_path.name}/preds_{k}"), tdgather.open(single / f"preds_{k}"))


@pytest.mark.world
@pytest.mark.timeout(300)
def test_ddp_with_a_writer_per_rank_equals_one_process(runs, single):
    out, _ = _finish(runs["writers"])
    for k in range(3):
        ds = tdgather.open(out / f"preds_{k}")
        _assert_same(ds, tdgather.open(single / f"preds_{k}"))
        assert {name.split("-")[1] for name in ds.index["shards"]} == {"00000", "00001"}  # both ranks wrote


@pytest.mark.world
@pytest.mark.timeout(300)
def test_ddp_spawn_with_a_keys_function_and_a_plain_path(runs, single):
    out, _ = _finish(runs["spawn"])
    spawned = tdgather.open(out / "preds")["spawned"]
    reference = tdgather.open(single / "preds_2")["dataloader_2"]
    assert spawned.frame_idx.tolist() == list(range(7))
    assert torch.equal(spawned.frames, reference.frames)


@pytest.mark.world
@pytest.mark.timeout(300)
def test_a_rank_raising_in_predict_step_makes_every_rank_raise_and_keeps_the_partial(runs):
    out, log = _finish(runs["fail"], rc=1)
    rank0, rank1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank1["error"] == "RuntimeError" and rank1["message"] == "boom on rank 1"
    assert rank0["error"] == "PeerError" and "rank 1 failed with RuntimeError: boom on rank 1" in rank0["message"]
    assert log.count("return_predictions is on") == 1  # warned once, on rank 0
    assert not (out / "preds").exists()
    with pytest.raises(tdgather.OutputError, match="incomplete=True"):
        tdgather.open(out / "preds")
    partial = tdgather.open(out / "preds", incomplete=True)
    got = {(name, i) for name in partial for i in partial[name].frame_idx.tolist()}
    # rank 1 ran samples 1, 3, 5...; its first batch (1 and 3) was added before it raised
    assert {("clip_4_0.mp4", 1), ("clip_4_1.mp4", 0)} <= got
    # rank 0 ran samples 0, 2, 4...: what it added before it learnt of the failure reached the partial
    assert ("clip_4_0.mp4", 0) in got


def test_keys_from_fields_from_a_function_or_from_the_batch_indices():
    w = PredictionWriter("unused")
    batch = {"filename": ["a.mp4", "b.mp4"], "frame_idx": torch.tensor([3, 1]), "x": torch.zeros(2)}
    assert w.batch_keys(batch, [7, 9], 0) == (batch["filename"], batch["frame_idx"])
    name, idx = w.batch_keys(torch.zeros(2, 3), [7, 9], 1)
    assert name == "dataloader_1" and idx.tolist() == [7, 9] and idx.dtype == torch.int64
    with pytest.raises(ValueError, match="only one of the fields"):
        w.batch_keys({"filename": ["a.mp4"]}, [0], 0)
    with pytest.raises(ValueError, match="pass keys="):
        w.batch_keys(torch.zeros(2), [], 0)
    custom = PredictionWriter("unused", keys=lambda b, i, k: ("c.mp4", torch.arange(len(b))))
    assert custom.batch_keys(torch.zeros(2), [], 0)[1].tolist() == [0, 1]
    assert PredictionWriter("out/p_{dataloader_idx}").path_for(2) == "out/p_2"


def test_a_wrong_collector_keyword_fails_at_construction():
    with pytest.raises(TypeError):
        PredictionWriter("out", timout=3)


def test_several_dataloaders_need_a_template(tmp_path):
    writer = PredictionWriter(tmp_path / "preds")
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, callbacks=[writer])
    loaders = lightning_cases.loaders("many")
    with pytest.raises(ValueError, match="dataloader_idx"):
        trainer.predict(lightning_cases.Elementwise(), loaders, return_predictions=False)
    assert not (tmp_path / "preds").exists()


class _Detector(L.LightningModule):
    """Per image a dict of ``boxes [N_i, 4]`` and ``scores [N_i]``: 2 boxes each in the first batches, then 0-3."""

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        out = []
        for i in batch["frame_idx"].tolist():
            n = 2 if i < 4 else i % 4
            out.append({"boxes": torch.full((n, 4), float(i)), "scores": torch.full((n,), i / 10)})
        if len({d["boxes"].shape[0] for d in out}) == 1:  # equal counts: one dense batch, as many heads give
            return {k: torch.stack([d[k] for d in out]) for k in out[0]}
        return out


def _clips() -> list:
    return [{"filename": "clip.mp4", "frame_idx": i, "x": torch.zeros(1)} for i in range(10)]


def test_a_detector_with_no_ragged_declaration_writes_one_ragged_column(tmp_path):
    writer = PredictionWriter(tmp_path / "dets")
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, callbacks=[writer])
    trainer.predict(_Detector(), torch.utils.data.DataLoader(_clips(), batch_size=2), return_predictions=False)
    clip = tdgather.open(tmp_path / "dets")["clip.mp4"]
    counts = [2, 2, 2, 2] + [i % 4 for i in range(4, 10)]
    assert [t.shape[0] for t in clip.frames["boxes"].unbind()] == counts
    assert all(bool((t == i).all()) for i, t in enumerate(clip.frames["boxes"].unbind()))
    bad = PredictionWriter(tmp_path / "fixed", ragged=False)  # every leaf declared fixed: the change is refused
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, callbacks=[bad])
    with pytest.raises(tdgather.ShapeMismatchError, match=r"'clip.mp4'.*ragged=False"):
        trainer.predict(_Detector(), torch.utils.data.DataLoader(_clips(), batch_size=2), return_predictions=False)


@pytest.mark.world
@pytest.mark.timeout(300)
def test_overlapping_shuffled_shares_are_reported_as_frames_never_predicted(runs):
    """shuffle=True without a common seed: Lightning's predict sampler never pads, so a copy is a lost frame."""
    out, log = _finish(runs["shuffled"])
    ds = tdgather.open(out / "preds")
    assert len(ds) < 23  # frames predicted twice stand for frames never predicted
    dropped = 23 - len(ds)
    assert f"{dropped} copies of frames were predicted more than once" in log, log[-3000:]
    assert "never predicted" in log and "seed_everything" in log
