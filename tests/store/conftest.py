"""The store process the same-node fast path's tests share (``tests/store/test_shm_*.py``)."""

from __future__ import annotations

import pytest

from tests.conftest import start_role
from tests.store.shm_helpers import STORE_ARGS


@pytest.fixture(scope="package")
def shm_store():
    """Started once for every test file of the fast path here (each its own keys); a test that
    fills or stops a store starts its own."""
    proc = start_role("store", *STORE_ARGS)
    yield proc
    proc.stop()
