"""One type per leaf name, decided by every frame of the dataset, in real gloo worlds (tests/schema_cases.py).

Whether a leaf is ragged must not depend on how the frames happened to be batched or how many a
filename has: a first dim that differs between any two frames (one frame per filename included),
or that is 0 in every frame, makes the leaf ragged everywhere; one that is equal everywhere stays a
plain tensor, and `tdgather.padded` pads both. The index records that schema, where a reader without
tdgather finds each leaf's dtype, row shape and raggedness.
"""

from __future__ import annotations

import pytest

from tdgather.tools.launch import run_local_world

from . import schema_cases as sc


@pytest.mark.world
@pytest.mark.parametrize("how", ["gather", "collector"])
def test_one_frame_per_filename_with_tokens_of_every_length_is_ragged_and_exports(tmp_path, how):
    out = run_local_world(sc.case_prompts, 2, str(tmp_path / "ds"), how, timeout=120)[0]
    assert out["files"] == sc.PROMPTS and out["ragged"] == ["tokens"] and out["plain_same"]
    assert all(leaves == {"tokens": True} for leaves in out["nested"].values())  # also 1-token prompts
    assert out["types"] == ["{tokens: int64[*], text: json}"] and out["schema"] == {"tokens": ["int64", [], True]}
    if "hf_rows" in out:
        assert out["hf_rows"] == sc.PROMPTS and out["hf_first"] == {"frame_idx": 0, "tokens": 1, "text": "p0"}


@pytest.mark.world
@pytest.mark.parametrize("how", ["gather", "collector"])
def test_a_detector_that_finds_nothing_anywhere_pads_and_exports(tmp_path, how):
    out = run_local_world(sc.case_detections, 2, str(tmp_path / "ds"), how, 0, timeout=120)[0]
    assert out["files"] == 6 and out["ragged"] == [] and out["plain_same"]  # equal counts everywhere (0): [T, 0, 4]
    assert out["schema"] == {
        "boxes": ["float32", [0, 4], False],
        "labels": ["int64", [0], False],
        "scores": ["float32", [0], False],
    }
    assert out["padded"] == [[8, 0, 4], [0] * 8]
    if "hf_rows" in out:
        assert out["hf_rows"] == 48 and out["hf_first"]["boxes"] == 0
        assert out["hf_features"]["boxes"] == "Array2D"  # rows of 4, as where some frame has a box


@pytest.mark.world
@pytest.mark.parametrize("how", ["gather", "collector"])
def test_a_detector_that_always_finds_100_boxes_stays_fixed_and_pads(tmp_path, how):
    out = run_local_world(sc.case_detections, 2, str(tmp_path / "ds"), how, 100, timeout=120)[0]
    assert out["ragged"] == [] and not any(any(v.values()) for v in out["nested"].values()) and out["plain_same"]
    assert out["padded"] == [[8, 100, 4], [100] * 8]  # the documented padding works on a plain tensor
    assert out["types"] == ["{boxes: float32[100, 4], labels: int64[100], scores: float32[100]}"]
    if "hf_rows" in out:
        assert out["hf_rows"] == 48 and out["hf_first"]["boxes"] == 100


@pytest.mark.world
def test_frames_declared_fixed_keep_a_type_per_length_in_the_schema(tmp_path):
    """``ragged=False``: no leaf is made ragged; prompts of 1 to 7 tokens are 7 fixed types, each read as declared."""
    out = run_local_world(sc.case_prompts, 2, str(tmp_path / "ds"), "fixed", timeout=120)[0]
    assert out["files"] == sc.PROMPTS and out["ragged"] == [] and out["plain_same"]
    assert not any(v["tokens"] for v in out["nested"].values())
    assert out["types"] == [f"{{tokens: int64[{n}], text: json}}" for n in range(1, 8)]
    if "hf_rows" in out:  # a column of varying dims exports as a list of any length
        assert out["hf_rows"] == sc.PROMPTS and out["hf_first"] == {"frame_idx": 0, "tokens": 1, "text": "p0"}


@pytest.mark.world
@pytest.mark.parametrize("how", ["gather", "collector"])
def test_masks_of_images_of_two_sizes_are_ragged_in_every_filename(tmp_path, how):
    """A first dim that differs between two frames makes the leaf ragged, whatever its other dims: the 96 px images
    (5 masks each) are ragged too, because two 64 px images differ, so no filename's type depends on the others'."""
    out = run_local_world(sc.case_masks, 2, str(tmp_path / "ds"), how, timeout=120)[0]
    assert out["files"] == 4 and out["ragged"] == ["boxes", "masks"] and out["plain_same"]
    assert all(leaves == {"boxes": True, "masks": True} for leaves in out["nested"].values())
    assert out["types"] == [
        "{boxes: float32[*, 4], masks: bool[*, 1, 64, 64]}",
        "{boxes: float32[*, 4], masks: bool[*, 1, 96, 96]}",
    ]
