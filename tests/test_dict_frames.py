"""A dict of per-frame dicts of tensors (a detector's outputs in the seed's form) takes `update`'s keyed path.

``{filename: [(frame_idx, {"boxes": [N_i, 4], "scores": [N_i], ...}), ...]}``: the frames whose
keys, dtypes and shapes are those of a frame seen before join its batch without being flattened
again (`tdgather.core.forms.tree_key`). What they give must be what the frames are (bit for bit,
each leaf at its own shape, in frame order), what the same frames give as TensorDicts (which
`flatten` takes one by one), and the same refusals, with nothing of a refused call kept; a refusal
names the frame (filename and frame_idx), and a bad ``ragged=`` no function the caller did not call.
"""

from __future__ import annotations

import random

import pytest
import torch
from tensordict import TensorDict

import tdgather
from tdgather.core.framestore import FrameStore
from tdgather.errors import ShapeMismatchError, UnsupportedValueError

DETECTION = ("boxes", "scores", "labels")


def _frame(g: torch.Generator, n: int, shuffle: random.Random) -> dict:
    wide = torch.rand(n, 8, generator=g)
    leaves = {
        "boxes": wide[:, ::2],  # a non-contiguous view, as a slice of a head's output is
        "scores": torch.rand(n, generator=g).half(),
        "labels": torch.randint(0, 80, (n,), generator=g),
        "feat": torch.rand(6, generator=g),
        "iou": torch.rand((), generator=g),  # one value a frame
    }
    keys = list(leaves)
    shuffle.shuffle(keys)  # a dict's key order is the model's, not sorted
    return {k: leaves[k] for k in keys}


def _predictions(seed: int = 0) -> dict[str, list[tuple[int, dict]]]:
    g, shuffle = torch.Generator().manual_seed(seed), random.Random(seed)
    preds: dict[str, list[tuple[int, dict]]] = {}
    for f in range(3):
        idx = list(range(7))
        shuffle.shuffle(idx)  # frames out of order
        preds[f"clip_{f}.mp4"] = [(i, _frame(g, (i * 3 + f) % 6, shuffle)) for i in idx]  # 0 to 5 boxes
    return preds


def _same(got, frames: dict) -> bool:
    return all(
        got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v) for k, v in frames.items()
    )


@pytest.mark.parametrize("ragged", [DETECTION, True, ()], ids=["named", "all", "undeclared"])
def test_dict_frames_gather_as_given_and_as_their_tensordicts_do(ragged):
    preds = _predictions()
    got = tdgather.gather(preds, ragged=ragged)
    as_td = tdgather.gather(
        {name: [(i, TensorDict(dict(v), batch_size=[])) for i, v in pairs] for name, pairs in preds.items()},
        ragged=ragged,
    )
    assert sorted(got) == sorted(preds) == sorted(as_td)
    for name, pairs in preds.items():
        want = sorted(pairs, key=lambda p: p[0])
        assert got[name].frame_idx.tolist() == [i for i, _ in want] == as_td[name].frame_idx.tolist()
        for k, (_, frame) in enumerate(want):
            assert _same(got[name].frames[k], frame), (name, k)
            assert _same(as_td[name].frames[k], frame), (name, k)


def test_dict_frames_and_tensordict_frames_of_one_layout_join_one_group():
    preds = _predictions()
    mixed = {
        name: [(i, TensorDict(dict(v), batch_size=[]) if i % 2 else v) for i, v in pairs]
        for name, pairs in preds.items()
    }
    store = FrameStore()
    store.update(mixed, ragged=DETECTION)
    ((layout, _),) = store.groups()  # one layout: the keyed frames and the flattened ones together
    assert {".".join(leaf.path) for leaf in layout.leaves if leaf.ragged} == set(DETECTION)
    got = tdgather.gather(store)
    for name, pairs in preds.items():
        for k, (_, frame) in enumerate(sorted(pairs, key=lambda p: p[0])):
            assert _same(got[name].frames[k], frame), (name, k)


def test_a_later_frame_of_another_dtype_is_refused_naming_its_filename_and_nothing_is_kept():
    preds = _predictions()
    frame = dict(preds["clip_1.mp4"][3][1])
    frame["labels"] = frame["labels"].int()  # int32 where the other frames of clip_1 have int64
    preds["clip_1.mp4"][3] = (preds["clip_1.mp4"][3][0], frame)
    store = FrameStore()
    with pytest.raises(ShapeMismatchError, match=r"filename 'clip_1\.mp4'.*int32") as info:
        store.update(preds, ragged=DETECTION)
    assert "int64" in str(info.value)
    assert store.num_frames == 0 and store.names == []


