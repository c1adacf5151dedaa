"""`vllm serve` stopped by SIGINT sent to its own process only (as `kill -INT
PID` or a supervisor that signals one process does): every process it
started exits and nothing is left in its temp directory. The other ways of
stopping are checked where a server already runs: Ctrl-C (SIGINT to the
process group) in test_readme_quickstart.py, SIGTERM under load in
tests/serve_load/test_shutdown.py, a failed start-up in
tests/serve_load/test_startup.py. This one starts a server of its own, so it
is `extended`: `bash tools/run_tests.sh -m extended` (a CI job of its own)."""

from __future__ import annotations

import signal

import pytest
from vllm_server import ServerExited

STOP_BOUND_S = 60


# A server start of its own for one more way of stopping: outside the
# every-commit run (`tools/run_tests.sh -m extended`; a CI job of its own).
@pytest.mark.extended
def test_sigint_to_vllm_serve_leaves_nothing_behind(partial_pair_server, measurements):
    srv = partial_pair_server
    try:
        try:
            srv.start()
        except (ServerExited, TimeoutError) as e:
            pytest.fail(str(e))
        processes = len(srv.tree())
        seconds, code, survivors = srv.signal(signal.SIGINT, timeout=STOP_BOUND_S)
        leftovers, temp_left = srv.leftovers(), srv.temp_files_left()
    finally:
        srv.stop()
    measurements["vllm serve stopped by SIGINT to its own process"] = {
        "processes": processes,
        "exit_code": code,
        "exit_s": round(seconds, 1),
        "temp_files_left": len(temp_left),
    }
    assert not survivors, f"still alive {STOP_BOUND_S} s after SIGINT: {survivors}\n{srv.log_tail()}"
    assert not leftovers, leftovers
    assert not temp_left, f"left in the server's TMPDIR: {temp_left}"
