"""`vllm serve` whose engine dies while serving exits with an error status.

A supervisor (systemd's Restart=on-failure, a container orchestrator's
restart policy) restarts a service only when it fails; vLLM 0.21.0's API
server stopped after its engine died and exited with status 0, as after a
requested shutdown (vllm-project/vllm#48966). Here the engine core process
is killed under a running server (as the out-of-memory killer or a crash
would end it): the request in flight ends with an error, the server exits
by itself with a non-zero status and says why, and nothing it started is
left. A lost node of a multi-node run ends the same way
(tests/cpu_e2e/test_dflash_scale_out.py).
"""

from __future__ import annotations

import signal
import threading
import time

import dflash_settings
import pytest
from vllm_server import VllmServer

EXIT_BOUND_S = 60


def _engine_core(srv: VllmServer):
    for proc in srv.tree():
        try:
            if "EngineCore" in proc.name() or "EngineCore" in " ".join(proc.cmdline()):
                return proc
        except Exception:  # a process that exits while being asked
            continue
    return None


@pytest.mark.needs_patch("0031")
def test_a_server_whose_engine_died_exits_with_an_error_status(partial_pair_server, measurements):
    srv = partial_pair_server
    try:
        srv.start()
        engine = _engine_core(srv)
        assert engine is not None, [p.name() for p in srv.tree()]
        answer = {}
        body = {
            "model": srv.model_id(),
            # Eight long completions in one request: it is still running when
            # the engine dies, however fast the machine decodes.
            "prompt": ["a"] * 8,
            "max_tokens": dflash_settings.MAX_MODEL_LEN - 8,
            "ignore_eos": True,
            "temperature": 0.0,
        }

        def ask():
            try:
                answer["status"] = srv.post("/v1/completions", body)[0]
            except Exception as e:  # the connection ended without a response: an error too
                answer["status"] = f"no response ({type(e).__name__})"

        request = threading.Thread(target=ask)
        request.start()
        srv.wait_until_running()
        t0 = time.monotonic()
        engine.send_signal(signal.SIGKILL)
        code = srv.proc.wait(timeout=EXIT_BOUND_S)
        exit_s = time.monotonic() - t0
        request.join(timeout=EXIT_BOUND_S)
        left = srv.leftovers(grace_s=30)
        left_s = time.monotonic() - t0
        log = srv.log_tail(100_000)
    finally:
        srv.stop()
    measurements["engine killed: server exit"] = {
        "code": code,
        "exit s": round(exit_s, 1),
        "request status": answer.get("status"),
        "left": len(left),
        "all gone s": round(left_s, 1),
        "start s": round(srv.start_s, 1),
    }
    status = answer.get("status")
    assert isinstance(status, str) or status >= 500, answer
    assert code != 0, f"vllm serve exited {code} after its engine died:\n{log[-3000:]}"
    assert "engine died" in log, log[-3000:]
    assert not left, left
