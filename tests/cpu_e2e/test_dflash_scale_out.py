"""DFlash + fp8 KV cache scaled out with vLLM's own engines, on CPU.

What docs/scaling.md tells users to run, with vLLM's mp backend:

- data parallelism in one server (`--data-parallel-size 2`);
- two nodes, here two `vllm serve` processes on this machine meeting over
  127.0.0.1 (the second `--headless`): tensor parallelism across them
  (`--nnodes 2 --node-rank 0|1 --master-addr --master-port`) and data
  parallelism across them (`--data-parallel-size-local 1
  --data-parallel-address --data-parallel-rpc-port`, the second
  `--data-parallel-start-rank 1`);
- the loss of the headless node in the middle of decoding;
- tensor parallelism over vLLM's Ray executor on a Ray cluster of two nodes
  (tests/support/ray_nodes.py: two `ray start` nodes on 127.0.0.1 and
  127.0.0.2), and the loss of the node that holds a worker.

The pair is the text pair in float32 with an fp8 KV cache everywhere. The
reference is one single-process server with the same settings; every
configuration gets the same prompts at once (a load of twelve concurrent
requests) and must answer each exactly as the reference did, and where
there are two engines, both must have drafted and had drafts accepted. A
server is then stopped with SIGTERM and nothing it started may be left.

Each configuration is two or more engine processes on 2 cores, so the
module is `extended` (`bash tools/run_tests.sh -m extended`).
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import dflash_settings
import parallel_workers
import psutil
import pytest
from ray_nodes import LocalRayCluster
from vllm_server import VllmServer, free_port, http

pytestmark = pytest.mark.extended

MAX_TOKENS = 32
# Lines of the text the target was trained on, cut short: their drafts are
# accepted, so each request runs several speculative steps.
PROMPTS = [
    "Beautiful is better than",
    "Explicit is better",
    "Simple is better than",
    "Complex is better",
    "Flat is better",
    "Sparse is",
    "Readability",
    "Special cases aren't",
    "Errors should never",
    "In the face of",
    "Now is better",
    "If the implementation is hard",
]
STOP_TIMEOUT_S = 60
# A lost node must end the requests in flight and the server, not hang them.
NODE_LOSS_BOUND_S = 120
LONG_MAX_TOKENS = 400


def serve_args(draft: str) -> list[str]:
    return dflash_settings.dflash_fp8_serve_args(draft, dtype="float32")


def _env(bind: str) -> dict[str, str]:
    return {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": bind}


def _one(
    srv: VllmServer, model: str, prompt: str, max_tokens: int = MAX_TOKENS, timeout: float = 300
) -> tuple[int, str]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    return http("POST", srv.base + "/v1/completions", body, timeout=timeout)


def complete_concurrently(srv: VllmServer) -> list[str]:
    """Every prompt sent at once; the greedy completions in prompt order."""
    model = srv.model_id()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: _one(srv, model, p), PROMPTS))
    for prompt, (status, text) in zip(PROMPTS, answers):
        assert status == 200, (prompt, status, text[:500])
    return [json.loads(text)["choices"][0]["text"] for _status, text in answers]


def stop_leaving_nothing(*servers: VllmServer) -> dict:
    """SIGTERM the head first (as a service manager would), then the others;
    what each exit took and what any of them left running."""
    report = {}
    for srv in servers:
        seconds, code, survivors = srv.terminate(STOP_TIMEOUT_S)
        left = srv.leftovers(grace_s=5)
        report[srv.log_path.stem] = {"exit_s": round(seconds, 1), "code": code, "left": [p.pid for p in left]}
        srv.stop()
        assert not survivors and not left, (srv.log_path.stem, survivors, left, srv.log_tail())
    return report


def both_engines_drafted(srv: VllmServer) -> dict:
    drafts = srv.metrics_by_engine("vllm:spec_decode_num_drafts_total")
    accepted = srv.metrics_by_engine("vllm:spec_decode_num_accepted_tokens_total")
    assert set(drafts) == {"0", "1"}, drafts
    assert all(drafts[e] > 0 and accepted.get(e, 0) > 0 for e in drafts), (drafts, accepted)
    return {"drafts": drafts, "accepted": accepted}


def _ranks_bind() -> list[str]:
    """One core list per rank (process), from this worker's cores."""
    return parallel_workers.threads_bind_for_ranks(2).split("|")


@pytest.fixture(scope="module")
def reference(text_pair, tmp_path_factory, measurements):
    target, draft = text_pair
    log = tmp_path_factory.mktemp("scale-out") / "reference.log"
    with VllmServer(target, serve_args(draft), log, env=_env(",".join(_ranks_bind()))) as srv:
        texts = complete_concurrently(srv)
        measurements["single process: start s"] = round(srv.start_s, 1)
    return texts


