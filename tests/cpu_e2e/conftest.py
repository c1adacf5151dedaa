"""Fixtures for the CPU end-to-end DFlash tests; helpers in tests/support/dflash_e2e.py."""

from __future__ import annotations

import pytest

import dflash_e2e as e2e


@pytest.fixture(scope="session")
def partial_pair(tmp_path_factory):
    return e2e.make_pair(tmp_path_factory, "partial", "partial")


@pytest.fixture(scope="session")
def random_pair(tmp_path_factory):
    return e2e.make_pair(tmp_path_factory, "none", "none")


@pytest.fixture(scope="session")
def full_pair(tmp_path_factory):
    return e2e.make_pair(tmp_path_factory, "full", "full")


@pytest.fixture(scope="session")
def trained_pair(tmp_path_factory):
    """A drafter trained against its target (10-30 s on 2 idle cores)."""
    return e2e.make_pair(tmp_path_factory, "trained", "trained")


@pytest.fixture(scope="session")
def kv_scales_pair(tmp_path_factory):
    return e2e.make_pair(tmp_path_factory, "kvscales", "partial", draft_kv_scales=(0.5, 0.25))


@pytest.fixture(scope="session", autouse=True)
def _shutdown_engines_at_end():
    yield
    e2e.shutdown_llm()


@pytest.fixture(scope="session")
def measurements():
    """Numbers the tests measured; printed at the end of the session."""
    data: dict = {}
    yield data
    print("\n[e2e] measured:")
    for k in sorted(data, key=str):
        print(f"[e2e]   {k}: {data[k]}")
