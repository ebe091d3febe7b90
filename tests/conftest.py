"""Fixtures shared by the tests of the same-host paths."""

import pytest


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """A segment directory of the test's own (``TDGATHER_SHM_DIR``), empty."""
    where = tmp_path / "shm"
    where.mkdir()
    monkeypatch.setenv("TDGATHER_SHM_DIR", str(where))
    return where