def test_data_parallel_in_one_server(text_pair, reference, tmp_path, measurements):
    target, draft = text_pair
    args = [*serve_args(draft), "--data-parallel-size", "2"]
    srv = VllmServer(target, args, tmp_path / "dp2.log", env=_env("|".join(_ranks_bind())))
    try:
        srv.start()
        texts = complete_concurrently(srv)
        counters = both_engines_drafted(srv)
        stopped = stop_leaving_nothing(srv)
    finally:
        srv.stop()
    measurements["DP=2: start s"] = round(srv.start_s, 1)
    measurements["DP=2: per engine"] = counters
    measurements["DP=2: stop"] = stopped
    assert texts == reference


def _two_nodes(target: str, head_args: list[str], other_args: list[str], tmp_path) -> tuple[VllmServer, VllmServer]:
    head_bind, other_bind = _ranks_bind()
    other = VllmServer(target, other_args, tmp_path / "node1.log", env=_env(other_bind), headless=True)
    head = VllmServer(target, head_args, tmp_path / "node0.log", env=_env(head_bind))
    return head, other


@contextlib.contextmanager
def _two_nodes_serving(head: VllmServer, other: VllmServer):
    """Both nodes started (the headless one first), both stopped at the end
    whatever happens."""
    try:
        other.start()
        head.start()
        assert other.proc.poll() is None, other.log_tail()
        yield
    finally:
        head.stop()
        other.stop()


def _tensor_parallel_nodes(text_pair, tmp_path) -> tuple[VllmServer, VllmServer]:
    target, draft = text_pair
    port = str(free_port())
    common = [
        *serve_args(draft),
        "--tensor-parallel-size",
        "2",
        "--distributed-executor-backend",
        "mp",
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
    ]
    return _two_nodes(target, [*common, "--node-rank", "0"], [*common, "--node-rank", "1"], tmp_path)


def test_tensor_parallel_across_two_nodes(text_pair, reference, tmp_path, measurements):
    head, other = _tensor_parallel_nodes(text_pair, tmp_path)
    with _two_nodes_serving(head, other):
        texts = complete_concurrently(head)
        metrics = head.metrics()
        stopped = stop_leaving_nothing(head, other)
    measurements["TP=2 over two nodes: start s"] = round(head.start_s, 1)
    measurements["TP=2 over two nodes: stop"] = stopped
    assert metrics.get("vllm:spec_decode_num_accepted_tokens_total", 0) > 0, metrics
    assert texts == reference


def test_data_parallel_across_two_nodes(text_pair, reference, tmp_path, measurements):
    target, draft = text_pair
    port = str(free_port())
    common = [
        *serve_args(draft),
        "--data-parallel-size",
        "2",
        "--data-parallel-size-local",
        "1",
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        port,
    ]
    head, other = _two_nodes(target, common, [*common, "--data-parallel-start-rank", "1"], tmp_path)
    with _two_nodes_serving(head, other):
        texts = complete_concurrently(head)
        counters = both_engines_drafted(head)
        stopped = stop_leaving_nothing(head, other)
    measurements["DP=2 over two nodes: start s"] = round(head.start_s, 1)
    measurements["DP=2 over two nodes: per engine"] = counters
    measurements["DP=2 over two nodes: stop"] = stopped
    assert texts == reference


def lose_a_node_mid_decoding(srv: VllmServer, kill_node) -> tuple[dict, list]:
    """Four long requests to ``srv``; once they decode, ``kill_node()``.
    What happened (the requests still in flight then, their statuses, and
    how long after the loss they ended and the server exited by itself,
    each bounded by NODE_LOSS_BOUND_S: a hang fails here) and the answers."""
    with ThreadPoolExecutor(4) as pool:
        model = srv.model_id()
        pending = [pool.submit(_one, srv, model, prompt, LONG_MAX_TOKENS, NODE_LOSS_BOUND_S) for prompt in PROMPTS[:4]]
        srv.wait_until_running()
        running = [f for f in pending if not f.done()]
        t0 = time.monotonic()
        kill_node()
        answers = [f.result(timeout=NODE_LOSS_BOUND_S) for f in pending]
        ended_s = time.monotonic() - t0
    code = srv.proc.wait(timeout=NODE_LOSS_BOUND_S)
    figures = {
        "in flight": len(running),
        "statuses": [status for status, _text in answers],
        "requests ended s": round(ended_s, 1),
        "server exit": code,
        "server exit s": round(time.monotonic() - t0, 1),
    }
    return figures, answers


