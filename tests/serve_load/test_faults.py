"""Faults against the running DFlash + fp8 server: each gets a clear error
(HTTP status and message) or a clean cancellation, and the next greedy
request is still answered with the target-only output (token for token:
float32, tests/support/lossless.py)."""

from __future__ import annotations

import json
import math

import pytest
import serve_workload as workload


def _error(status: int, text: str) -> dict:
    body = json.loads(text)
    assert "error" in body, text[:500]
    assert body["error"]["code"] == status, body
    return body["error"]


def _abandon(srv, references, figures, scenario: str, jobs, healthy, **run_kw):
    """Run abandoned ``jobs`` next to ``healthy`` ones; return the outcomes
    of both after checking the engine let go of every abandoned request."""
    before = srv.metrics()
    outs, wall = workload.run_jobs(
        srv.base, srv.model, [*jobs, *healthy], concurrency=len(jobs) + len(healthy), **run_kw
    )
    after = workload.wait_idle(srv)
    abandoned = {j.key for j in jobs}
    gone = [o for o in outs if o.job.key in abandoned and not o.ok]
    kept = [o for o in outs if o.job.key not in abandoned]
    healthy_report, bad = workload.check(kept, references)
    # What an abandoned client did get is the start of the reference output.
    prefixes = workload.check_prefixes([o for o in outs if o.job.key in abandoned and o.token_ids], references)
    figures[scenario] = {
        "abandoned_sent": len(jobs),
        "abandoned": len(gone),
        "abandoned_completed_anyway": len(jobs) - len(gone),
        "healthy_sent": len(healthy),
        "healthy_completed": sum(o.ok for o in kept),
        **{f"healthy_{k}": v for k, v in healthy_report.summary().items()},
        **{f"abandoned_prefix_{k}": v for k, v in prefixes.summary().items() if k != "rule"},
        "drafts_during": int(workload.delta(before, after, "vllm:spec_decode_num_drafts_total")),
        "wall_s": round(wall, 2),
    }
    print(f"\n[serve-load] {scenario}: {figures[scenario]}")
    assert gone, f"no request was abandoned: {[(o.job.key, o.latency_s) for o in outs]}"
    # The engine dropped them: nothing left running or queued, no KV block held.
    assert after.get("vllm:num_requests_running", 0) == 0, after.get("vllm:num_requests_running")
    assert after.get("vllm:num_requests_waiting", 0) == 0, after.get("vllm:num_requests_waiting")
    assert after.get("vllm:kv_cache_usage_perc", 0) == 0, "KV blocks of abandoned requests leaked"
    assert workload.delta(before, after, "vllm:spec_decode_num_drafts_total") > 0
    assert prefixes.ok, f"partial outputs differ: {prefixes.explain()}"
    assert not bad, bad[:10]
    return outs


def test_clients_disconnecting_mid_stream_are_cancelled(live_server, load_jobs, references, figures):
    """Streaming clients (completions and chat) that drop the connection
    after a few chunks, while healthy requests share the batch."""
    srv = live_server
    streams = [j for j in workload.ABANDONED_JOBS if j.stream]
    disconnect = {j.key: 2 + i for i, j in enumerate(streams)}
    outs = _abandon(
        srv, references, figures, "disconnect mid-stream", streams, load_jobs[:8], disconnect_after=disconnect
    )
    for o in outs:
        if o.job.key in disconnect:
            assert o.status == 200 and o.error == "client disconnected on purpose", (o.status, o.error)
            assert o.chunks == disconnect[o.job.key]
    workload.assert_still_serving(srv, references)


def test_requests_abandoned_while_drafting_are_aborted(live_server, references, figures):
    """Non-streaming clients that give up (client timeout) while their
    requests decode with drafts in flight."""
    srv = live_server
    waiting = [j for j in workload.ABANDONED_JOBS if not j.stream]
    outs = _abandon(srv, references, figures, "abort while drafting", waiting, [], timeout=0.5)
    for o in outs:
        if not o.ok:
            assert "Timeout" in o.error, o.error
        else:  # finished before the client gave up: then it must be right
            assert not workload.problems(o, references[o.job.key])
    workload.assert_still_serving(srv, references)


