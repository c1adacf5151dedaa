"""Fixtures for the CPU end-to-end DFlash tests; helpers in tests/support/dflash_e2e.py,
the tiny pairs in tests/support/tiny_pair_fixtures.py."""

from __future__ import annotations

import pytest

import dflash_e2e as e2e


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
