"""docs/format.md describes every record of the format exactly as tdgather/format/records.py defines it."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import tdgather
from tdgather.format import records

PAGE = (Path(__file__).resolve().parents[1] / "docs" / "format.md").read_text(encoding="utf-8")
RECORDS = [getattr(records, name) for name in records.__all__]


def documented_fields(name: str) -> list[str]:
    """The first column of the table under ``### `name``` in the page's Records section."""
    section = PAGE.split("## Records", 1)[1].split("\n## ", 1)[0]
    match = re.search(rf"^### `{name}`\n(.*?)(?=^### |\Z)", section, flags=re.S | re.M)
    assert match, f"docs/format.md has no table for {name}"
    return re.findall(r"^\| `([a-z_][a-z0-9_]*)` \|", match.group(1), flags=re.M)  # sha256: a digit too


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.__name__)
def test_every_record_is_documented_field_for_field(record):
    assert sorted(documented_fields(record.__name__)) == sorted(f.name for f in dataclasses.fields(record))


def test_what_tdgather_writes_has_exactly_the_documented_keys(tmp_path):
    store = tdgather.FrameStore()
    store.add(["a.mp4", "a.mp4", "b.mp4"], [0, 1, 0], [{"boxes": torch.ones(n, 4), "label": "x"} for n in (2, 0, 1)])
    tdgather.save(tdgather.gather(store), tmp_path / "ds", metadata={"model": "m"})
    ds = tdgather.open(tmp_path / "ds")
    meta = ds.metadata
    # an incomplete record's; and replaces, written only where a dataset replaced another in an object store
    optional = {"frames_per_rank", "failure", "replaces"}
    assert set(meta) == set(documented_fields("IndexMeta")) - optional
    assert set(meta["attempts"][0]) == set(documented_fields("Attempt"))
    for entry in ds.index["files"].values():
        assert set(entry) == set(documented_fields("FileEntry"))
        assert all(set(s) == set(documented_fields("Segment")) for s in entry["segments"])
    for name, entry in ds.index["shards"].items():
        assert set(entry) == set(documented_fields("ShardEntry")) - {"sha256"}  # an object store's only
        with safe_open(tmp_path / "ds" / name, "pt") as f:
            assert set(f.metadata()) == set(documented_fields("ShardRecord"))
