"""Fixtures for the CPU end-to-end DFlash tests; their helpers are in
tests/support (offline_engine.py, greedy_runs.py, worker_probes.py, ...), the
tiny pairs in tests/support/tiny_pair_fixtures.py."""

from __future__ import annotations

import dflash_settings
import offline_engine
import pytest
from vllm_server import VllmServer, vllm_dist_skip_reason


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


@pytest.fixture
def partial_pair_server(partial_pair, tmp_path) -> VllmServer:
    """`vllm serve` of the partial pair with DFlash and an fp8 KV cache, not
    started yet (each test starts and stops it as it checks); skips where
    `vllm serve` cannot run."""
    if reason := vllm_dist_skip_reason():
        pytest.skip(reason)
    target, draft = partial_pair
    return VllmServer(
        target,
        dflash_settings.dflash_fp8_serve_args(draft),
        tmp_path / "server.log",
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )
