"""`vllm serve` (the real CLI) with DFlash and an fp8 KV cache (test 7).

Offline outputs are computed first (one engine at a time), then the server
is started on 127.0.0.1 on a free port and queried; the last test stops it
as Ctrl-C in a terminal does, and it is always killed at the end.
"""

from __future__ import annotations

import json
import signal

import pytest

import dflash_e2e as e2e
from vllm_server import VllmServer, vllm_dist_skip_reason


MAX_TOKENS = 48
PROMPT = "The quick brown fox jumps over the lazy dog."
MESSAGES = [{"role": "user", "content": "Say something about foxes."}]


@pytest.fixture(scope="module")
def offline(partial_pair):
    if reason := vllm_dist_skip_reason():
        pytest.skip(reason)
    llm = e2e.start_dflash_fp8("dflash-serve-offline", partial_pair)
    sp = e2e.greedy_params(MAX_TOKENS)
    completion = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]
    chat = llm.chat(MESSAGES, sp, use_tqdm=False)[0].outputs[0]
    e2e.shutdown_llm()
    return {"completion": completion.text, "chat": chat.text,
            "completion_ids": list(completion.token_ids)}


@pytest.fixture(scope="module")
def server(offline, partial_pair, tmp_path_factory):
    target, draft = partial_pair
    srv = VllmServer(target, e2e.dflash_fp8_serve_args(draft), tmp_path_factory.mktemp("serve") / "server.log")
    try:
        srv.start()
    except Exception as e:
        pytest.fail(str(e))
    try:
        yield srv
    finally:
        srv.stop()


def _served_model(srv: VllmServer) -> str:
    return srv.model_id()


def test_serve_completions_equal_offline(server, offline):
    body = {"model": _served_model(server), "prompt": PROMPT, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True}
    status, text = server.post("/v1/completions", body)
    got = json.loads(text)["choices"][0]["text"]
    print(f"\n[e2e] /v1/completions: {status}, {len(got)} chars, equal offline: {got == offline['completion']}")
    assert status == 200
    assert got == offline["completion"]


def test_serve_chat_completions_equal_offline(server, offline):
    body = {"model": _served_model(server), "messages": MESSAGES, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True}
    status, text = server.post("/v1/chat/completions", body)
    got = json.loads(text)["choices"][0]["message"]["content"]
    print(f"[e2e] /v1/chat/completions: {status}, equal offline: {got == offline['chat']}")
    assert status == 200
    assert got == offline["chat"]


def test_serve_metrics_show_spec_decode_counters(server):
    status, text = server.get("/metrics")
    counters = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            counters[name.split("{")[0]] = counters.get(name.split("{")[0], 0) + float(value)
    print(f"[e2e] /metrics spec-decode counters: {counters}")
    assert status == 200
    assert counters.get("vllm:spec_decode_num_drafts_total", 0) > 0
    assert counters.get("vllm:spec_decode_num_draft_tokens_total", 0) > 0
    assert "vllm:spec_decode_num_accepted_tokens_total" in counters


STOP_BOUND_S = 60


def test_ctrl_c_leaves_nothing_behind(server, measurements):
    """Ctrl-C in the terminal running `vllm serve`: SIGINT to its whole
    process group. Every process exits, and nothing is left in its temp
    directory (vLLM 0.21.0 left six ZeroMQ ipc socket files there)."""
    seconds, code, survivors = server.signal(signal.SIGINT, group=True, timeout=STOP_BOUND_S)
    temp_left = server.temp_files_left()
    measurements["vllm serve stopped by SIGINT to its process group"] = {
        "exit_code": code, "exit_s": round(seconds, 1), "temp_files_left": len(temp_left)}
    assert not survivors, f"still alive {STOP_BOUND_S} s after SIGINT: {survivors}\n{server.log_tail()}"
    assert not server.leftovers(), server.leftovers()
    assert not temp_left, f"left in the server's TMPDIR: {temp_left}"