def assert_the_loss_ended_requests_and_server(loss: dict, answers: list, left: list) -> None:
    assert loss["in flight"], "every request finished before the node was lost: make them longer"
    assert all(status >= 500 for status in loss["statuses"]), answers
    # It exits by itself (wait() would have timed out otherwise), with an
    # error status (patch 0031; vLLM 0.21.0 exited 0), leaving nothing.
    assert loss["server exit"] != 0 and not left, (loss["server exit"], left)


def test_losing_the_headless_node_mid_decoding_ends_requests_and_server(text_pair, tmp_path, measurements):
    """SIGKILL of the second node (its `vllm serve` and its worker, as a
    machine that goes down) while four long requests decode: each ends with
    an error status, the head's log says a worker's connection broke (not
    which node: vLLM 0.21.0 names the peer's address only), the head exits
    by itself, and nothing is left on either node -- all within
    NODE_LOSS_BOUND_S, where a hang would wait for gloo's 30-minute timeout."""
    head, other = _tensor_parallel_nodes(text_pair, tmp_path)
    with _two_nodes_serving(head, other):
        loss, answers = lose_a_node_mid_decoding(head, lambda: other.signal(signal.SIGKILL, group=True, timeout=10))
        left = head.leftovers(grace_s=10) + other.leftovers(grace_s=10)
        log = head.log_tail(200_000)
    measurements["node loss"] = {**loss, "left": [p.pid for p in left]}
    assert "Worker failed" in log and "by peer" in log, log[-4000:]
    assert_the_loss_ended_requests_and_server(loss, answers, left)


def _ray_tensor_parallel_server(text_pair, cluster: LocalRayCluster, tmp_path) -> VllmServer:
    target, draft = text_pair
    args = [*serve_args(draft), "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"]
    # The engine joins the cluster as a driver on the head's address.
    env = {**_env(",".join(_ranks_bind())), **cluster.driver_env}
    return VllmServer(target, args, tmp_path / "ray-tp2.log", env=env)


def _worker_actors(node) -> list[int]:
    """The vLLM worker actors (Ray names their processes ray::RayWorkerProc) on a node."""
    found = []
    for p in node.processes():
        try:
            if "RayWorkerProc" in " ".join(p.cmdline()):
                found.append(p.pid)
        except psutil.Error:
            continue
    return found


def test_tensor_parallel_over_ray_on_two_nodes(text_pair, reference, tmp_path, measurements):
    with LocalRayCluster(tmp_path) as cluster:
        srv = _ray_tensor_parallel_server(text_pair, cluster, tmp_path)
        try:
            srv.start()
            texts = complete_concurrently(srv)
            metrics = srv.metrics()
            workers = {node.ip: _worker_actors(node) for node in (cluster.head, cluster.other)}
            stopped = stop_leaving_nothing(srv)
        finally:
            srv.stop()
        # The worker actors belong to the Ray nodes, not to the server.
        workers_left = _worker_actors(cluster.head) + _worker_actors(cluster.other)
        survivors = cluster.stop()
    measurements["Ray TP=2 over two nodes: start s"] = round(srv.start_s, 1)
    measurements["Ray TP=2 over two nodes: stop"] = stopped
    measurements["Ray TP=2 over two nodes: worker actors by node"] = workers
    assert all(len(pids) == 1 for pids in workers.values()), workers
    assert metrics.get("vllm:spec_decode_num_accepted_tokens_total", 0) > 0, metrics
    assert texts == reference
    assert not workers_left, workers_left
    assert not survivors, [p.pid for p in survivors]


def test_losing_a_ray_node_mid_decoding_ends_requests_and_server(text_pair, tmp_path, measurements):
    """SIGKILL of every process of the second Ray node (its raylet and the
    worker on it) while four long requests decode: each ends with an error
    status, the server's log names the rank that died, and the server exits
    by itself with an error status, all within NODE_LOSS_BOUND_S."""
    with LocalRayCluster(tmp_path) as cluster:
        srv = _ray_tensor_parallel_server(text_pair, cluster, tmp_path)
        try:
            srv.start()
            loss, answers = lose_a_node_mid_decoding(srv, cluster.other.kill)
            left = srv.leftovers(grace_s=10)
            log = srv.log_tail(2_000_000)
        finally:
            srv.stop()
    measurements["Ray node loss"] = {**loss, "left": [p.pid for p in left]}
    # Rank 1 is the one on the second node (rank 0 is on the driver's).
    assert "RayWorkerProc rank=[1] died unexpectedly" in log, log[-4000:]
    assert_the_loss_ended_requests_and_server(loss, answers, left)
