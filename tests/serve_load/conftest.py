"""One `vllm serve` (DFlash + fp8 KV cache, float32 model, tiny KV cache)
for load, faults and shutdown; the target-only references are computed by
an offline float32 engine when a test first needs them (a test that only
needs the server, such as a necessity guard run alone, does not start it),
and every output must be equal token for token (tests/support/lossless.py).
Settings and workloads: tests/support/serve_workload.py.

The pair is the trained one (vllm.fork.tiny_pairs): its target is a random,
confident model (no near-ties for float32 numerics to flip) and its drafter
is trained on that target, so drafts are both accepted and rejected.
"""

from __future__ import annotations

import dflash_settings
import offline_engine
import pytest
import serve_workload as workload
from vllm_server import ServerExited, VllmServer, vllm_dist_skip_reason


@pytest.fixture(scope="session")
def load_jobs():
    return workload.load_jobs()


@pytest.fixture(scope="session")
def references(trained_pair, load_jobs):
    """Target-only greedy outputs (same model and KV dtypes, no drafter) for
    every job the tests check, from one offline engine that is shut down again."""
    if reason := vllm_dist_skip_reason():
        pytest.skip(reason)
    target, _ = trained_pair
    llm = offline_engine.start_llm(
        ("serve-load-target", workload.MODEL_DTYPE, workload.KV_DTYPE),
        model=target,
        dtype=workload.MODEL_DTYPE,
        kv_cache_dtype=workload.KV_DTYPE,
        max_model_len=workload.MAX_MODEL_LEN,
    )
    try:
        refs = workload.reference_outputs(
            llm,
            [
                *load_jobs,
                workload.FOLLOW_UP,
                *workload.BOUNDARY_JOBS,
                *workload.SHUTDOWN_JOBS,
                *workload.ABANDONED_JOBS,
            ],
        )
    finally:
        offline_engine.shutdown_llm()
    return refs


@pytest.fixture(scope="session")
def server(trained_pair, tmp_path_factory):
    target, draft = trained_pair
    srv = VllmServer(
        target,
        workload.server_args(dflash_settings.dflash_spec_config(draft)),
        tmp_path_factory.mktemp("serve-load") / "server.log",
        env=workload.SERVER_ENV,
    )
    try:
        srv.start()
    except (ServerExited, TimeoutError) as e:
        pytest.fail(str(e))
    srv.model = srv.model_id()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def live_server(server):
    """The session server; a test that finds it gone fails with the log."""
    if server.proc.poll() is not None:
        pytest.fail(f"the server is gone (exit {server.proc.returncode}):\n{server.log_tail()}")
    return server


@pytest.fixture(scope="session")
def figures(measured_section):
    """Per-scenario counts and timings; in the terminal summary at the end."""
    data: dict[str, dict] = {}
    yield data
    lines = measured_section("serve_load figures")
    for scenario, values in data.items():
        lines.append(f"[serve-load] {scenario}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
