"""A Ray cluster of one or two nodes on this machine, for the tests of vLLM on Ray.

Each node is a `ray start --block` process of its own, on its own loopback
address (127.0.0.1 for the head, 127.0.0.2 for the other: Linux routes all
of 127.0.0.0/8 to this machine, and Ray tells nodes apart by address), with
one CPU to offer, so that the two ranks of a TP=2 placement group land on
different nodes as on two machines. Every process a node starts (its raylet,
the head's GCS, the worker actors vLLM creates there) inherits a tag
variable, so a test can kill a node as a machine that goes down and find
whatever outlived a stop. The cluster writes its session files into a temp
directory of its own, removed at the end.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
from vllm_server import TAG_VAR, free_port, log_tail, start_logged, still_running, tagged_processes

JOIN_TIMEOUT_S = 120
# What every process of the cluster, drivers included, runs with. Ray 2.60
# turns token authentication on for a head that `ray start` makes, and a
# node or driver without the token is refused; this cluster listens on
# loopback addresses only.
CLUSTER_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


class RayNode:
    def __init__(self, ip: str, log_path: Path, args: list[str], num_cpus: int = 1):
        self.ip = ip
        self.tag = uuid.uuid4().hex
        self.log_path = log_path
        ray_cli = str(Path(sys.executable).with_name("ray"))
        self.cmd = [ray_cli, "start", "--block", "--node-ip-address", ip, "--num-cpus", str(num_cpus), *args]
        self.env = {**os.environ, **CLUSTER_ENV, "VLLM_HOST_IP": ip, TAG_VAR: self.tag}
        self.proc: subprocess.Popen | None = None
        self._logf = None

    def start(self) -> RayNode:
        self.proc, self._logf = start_logged(self.cmd, self.log_path, self.env)
        return self

    def log_tail(self, n: int = 3000) -> str:
        return log_tail(self.log_path, n)

    def processes(self) -> list[psutil.Process]:
        return tagged_processes(self.tag)

    def kill(self) -> None:
        """SIGKILL every process of the node at once, as when its machine goes down."""
        for p in self.processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()

    def stop(self, timeout: float = 30) -> list[psutil.Process]:
        """`ray start --block` stops its node on SIGTERM; whatever of the node
        is alive after ``timeout`` is killed and returned."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and [p for p in self.processes() if still_running(p)]:
            time.sleep(0.5)
        survivors = [p for p in self.processes() if still_running(p)]
        self.kill()
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        if self._logf is not None:
            self._logf.close()
            self._logf = None
        return survivors


class LocalRayCluster:
    """The head on 127.0.0.1 and a second node on 127.0.0.2 (or the head
    alone, with ``num_cpus``); a driver (`vllm serve`) joins with
    ``driver_env``. Every node goes when the test process does, killed or
    not (`ray start --block` stops its node on the SIGTERM it then gets)."""

    def __init__(self, log_dir: Path, nodes: int = 2, num_cpus: int = 1):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.driver_env = {**CLUSTER_ENV, "RAY_ADDRESS": self.address, "VLLM_HOST_IP": "127.0.0.1"}
        # Short: Ray's unix sockets live under it (107 bytes at most).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ray-"))
        self.head = RayNode(
            "127.0.0.1",
            log_dir / "ray-head.log",
            ["--head", "--port", str(self.port), "--include-dashboard=false", "--temp-dir", str(self.temp_dir)],
            num_cpus,
        )
        self.other = RayNode(
            "127.0.0.2",
            log_dir / "ray-node1.log",
            ["--address", self.address, "--temp-dir", str(self.temp_dir)],
            num_cpus,
        )
        self.nodes = [self.head, self.other][:nodes]

    def _alive_nodes(self) -> int:
        """Nodes the cluster counts alive, asked by a driver of its own (a
        driver in the test process would stay connected)."""
        probe = [
            sys.executable,
            "-c",
            "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
            "print(sum(n['Alive'] for n in ray.nodes()))",
            self.address,
        ]
        env = {**os.environ, **CLUSTER_ENV, "VLLM_HOST_IP": "127.0.0.1"}
        out = subprocess.run(probe, capture_output=True, text=True, timeout=60, env=env)
        return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else 0

    def start(self) -> LocalRayCluster:
        self.head.start()
        for node in self.nodes[1:]:
            time.sleep(2)
            node.start()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while self._alive_nodes() < len(self.nodes):
            for node in self.nodes:
                if node.proc.poll() is not None:
                    raise RuntimeError(f"a Ray node exited with {node.proc.returncode}:\n{node.log_tail()}")
            if time.monotonic() > deadline:
                logs = "\n".join(node.log_tail() for node in self.nodes)
                raise TimeoutError(f"{len(self.nodes)} Ray nodes not alive after {JOIN_TIMEOUT_S} s:\n{logs}")
            time.sleep(1)
        return self

    def stop(self) -> list[psutil.Process]:
        """Every node stopped (the head last); what outlived its SIGTERM."""
        survivors = [p for node in reversed(self.nodes) for p in node.stop()]
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return survivors

    def __enter__(self) -> LocalRayCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
