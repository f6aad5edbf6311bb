"""Fixtures shared by the test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.dist_utils import RankPool


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[RankPool]:
    """Gloo groups kept alive for the whole session (see :class:`tests.dist_utils.RankPool`)."""
    pool = RankPool()
    yield pool
    pool.close()
