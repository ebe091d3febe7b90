"""What a failed Collector run left in ``<out>.partial``, read with ``incomplete=True`` as a complete one reads.

A filename's segments may differ in a leaf's first dim (written fixed in one shard, ragged or with
another count in the next): the incomplete record must read them, bit for bit, as the dataset a
``resume=True`` completes from the same shards reads them.
"""

from __future__ import annotations

import pytest
import torch

import tdgather
from tdgather.tools.cli import main

# rank dst writes a shard every few batches: 3.2 KB a batch, chunks of 4 KiB, a 64 KiB budget
SMALL = {"memory_budget": 1 << 16, "chunk_bytes": 4096, "progress": False}
BATCHES = 40  # frames 0 to 79, 100 boxes each but frame 1 (0 boxes): about 7 shards


def _boxes(i: int, n: int) -> torch.Tensor:
    return torch.rand(n, 4, generator=torch.Generator().manual_seed(i))


def _batch(idx: list[int], n: int) -> tuple[list[str], torch.Tensor, dict]:
    """A detector's batch where every frame had ``n`` boxes: one dense ``[B, n, 4]`` tensor."""
    return ["a.mp4"] * len(idx), torch.tensor(idx), {"boxes": torch.stack([_boxes(i, n) for i in idx])}


def _run(out, first: list, **kwargs) -> None:
    """A Collector that adds ``first``, then ``BATCHES - 1`` batches of 100 boxes a frame, then fails."""
    with tdgather.Collector(out, **SMALL, **kwargs) as col:
        for batch in first:
            col.add(*batch)
        for b in range(1, BATCHES):
            col.add(*_batch([2 * b, 2 * b + 1], 100))
        raise RuntimeError("the rank fails here")


def _stored(out) -> set[tuple]:
    """How the shards store ``boxes``: (shape, ragged) per group."""
    ds = tdgather.open(out, incomplete=True)
    groups = [g for s in ds.index["shards"].values() for g in s["groups"].values()]
    return {(tuple(g["leaves"][0]["shape"]), g["leaves"][0].get("ragged", False)) for g in groups}


def _check_reads_as_complete(out, want: dict[int, torch.Tensor], capsys) -> None:
    """The incomplete record reads ``want`` bit for bit, as tdgather inspect does, and as the completed dataset."""
    partial = tdgather.open(out, incomplete=True)
    assert len(partial.index["shards"]) > 2, partial.index["shards"].keys()
    got = partial["a.mp4"]
    assert got.frame_idx.tolist() == sorted(want)  # each frame once
    assert partial.layout("a.mp4").describe() == "{boxes: float32[*, 4]}"
    for i, b in zip(got.frame_idx.tolist(), got.frames["boxes"].unbind(), strict=True):
        assert b.dtype == torch.float32 and torch.equal(b, want[i]), i
    assert main(["inspect", "--incomplete", str(out)]) == 0
    text = capsys.readouterr().out
    assert "float32[*, 4]" in text and f"{len(want)} frames" in text, text

    with tdgather.Collector(out, resume=True, **SMALL) as col:
        assert col.saved.num_frames == len(want)  # nothing left to compute: the run completes as it is
    done = tdgather.open(out)["a.mp4"]
    assert torch.equal(done.frame_idx, got.frame_idx)
    assert torch.equal(done.frames["boxes"].offsets(), got.frames["boxes"].offsets())
    assert torch.equal(done.frames["boxes"].values(), got.frames["boxes"].values())


def test_a_filename_ragged_in_one_shard_and_fixed_in_the_next(tmp_path, capsys):
    out = tmp_path / "dets"
    first = (["a.mp4"] * 2, torch.tensor([0, 1]), [{"boxes": _boxes(0, 100)}, {"boxes": _boxes(1, 0)}])
    with pytest.raises(RuntimeError, match="the rank fails here"):
        _run(out, [first])
    assert _stored(out) == {((4,), True), ((100, 4), False)}  # ragged in the first shard, fixed in the others
    want = {i: _boxes(i, 0 if i == 1 else 100) for i in range(2 * BATCHES)}
    _check_reads_as_complete(out, want, capsys)


def test_a_copy_of_a_frame_with_another_first_dim_refused_under_exact(tmp_path, capsys):
    out = tmp_path / "dets"
    with pytest.raises(tdgather.DuplicateFrameError, match=r"'a.mp4', frame_idx 0.*100 rows against 0"):
        with tdgather.Collector(out, duplicates="exact", **SMALL) as col:
            for b in range(BATCHES):
                col.add(*_batch([2 * b, 2 * b + 1], 100))
            col.add(*_batch([0, 2 * BATCHES], 0))  # a padded copy of frame 0, and a new frame, with 0 boxes
    assert tdgather.open(out, incomplete=True).metadata["failure"]["type"] == "DuplicateFrameError"
    assert _stored(out) == {((100, 4), False), ((4,), True)}  # fixed first, frame 80 in a ragged group
    want = {i: _boxes(i, 100) for i in range(2 * BATCHES)} | {2 * BATCHES: _boxes(2 * BATCHES, 0)}
    _check_reads_as_complete(out, want, capsys)
