"""A ``file://`` URL is the local path it names, at every entry point: written where it is read."""

from pathlib import Path

import pytest
import torch

import tdgather
from tdgather import saved_at
from tdgather.format.names import INDEX_NAME
from tdgather.tools.cli import main


def test_a_file_url_is_the_local_path_it_names_everywhere(tmp_path, monkeypatch, capsys):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # a file:// URL read as a relative path would land here, as ./file:/...
    url = f"file://{tmp_path}/col"
    with tdgather.Collector(url, progress=False) as col:
        col.add(["a.mp4"] * 3, [0, 1, 2], torch.arange(6.0).reshape(3, 2))
    assert (tmp_path / "col" / INDEX_NAME).is_file() and f"{tmp_path}/col" in str(col.summary)
    assert tdgather.open(url)["a.mp4"].frame_idx.tolist() == [0, 1, 2]
    assert saved_at(url).num_frames == 3  # what resume=True finds there
    with tdgather.Collector(url, resume=True, progress=False) as col:  # continues it, in the same place
        col.add(["a.mp4"], [3], torch.ones(1, 2))
    assert tdgather.open(tmp_path / "col")["a.mp4"].frame_idx.tolist() == [0, 1, 2, 3]
    saved = tdgather.save(tdgather.gather({"b.mp4": (0, torch.ones(2))}), f"file://{tmp_path}/saved")
    assert saved == tmp_path / "saved" and list(tdgather.open(f"file://{tmp_path}/saved")) == ["b.mp4"]
    assert main(["inspect", url]) == 0 and "'a.mp4'" in capsys.readouterr().out
    assert list(cwd.iterdir()) == []  # no ./file: directory


def test_file_url_forms_of_rfc_8089_and_another_host(tmp_path):
    from tdgather.storage.location import local_path

    out = tdgather.save(tdgather.gather({"a.mp4": (0, torch.ones(2))}), f"file://localhost{tmp_path}/ds")
    assert Path(out) == tmp_path / "ds"  # never ./localhost/...
    assert list(tdgather.open(f"file:{tmp_path}/ds")) == ["a.mp4"]
    with pytest.raises(ValueError, match="host 'nas'"):
        local_path("file://nas/data/out")
