"""`Frames.at(frame_idx)` selects by frame index; `clip[i]` is the i-th row, another frame when indexes skip."""

import numpy as np
import pytest
import torch

import tdgather


def test_at_selects_by_frame_idx_on_a_saved_subsampled_clip_with_ragged_leaves(tmp_path):
    idx = [0, 5, 10, 15]
    dets = [{"boxes": torch.full((i % 3, 4), float(i)), "feat": torch.full((2,), float(i))} for i in idx]
    store = tdgather.FrameStore()
    store.add(["clip.mp4"] * 4, torch.tensor(idx), dets)
    tdgather.save(tdgather.gather(store), tmp_path / "ds")
    clip = tdgather.open(tmp_path / "ds")["clip.mp4"]
    for i in idx:
        for key in (i, np.int64(i), torch.tensor(i)):  # what a user holds: int, numpy, a LongTensor element
            frame = clip.at(key)
            assert int(frame.frame_idx) == i
            assert torch.equal(frame.frames["feat"], torch.full((2,), float(i)))
            assert torch.equal(frame.frames["boxes"], torch.full((i % 3, 4), float(i)))
    assert int(clip[3].frame_idx) == 15  # the fourth row
    with pytest.raises(KeyError, match=r"frame_idx 3: no such frame here \(4 frames, frame_idx 0..15\)"):
        clip.at(3)
    with pytest.raises(TypeError, match="expected an integer, got float"):
        clip.at(5.0)
    with pytest.raises(TypeError, match="expected an integer, got Tensor"):
        clip.at(torch.tensor(10.0))
    with pytest.raises(KeyError, match=r"frame_idx 1180591620717411303424: no such frame"):
        clip.at(2**70)