@pytest.mark.parametrize(
    ("bad", "error", "words"),
    [
        ({"iou": torch.tensor(0.5)}, ValueError, "'iou' is named ragged, but it holds one value per frame"),
        ({"boxes": torch.zeros(2, 4, device="meta")}, UnsupportedValueError, "a meta tensor"),
        ({1: torch.zeros(2)}, UnsupportedValueError, "expected str keys"),
        ({"boxes": torch.zeros(2, 4), "note": object()}, UnsupportedValueError, "a plain JSON value"),
    ],
    ids=["ragged-scalar", "meta", "int-key", "object"],
)
def test_a_bad_frame_after_good_ones_is_refused_as_flatten_refuses_it(bad, error, words):
    preds = _predictions()
    name = "clip_2.mp4"
    ragged = (*DETECTION, "iou") if "iou" in bad else DETECTION
    if "iou" in bad:  # every frame before it holds iou as one row, so the key that brings the scalar is new
        preds = {n: [(fi, {**f, "iou": f["iou"].reshape(1)}) for fi, f in ps] for n, ps in preds.items()}
    pairs = preds[name]
    pairs.append((99, {**pairs[0][1], **bad}))
    store = FrameStore()
    with pytest.raises(error, match=r"filename 'clip_2\.mp4', frame_idx 99(:| key)") as info:  # the frame, not a [0]
        store.update(preds, ragged=ragged)
    assert words in str(info.value)
    assert store.num_frames == 0


def test_nested_dicts_and_json_leaves_still_take_flatten():
    frames = {
        "a.jpg": (0, {"det": {"boxes": torch.rand(3, 4)}, "caption": "a cat"}),
        "b.jpg": (0, {"det": {"boxes": torch.rand(1, 4)}, "caption": "a dog"}),
    }
    got = tdgather.gather(frames, ragged="det.boxes")
    for name, (_, frame) in frames.items():
        assert torch.equal(got[name].frames[0]["det", "boxes"], frame["det"]["boxes"])
        assert got[name].frames[0]["caption"] == frame["caption"]


def test_undeclared_counts_fit_and_another_dtype_is_refused_each_time_it_comes():
    store = FrameStore()
    store.update(_predictions())  # no ragged=: every box count a layout, all of them fitting each other
    assert store.num_frames == 21
    bad = {"clip_0.mp4": (50, {**_predictions()["clip_0.mp4"][0][1], "scores": torch.zeros(3)})}  # float32
    for _ in range(2):  # the pair's fit is remembered: the second refusal must come as the first did
        with pytest.raises(ShapeMismatchError, match=r"filename 'clip_0\.mp4'.*float16.*float32|float32.*float16"):
            store.update(bad)
        assert store.num_frames == 21
    got = tdgather.gather(store)
    assert got["clip_0.mp4"].frame_idx.tolist() == list(range(7))


def test_a_ragged_name_that_is_no_leaf_is_refused_naming_no_other_function():
    preds = _predictions()
    with pytest.raises(ValueError, match=r"ragged=\['boxez'\] names \['boxez'\], which is not a tensor leaf") as info:
        tdgather.gather(preds, ragged=["boxez"])
    assert "update()" not in str(info.value) and "'boxes'" in str(info.value)  # the leaves there are, to choose from
    captions = {"a.jpg": [(0, {"caption": "a cat"}), (1, {"caption": "a dog"})]}  # frames, but no tensor leaf
    with pytest.raises(
        ValueError, match=r"names \['boxes'\], which is not a tensor leaf here; the tensor leaves are none"
    ):
        tdgather.gather(captions, ragged="boxes")
    with pytest.raises(TypeError, match=r"^expected ragged=True or dotted keys \(str\), got \[1\]$"):
        tdgather.gather(preds, ragged=[1])
    assert len(tdgather.gather({}, ragged="boxes")) == 0  # a rank with no frames has nothing to name


def test_a_frame_idx_of_two_elements_is_named_as_such():
    with pytest.raises(UnsupportedValueError, match=r"expected one integer a frame, got a Tensor of shape \[2\]"):
        tdgather.gather({"v.mp4": [(torch.tensor([3, 4]), {"boxes": torch.zeros(1, 4)})]})
