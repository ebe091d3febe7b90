"""One type per leaf name, decided by every frame of the dataset, in real gloo worlds (tests/schema_cases.py).

Whether a leaf is ragged must not depend on how the frames happened to be batched or how many a
filename has: a first dim that differs between any two frames (one frame per filename included),
or that is 0 in every frame, makes the leaf ragged everywhere; one that is equal everywhere stays a
plain tensor, and `tdgather.padded` pads both.
"""

from __future__ import annotations

import pytest

from tdgather.tools.launch import run_local_world

from . import schema_cases as sc


@pytest.mark.world
@pytest.mark.parametrize("how", ["gather", "collector"])
def test_one_frame_per_filename_with_tokens_of_every_length_is_ragged_and_exports(tmp_path, how):
    out = run_local_world(sc.case_prompts, 2, str(tmp_path / "ds"), how, timeout=120)[0]
    assert out["files"] == sc.PROMPTS and out["ragged"] == ["tokens"]
    assert all(leaves == {"tokens": True} for leaves in out["nested"].values())  # also 1-token prompts
    if "hf_rows" in out:
        assert out["hf_rows"] == sc.PROMPTS and out["hf_first"] == {"frame_idx": 0, "tokens": 1, "text": "p0"}


@pytest.mark.world
@pytest.mark.parametrize("how", ["gather", "collector"])
def test_a_detector_that_finds_nothing_anywhere_pads_and_exports(tmp_path, how):
    out = run_local_world(sc.case_detections, 2, str(tmp_path / "ds"), how, 0, timeout=120)[0]
    assert out["files"] == 6 and out["ragged"] == []  # equal counts everywhere (0): plain [T, 0, 4]
    assert out["padded"] == [[8, 0, 4], [0] * 8]
    if "hf_rows" in out:
        assert out["hf_rows"] == 48 and out["hf_first"]["boxes"] == 0


@pytest.mark.world
@pytest.mark.parametrize("how", ["gather", "collector"])
def test_a_detector_that_always_finds_100_boxes_stays_fixed_and_pads(tmp_path, how):
    out = run_local_world(sc.case_detections, 2, str(tmp_path / "ds"), how, 100, timeout=120)[0]
    assert out["ragged"] == [] and not any(any(v.values()) for v in out["nested"].values())
    assert out["padded"] == [[8, 100, 4], [100] * 8]  # the documented padding works on a plain tensor
    if "hf_rows" in out:
        assert out["hf_rows"] == 48 and out["hf_first"]["boxes"] == 100
