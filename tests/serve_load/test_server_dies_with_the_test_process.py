"""A server a test starts does not outlive the test process, even when that
process is killed with SIGKILL (a CI timeout, an out-of-memory kill), where no
fixture teardown runs.

A stand-in test process starts a server through VllmServer.spawn, the path
every server of the suite takes, with `vllm serve` replaced by a command that
would otherwise run for ten minutes, and is then killed with SIGKILL: the
server must be gone within seconds (Linux's parent-death signal sends it
SIGTERM, which `vllm serve` handles as Ctrl-C, stopping its engines)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from repo_paths import TOOLS_LIB

TEST_PROCESS = """
import sys, time
sys.path.insert(0, sys.argv[1])
import vllm_server

vllm_server.vllm_cli = lambda: [sys.executable, "-c", "import time; time.sleep(600)", "--"]
server = vllm_server.VllmServer("model", [], sys.argv[2]).spawn()
print("PID", server.proc.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_server_dies_when_its_test_process_is_killed(tmp_path):
    test_process = subprocess.Popen(
        [sys.executable, "-c", TEST_PROCESS, str(TOOLS_LIB), str(tmp_path / "server.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = ""
        while not line.startswith("PID "):  # after the server's own "starting" line
            line = test_process.stdout.readline()
            assert line, f"the stand-in test process ended (return code {test_process.poll()})"
        server_pid = int(line.split()[1])
        server = psutil.Process(server_pid)
        assert server.is_running() and server.status() != psutil.STATUS_ZOMBIE
        assert "time.sleep(600)" in " ".join(server.cmdline()), server.cmdline()
        os.kill(test_process.pid, signal.SIGKILL)
        test_process.wait(timeout=10)
        deadline = time.monotonic() + 10
        while server.is_running() and server.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = server.is_running() and server.status() != psutil.STATUS_ZOMBIE
        assert not alive, f"server {server_pid} still running 10 s after its test process was killed"
    finally:
        if test_process.poll() is None:
            test_process.kill()
        try:
            psutil.Process(server_pid).kill()
        except (psutil.NoSuchProcess, NameError, UnboundLocalError):
            pass
