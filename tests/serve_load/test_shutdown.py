"""SIGTERM while the server is under load: the server and every process it
started exit within a bounded time (a hang detector, not a speed check), no
process, shared-memory segment or file in its temp directory (ZeroMQ ipc
socket files included) is left behind, and every client sees its response
end visibly: complete, or cut with finish_reason "abort" -- streams of
requests still queued included.

Runs after the other tests of this directory (it ends the session server)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
import serve_workload as workload
from process_resources import shm_segments_of, unix_socket_files_of

SHUTDOWN_BOUND_S = 60
LOAD_BEFORE_SIGTERM_TIMEOUT_S = 120


# Requests still queued at SIGTERM are aborted before their first token; on
# 0.21.0 their streams ended with [DONE] and no finish_reason (patch 0011,
# whose necessity proof is the server-free test below).
def test_sigterm_under_load_leaves_nothing_behind(live_server, references, figures):
    srv = live_server
    tree = srv.tree()
    shm = shm_segments_of(tree)
    sockets = unix_socket_files_of(tree)
    outcomes: list = []
    client_error: list[BaseException] = []

    def load():
        try:
            outcomes.extend(
                workload.run_jobs(
                    srv.base, srv.model, workload.SHUTDOWN_JOBS, concurrency=len(workload.SHUTDOWN_JOBS), timeout=120
                )[0]
            )
        except BaseException as e:  # reported by the assertion below, not lost in the thread
            client_error.append(e)

    clients = threading.Thread(target=load)
    before = srv.metrics()
    clients.start()
    # SIGTERM while requests are decoding.
    deadline = time.monotonic() + LOAD_BEFORE_SIGTERM_TIMEOUT_S
    while True:
        m = srv.metrics()
        # Any request decoding is enough: on 2 busy cores the /metrics poll can
        # miss the moment all MAX_NUM_SEQS run together.
        if m.get("vllm:num_requests_running", 0) >= 1 and workload.delta(before, m, "vllm:generation_tokens_total") > 0:
            break
        assert clients.is_alive(), (
            f"the load ended before SIGTERM could be sent: {len(outcomes)} outcomes "
            f"({sum(o.ok for o in outcomes)} ok), client error {client_error!r}, last /metrics: "
            f"running {m.get('vllm:num_requests_running')}, generated since the start "
            f"{workload.delta(before, m, 'vllm:generation_tokens_total')}\n{srv.log_tail(3000)}"
        )
        assert time.monotonic() < deadline, "the load never started decoding"
        time.sleep(0.1)
    seconds, code, survivors = srv.terminate(timeout=SHUTDOWN_BOUND_S)
    clients.join(timeout=150)
    leftovers = srv.leftovers()
    temp_left = srv.temp_files_left()
    shm_left = sorted(s for s in shm if Path(s).exists())
    sockets_left = sorted(s for s in sockets if Path(s).exists())
    completed = [o for o in outcomes if o.ok and o.finish_reason == "length"]
    cut = [o for o in outcomes if o.ok and o.finish_reason == "abort"]
    failed = [o for o in outcomes if not o.ok]
    report, bad = workload.check(completed, references)
    prefixes = workload.check_prefixes(cut, references)
    figures["sigterm under load"] = {
        "sent": len(workload.SHUTDOWN_JOBS),
        "completed": len(completed),
        "finish_reason_abort": len(cut),
        "errors": len(failed),
        "exit_code": code,
        "exit_s": round(seconds, 2),
        "processes": len(tree),
        "shm_segments": len(shm),
        "processes_left": len(leftovers),
        "shm_left": len(shm_left),
        "ipc_socket_files": len(sockets),
        "ipc_socket_files_left": len(sockets_left),
        "temp_files_left": len(temp_left),
        **{f"completed_{k}": v for k, v in report.summary().items()},
        **{f"cut_prefix_{k}": v for k, v in prefixes.summary().items() if k != "rule"},
    }
    print(f"\n[serve-load] sigterm: {figures['sigterm under load']}")
    assert not survivors, f"still alive {SHUTDOWN_BOUND_S} s after SIGTERM: {survivors}\n{srv.log_tail()}"
    assert not leftovers, f"processes left behind: {leftovers}"
    assert not shm_left, f"shared memory left behind: {shm_left}"
    assert not sockets_left and not temp_left, (
        f"left in the server's TMPDIR: {temp_left}; ipc socket files the server held that still exist: {sockets_left}"
    )
    assert code == 0, f"exit code {code} after SIGTERM:\n{srv.log_tail()}"
    assert not clients.is_alive(), "a client still waits on the stopped server"
    assert len(outcomes) == len(workload.SHUTDOWN_JOBS)
    # Every request ends visibly: complete and equal to the reference, or
    # cut short with finish_reason "abort" (vLLM aborts in-flight requests
    # at shutdown) and a prefix of the reference, or an error.
    unclear = [
        (o.job.key, "stream" if o.job.stream else "plain", len(o.token_ids), o.finish_reason)
        for o in outcomes
        if o.ok and o.finish_reason not in ("length", "abort")
    ]
    assert not unclear, f"responses neither complete nor cut (key, kind, tokens, finish_reason): {unclear}"
    assert not bad, bad[:10]
    assert prefixes.ok, prefixes.explain()
    for o in cut:
        assert len(o.token_ids) < len(references[o.job.key]["token_ids"]), o.job.key
        assert o.completion_tokens in (None, len(o.token_ids)), (o.job.key, o.completion_tokens)
    for o in failed:
        assert o.error, o


@pytest.mark.needs_patch("0011")
def test_stream_of_a_request_aborted_before_its_first_token_has_its_finish_reason():
    """No server: the completions stream generator fed what the engine gives
    a request that SIGTERM aborted while still queued -- one finished output
    with no token. Its stream must carry a choice with finish_reason "abort"
    before the usage chunk and [DONE] (the chat generator has the same guard
    and is checked through the real server above)."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.engine.protocol import RequestResponseMetadata
    from vllm.outputs import CompletionOutput, RequestOutput

    # Only the attributes the generator reads; no engine behind it.
    serving = object.__new__(OpenAIServingCompletion)
    serving.enable_force_include_usage = False
    serving.enable_prompt_tokens_details = False
    serving.system_fingerprint = None
    request = CompletionRequest(
        model="m", prompt="hello", max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    aborted = RequestOutput(
        request_id="r",
        prompt="hello",
        prompt_token_ids=[1, 2, 3],
        prompt_logprobs=None,
        outputs=[
            CompletionOutput(
                index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None, finish_reason="abort"
            )
        ],
        finished=True,
    )

    async def engine_outputs():
        yield 0, aborted

    async def stream():
        return [
            chunk
            async for chunk in serving.completion_stream_generator(
                request, [None], engine_outputs(), "r", 0, "m", 1, None, RequestResponseMetadata(request_id="r")
            )
        ]

    chunks = asyncio.run(stream())
    events = [json.loads(c[len("data: ") :]) for c in chunks if c.startswith("data: {")]
    reasons = [choice.get("finish_reason") for e in events for choice in e.get("choices", [])]
    assert reasons == ["abort"], chunks
    assert chunks[-1] == "data: [DONE]\n\n", chunks
