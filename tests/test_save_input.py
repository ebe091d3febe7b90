"""`tdgather.save` takes gathered frames; what it is given by mistake is refused with the fix, before any file."""

import pytest
import torch

import tdgather
from tdgather import UnsupportedValueError

FIX = r"gather them first: tdgather\.save\(tdgather\.gather\(predictions\), path\)"


def _predictions():
    return {"a.mp4": [(0, torch.ones(3)), (1, torch.zeros(3))], "b.mp4": (0, torch.full((3,), 2.0))}


@pytest.mark.parametrize("form", ["list", "pair"])
def test_the_raw_predictions_dict_is_refused_with_the_fix(tmp_path, form):
    predictions = _predictions()
    name, got = ("a.mp4", "list") if form == "list" else ("b.mp4", "tuple")
    predictions = {name: predictions[name]}
    with pytest.raises(
        TypeError,
        match=rf"expected gathered frames: a tdgather\.Gathered .*filename '{name}' holds "
        rf"{got} \(the {{filename: \(frame_idx, value\)}} form that tdgather\.gather takes\); {FIX}",
    ):
        tdgather.save(predictions, tmp_path / "ds")
    assert list(tmp_path.iterdir()) == []  # nothing created, not even a staging directory


def test_the_fix_in_the_message_works(tmp_path):
    out = tdgather.save(tdgather.gather(_predictions()), tmp_path / "ds")
    ds = tdgather.open(out)
    assert sorted(ds) == ["a.mp4", "b.mp4"]
    assert torch.equal(ds["a.mp4"].frames, torch.stack([torch.ones(3), torch.zeros(3)]))
    assert ds["b.mp4"].frame_idx.tolist() == [0]


def test_a_store_none_and_other_values_are_refused(tmp_path):
    store = tdgather.FrameStore()
    store.add("a.mp4", [0], torch.ones(1, 3))
    with pytest.raises(UnsupportedValueError, match=rf"got a tdgather\.FrameStore \(not gathered\); {FIX}"):
        tdgather.save(store, tmp_path / "ds")
    with pytest.raises(UnsupportedValueError, match=r"got None; tdgather\.gather returns the frames on rank dst only"):
        tdgather.save(None, tmp_path / "ds")
    with pytest.raises(UnsupportedValueError, match=r"got list$"):
        tdgather.save([torch.ones(3)], tmp_path / "ds")
    assert list(tmp_path.iterdir()) == []


def test_a_dict_of_frames_is_still_written(tmp_path):
    frames = {"a.mp4": tdgather.Frames(frame_idx=torch.arange(2), frames=torch.ones(2, 3), batch_size=[2])}
    ds = tdgather.open(tdgather.save(frames, tmp_path / "ds"))
    assert torch.equal(ds["a.mp4"].frames, torch.ones(2, 3))


def test_many_long_filenames_are_cut_into_shards_that_safetensors_reads(tmp_path):
    # 13,000 names of 5,200 characters: 68 MB of segment records, over one shard's header budget
    # (safetensors refuses a header over 100 MB: one shard of 20,000 such names was unreadable)
    from safetensors import safe_open

    names = [f"{i:05d}_" + "x" * 5200 + ".jpg" for i in range(13_000)]
    store = tdgather.FrameStore()
    store.add(names, [0] * len(names), torch.arange(2 * len(names), dtype=torch.float32).reshape(-1, 2))
    out = tmp_path / "long_names"
    tdgather.save(tdgather.gather(store), out)
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) == 2
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            assert f.metadata()["format"] == "tdgather"
    ds = tdgather.open(out)
    assert len(ds) == 13_000
    for k in (0, 6_500, 12_999):
        assert ds[names[k]].frames.tolist() == [[2.0 * k, 2.0 * k + 1]]