@pytest.mark.parametrize(
    "api, stream, prompt_len, max_tokens",
    [
        ("completions", False, workload.MAX_MODEL_LEN, 1),  # at max_model_len: no room for a token
        ("completions", True, workload.MAX_MODEL_LEN, 1),
        ("completions", False, workload.MAX_MODEL_LEN + 44, 8),  # over
        ("completions", False, workload.MAX_MODEL_LEN - 6, 7),  # prompt fits, prompt + max_tokens not
        ("chat", False, workload.MAX_MODEL_LEN + 44, 4),
        ("chat", True, workload.MAX_MODEL_LEN + 44, 4),
    ],
)
def test_prompt_at_or_over_max_model_len_is_refused(live_server, references, api, stream, prompt_len, max_tokens):
    srv = live_server
    body = {"model": srv.model, "max_tokens": max_tokens, "stream": stream}
    if api == "completions":
        body["prompt"] = [65] * prompt_len
    else:
        body["messages"] = [{"role": "user", "content": "a" * prompt_len}]
    status, text = srv.post(f"/v1/{'completions' if api == 'completions' else 'chat/completions'}", body)
    assert status == 400, text[:500]
    err = _error(status, text)
    assert f"maximum context length is {workload.MAX_MODEL_LEN} tokens" in err["message"], err
    workload.assert_still_serving(srv, references)


def test_prompt_plus_max_tokens_equal_to_max_model_len_is_served(live_server, references, figures):
    """The last position a request may reach; DFlash drafts past it must
    not change what the target emits."""
    srv = live_server
    outs, _ = workload.run_jobs(srv.base, srv.model, workload.BOUNDARY_JOBS, concurrency=len(workload.BOUNDARY_JOBS))
    report, bad = workload.check(outs, references)
    figures["at max_model_len"] = {"sent": len(outs), "completed": sum(o.ok for o in outs), **report.summary()}
    assert not bad, bad
    workload.assert_still_serving(srv, references)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "raw", [b'{"model": ', b"not json at all", b'{"max_tokens": 4,,}'], ids=["truncated", "not-json", "double-comma"]
)
def test_malformed_json_is_a_400(live_server, references, path, raw):
    srv = live_server
    status, text = srv.post(path, raw)
    assert status == 400, text[:500]
    assert "JSON decode error" in _error(status, text)["message"]
    workload.assert_still_serving(srv, references)


@pytest.mark.needs_patch("0008")
@pytest.mark.parametrize("body", [[1, 2], "a prompt", None, 42, True])
def test_request_models_refuse_json_that_is_not_an_object(body):
    """No server: what the route's body validation does with such input."""
    import pydantic

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    for model in (CompletionRequest, ChatCompletionRequest):
        with pytest.raises(pydantic.ValidationError, match="expected a JSON object"):
            model.model_validate(body)


# The same through the real server. Patch 0008's proof of necessity uses the
# test above (it fails without the patch just as surely, and needs no server).
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("raw", [b"[1, 2]", b'"a prompt"', b"null", b"42"], ids=["array", "string", "null", "number"])
def test_json_that_is_not_an_object_is_a_400(live_server, references, path, raw):
    srv = live_server
    status, text = srv.post(path, raw)
    assert status == 400, text[:500]
    assert "expected a JSON object" in _error(status, text)["message"]
    workload.assert_still_serving(srv, references)


@pytest.mark.parametrize("max_tokens", [0, -1])
@pytest.mark.parametrize(
    "api, stream", [("completions", False), ("completions", True), ("chat", False), ("chat", True)]
)
def test_max_tokens_below_one_is_a_400(live_server, references, max_tokens, api, stream):
    srv = live_server
    job = workload.Job(
        "max-tokens", api, stream, prompt=tuple(b"hello"), messages=(("user", "hello"),), max_tokens=max_tokens
    )
    status, text = srv.post(job.path, job.body(srv.model))
    assert status == 400, text[:500]
    assert f"max_tokens must be at least 1, got {max_tokens}" in _error(status, text)["message"]
    workload.assert_still_serving(srv, references)


# JSON as the server reads it allows NaN and Infinity literals (json.dumps
# writes them); the server-free check is tests/engine/test_non_finite_sampling_parameters.py.
@pytest.mark.parametrize(
    "name, value", [("temperature", math.nan), ("temperature", math.inf), ("repetition_penalty", math.nan)]
)
@pytest.mark.parametrize("api, stream", [("completions", False), ("chat", True)])
def test_non_finite_sampling_parameter_is_a_400(live_server, references, name, value, api, stream):
    srv = live_server
    job = workload.Job("non-finite", api, stream, prompt=tuple(b"hello"), messages=(("user", "hello"),), max_tokens=4)
    status, text = srv.post(job.path, json.dumps({**job.body(srv.model), name: value}).encode())
    assert status == 400, text[:500]
    assert f"{name} must be a finite number" in _error(status, text)["message"]
    workload.assert_still_serving(srv, references)


@pytest.mark.parametrize("api, stream", [("completions", False), ("chat", True)])
def test_unknown_model_is_a_404(live_server, references, api, stream):
    srv = live_server
    job = workload.Job(
        "unknown-model", api, stream, prompt=tuple(b"hello"), messages=(("user", "hello"),), max_tokens=4
    )
    status, text = srv.post(job.path, job.body("no-such-model"))
    assert status == 404, text[:500]
    assert "The model `no-such-model` does not exist." in _error(status, text)["message"]
    workload.assert_still_serving(srv, references)
