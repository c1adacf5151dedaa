"""A `vllm serve` that cannot start exits non-zero soon, with a message
naming the problem, and leaves nothing behind: no process, no file in its
temp directory (ZeroMQ ipc socket files included). An invalid
--speculative-config is refused before any engine process starts; a drafter
whose weights cannot be loaded fails inside the engine core, after the
server, the engine core and its worker made their ipc endpoints."""

from __future__ import annotations

import json
import shutil
import subprocess

import dflash_settings
import pytest
import serve_workload as workload
from vllm_server import VllmServer, vllm_dist_skip_reason

# A hang detector: a refused config takes ~10-15 s (the CLI's imports).
EXIT_BOUND_S = 180
# After the server exits, how long its children may take to follow: a worker
# spawned just before the engine core failed is still importing torch on a
# busy machine (seen: one such "python" process alive at the moment the
# server's exit was noticed). A hang detector too, not a speed check.
CHILD_EXIT_GRACE_S = 60


def _spec(draft: str, **override) -> str:
    return json.dumps({**dflash_settings.dflash_spec_config(draft), **override})


@pytest.mark.parametrize("case", ["not-json", "unknown-method", "negative-tokens", "missing-draft", "target-as-draft"])
def test_invalid_speculative_config_exits_with_a_clear_message(case, partial_pair, tmp_path, figures):
    if reason := vllm_dist_skip_reason():
        pytest.skip(reason)
    target, draft = partial_pair
    spec, expected = {
        "not-json": ('{"method": "dflash", "model": ', "argument --speculative-config"),
        "unknown-method": (_spec(draft, method="dflash2"), "'dflash'"),
        "negative-tokens": (_spec(draft, num_speculative_tokens=-1), "greater than 0"),
        "missing-draft": (
            _spec(draft, model=str(tmp_path / "no-such-draft")),
            "Invalid repository ID or local directory",
        ),
        # tests/engine/test_dflash_config_errors.py has the other DFlash config mistakes.
        "target-as-draft": (_spec(draft, model=target), "is not a DFlash drafter"),
    }[case]
    srv = VllmServer(
        target,
        workload.server_args(None) + ["--speculative-config", spec],
        tmp_path / "server.log",
        env=workload.SERVER_ENV,
    ).spawn()
    code, leftovers, temp_left = _wait_for_exit(srv)
    log = srv.log_tail(20000)
    figures[f"invalid speculative config: {case}"] = {"exit_code": code, "temp_files_left": len(temp_left)}
    print(f"\n[serve-load] --speculative-config {spec}: exit {code}")
    assert code != 0, log
    assert expected in log, log[-3000:]
    assert "SpeculativeConfig" in log or case == "not-json", log[-3000:]
    assert not leftovers, leftovers
    assert not temp_left, f"left in the server's TMPDIR: {temp_left}"


# Patch 0013's necessity proof uses tests/serve_load/test_ipc_socket_files.py
# (the same failure without it, at a fraction of the cost).
def test_engine_start_up_failure_leaves_nothing_behind(partial_pair, tmp_path, figures):
    if reason := vllm_dist_skip_reason():
        pytest.skip(reason)
    target, draft = partial_pair
    broken = tmp_path / "draft-with-truncated-weights"
    shutil.copytree(draft, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(weights.read_bytes()[:64])
    srv = VllmServer(
        target,
        workload.server_args(dflash_settings.dflash_spec_config(str(broken))),
        tmp_path / "server.log",
        env=workload.SERVER_ENV,
    ).spawn()
    code, leftovers, temp_left = _wait_for_exit(srv)
    log = srv.log_tail(20000)
    figures["engine start-up failure"] = {"exit_code": code, "temp_files_left": len(temp_left)}
    assert code != 0, log
    # The failure is the engine core's (after the ipc endpoints existed).
    assert "Engine core initialization failed" in log, log[-3000:]
    assert not leftovers, leftovers
    assert not temp_left, f"left in the server's TMPDIR after a failed start-up: {temp_left}"


def _wait_for_exit(srv: VllmServer) -> tuple[int, list, list[str]]:
    """(exit code, processes left, files left in its TMPDIR) of a server that must exit."""
    try:
        code = srv.wait_exit(EXIT_BOUND_S)
        return code, srv.leftovers(grace_s=CHILD_EXIT_GRACE_S), srv.temp_files_left()
    except subprocess.TimeoutExpired:
        pytest.fail(f"vllm serve still runs after {EXIT_BOUND_S} s:\n{srv.log_tail()}")
    finally:
        srv.stop()
