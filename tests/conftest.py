"""Fixtures shared by the tests: the same-host paths' segment directory, and an S3 server (moto) with a bucket."""

import pytest

from .s3 import new_bucket, s3_server


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """A segment directory of the test's own (``TDGATHER_SHM_DIR``), empty."""
    where = tmp_path / "shm"
    where.mkdir()
    monkeypatch.setenv("TDGATHER_SHM_DIR", str(where))
    return where


@pytest.fixture(scope="module")
def s3():
    """storage_options for a moto S3 server on a free port, for the module's tests (skipped without moto or s3fs)."""
    with s3_server() as options:
        yield options


@pytest.fixture
def url(s3) -> str:
    """A prefix in a new, empty bucket on that server."""
    return f"s3://{new_bucket(s3)}/preds/depth"
