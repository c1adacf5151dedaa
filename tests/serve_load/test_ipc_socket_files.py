"""ZeroMQ ipc:// endpoints leave no socket files behind.

libzmq never unlinks the file of a bound ipc:// endpoint, and vLLM 0.21.0
named every endpoint VLLM_RPC_BASE_PATH/<uuid4>: each `vllm serve` start left
six files in /tmp, whatever the way it stopped. These checks run the fork's
endpoint helper in small subprocesses, each with a base path of its own, and
look at what is left there: an orderly exit (of a process and of a spawned
child that made endpoints too) leaves nothing, and a directory left by a
killed process goes when the next process makes its endpoints. The real
server's stop paths are checked in test_shutdown.py and test_startup.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

TIMEOUT_S = 120

# Binds a ROUTER socket on a fresh endpoint in this process and in a spawned
# child (vLLM's engine core and workers are such children), then ends as
# argv[1] says: "exit" (orderly) or "kill" (SIGKILL, as the OOM killer would).
BIND_AND_END = textwrap.dedent("""
    import multiprocessing as mp, os, signal, sys
    import zmq
    from vllm.utils.network_utils import get_open_zmq_ipc_path

    def bind(conn):
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.bind(get_open_zmq_ipc_path())
        conn.send("bound")
        conn.recv()

    if __name__ == "__main__":
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.bind(get_open_zmq_ipc_path())
        parent, child = mp.get_context("spawn").Pipe()
        proc = mp.get_context("spawn").Process(target=bind, args=(child,))
        proc.start()
        assert parent.poll(60) and parent.recv() == "bound", "the child did not bind"
        print("files while running:", sorted(os.listdir(os.environ["VLLM_RPC_BASE_PATH"])), flush=True)
        if sys.argv[1] == "kill":
            proc.kill()
            os.kill(os.getpid(), signal.SIGKILL)
        parent.send("done")
        proc.join()
""")


@pytest.fixture
def ipc_base():
    # Short: a unix socket path must fit in 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="vt-ipc-"))
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


@pytest.fixture
def run_endpoints(tmp_path):
    # A file, not -c: a spawned child imports its target from the main module.
    script = tmp_path / "bind_and_end.py"
    script.write_text(BIND_AND_END)

    def run(base: Path, how: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "VLLM_RPC_BASE_PATH": str(base)}
        return subprocess.run(
            [sys.executable, str(script), how], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S
        )

    return run


def everything_under(base: Path) -> list[str]:
    return sorted(str(p.relative_to(base)) for p in base.rglob("*"))


def describe(run: subprocess.CompletedProcess) -> str:
    code = run.returncode
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"rc={code}"
    return f"{how}\n--- stdout ---\n{run.stdout[-3000:]}\n--- stderr ---\n{run.stderr[-3000:]}"


@pytest.mark.needs_patch("0013")
def test_orderly_exit_leaves_no_socket_files(ipc_base, run_endpoints):
    run = run_endpoints(ipc_base, "exit")
    assert run.returncode == 0, describe(run)
    assert "files while running: ['" in run.stdout, describe(run)
    left = everything_under(ipc_base)
    assert not left, f"left under VLLM_RPC_BASE_PATH after an orderly exit: {left}\n{describe(run)}"


@pytest.mark.needs_patch("0013")
def test_files_of_a_killed_process_go_with_the_next_start(ipc_base, run_endpoints):
    killed = run_endpoints(ipc_base, "kill")
    assert killed.returncode == -signal.SIGKILL, describe(killed)
    after_kill = everything_under(ipc_base)
    # A killed process runs no clean-up; what it leaves must not pile up.
    assert after_kill, "a SIGKILLed process left nothing: the check would prove nothing"
    run = run_endpoints(ipc_base, "exit")
    assert run.returncode == 0, describe(run)
    left = everything_under(ipc_base)
    assert not left, f"left after a killed run ({after_kill}) and an orderly one: {left}\n{describe(run)}"
