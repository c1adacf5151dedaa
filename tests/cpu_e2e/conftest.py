"""Fixtures for the CPU end-to-end DFlash tests; their helpers are in
tests/support (offline_engine.py, greedy_runs.py, worker_probes.py, ...), the
tiny pairs in tests/support/tiny_pair_fixtures.py."""

from __future__ import annotations

import offline_engine
import pytest


@pytest.fixture(scope="session", autouse=True)
def _shutdown_engines_at_end():
    yield
    offline_engine.shutdown_llm()


@pytest.fixture(scope="session")
def measurements(measured_section):
    """Numbers the tests measured; in the terminal summary at the end."""
    data: dict = {}
    yield data
    lines = measured_section("cpu_e2e measurements")
    for k in sorted(data, key=str):
        lines.append(f"[e2e] {k}: {data[k]}")
