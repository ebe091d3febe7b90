"""The store conformance suite (tests/store_conformance.py) run against every store tdgather has."""

from __future__ import annotations

import uuid

import pytest

from tdgather.storage.objects import ObjectStore
from tdgather.storage.store import LocalStore

from .s3 import new_bucket, s3_server
from .store_conformance import StoreTests


class TestLocalStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path):
        (tmp_path / "ds").mkdir()
        return LocalStore(tmp_path / "ds")


class TestMemoryStore(StoreTests):
    @pytest.fixture
    def store(self):
        pytest.importorskip("fsspec")
        return ObjectStore(f"memory://conformance-{uuid.uuid4().hex}/ds")


@pytest.fixture(scope="module")
def s3():
    with s3_server() as options:
        yield options


class TestS3Store(StoreTests):
    @pytest.fixture
    def store(self, s3):
        return ObjectStore(f"s3://{new_bucket(s3)}/ds", s3, block_bytes=5 << 20)
