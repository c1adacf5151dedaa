"""Concurrent OpenAI-API clients for a `vllm serve` under test (httpx, asyncio).

Used by tests/serve_load/. A workload is a
list of :class:`Job` (completions or chat, streaming or not, greedy, fixed
length); :func:`run_jobs` sends them with bounded concurrency and returns one
:class:`Outcome` per job, with the generated token ids as the server
reported them (``return_token_ids``) so outputs compare token for token
(:func:`check`, by the rule of tests/support/lossless.py for MODEL_DTYPE).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
import lossless

CLIENT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Job:
    key: str  # unique per job: the reference output is looked up by it
    api: str  # "completions" or "chat"
    stream: bool
    prompt: tuple[int, ...] | None = None  # token ids (completions)
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) (chat)
    max_tokens: int = 32

    def body(self, model: str) -> dict:
        body = {
            "model": model,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.api == "completions":
            body["prompt"] = list(self.prompt)
        else:
            body["messages"] = [{"role": r, "content": c} for r, c in self.messages]
        return body

    @property
    def path(self) -> str:
        return "/v1/completions" if self.api == "completions" else "/v1/chat/completions"


@dataclass
class Outcome:
    job: Job
    status: int | None = None
    error: str | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None
    completion_tokens: int | None = None
    response_ids: set[str] = field(default_factory=set)
    chunks: int = 0
    latency_s: float = 0.0
    ttft_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def _choice_piece(api: str, choice: dict, stream: bool) -> str:
    if api == "completions":
        return choice.get("text") or ""
    msg = choice.get("delta" if stream else "message") or {}
    return msg.get("content") or ""


def _absorb(out: Outcome, payload: dict, stream: bool) -> None:
    if "id" in payload:
        out.response_ids.add(payload["id"])
    if payload.get("usage"):
        out.completion_tokens = payload["usage"].get("completion_tokens")
    if payload.get("prompt_token_ids") is not None:  # chat: top-level field
        out.prompt_token_ids = list(payload["prompt_token_ids"])
    for choice in payload.get("choices") or []:
        if choice.get("index", 0) != 0:
            raise AssertionError(f"unexpected choice index in {payload}")
        out.text += _choice_piece(out.job.api, choice, stream)
        out.token_ids += list(choice.get("token_ids") or [])
        if choice.get("prompt_token_ids") is not None:  # completions: per choice
            out.prompt_token_ids = list(choice["prompt_token_ids"])
        if choice.get("finish_reason"):
            out.finish_reason = choice["finish_reason"]


async def send(
    client: httpx.AsyncClient, base: str, model: str, job: Job, disconnect_after_chunks: int | None = None
) -> Outcome:
    """One request. With ``disconnect_after_chunks`` the client drops the
    connection after that many stream chunks (a client that goes away)."""
    out = Outcome(job)
    t0 = time.monotonic()
    try:
        if not job.stream:
            r = await client.post(base + job.path, json=job.body(model))
            out.status = r.status_code
            if r.status_code != 200:
                out.error = r.text
            else:
                _absorb(out, r.json(), stream=False)
        else:
            async with client.stream("POST", base + job.path, json=job.body(model)) as r:
                out.status = r.status_code
                if r.status_code != 200:
                    out.error = (await r.aread()).decode()
                else:
                    done = False
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[len("data: ") :]
                        if data == "[DONE]":
                            done = True
                            break
                        if out.ttft_s is None:
                            out.ttft_s = time.monotonic() - t0
                        payload = json.loads(data)
                        if "error" in payload:
                            out.error = json.dumps(payload["error"])
                            break
                        out.chunks += 1
                        _absorb(out, payload, stream=True)
                        if disconnect_after_chunks is not None and out.chunks >= disconnect_after_chunks:
                            out.error = "client disconnected on purpose"
                            break
                    if not done and out.error is None:
                        out.error = "stream ended without [DONE]"
    except (httpx.HTTPError, OSError) as e:
        out.error = f"{type(e).__name__}: {e}"
    out.latency_s = time.monotonic() - t0
    return out


async def _run(
    base: str, model: str, jobs: list[Job], concurrency: int, timeout: float, disconnect_after: dict[str, int]
) -> list[Outcome]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def one(job: Job) -> Outcome:
            async with sem:
                return await send(client, base, model, job, disconnect_after.get(job.key))

        return await asyncio.gather(*(one(j) for j in jobs))


def run_jobs(
    base: str,
    model: str,
    jobs: list[Job],
    concurrency: int,
    timeout: float = CLIENT_TIMEOUT_S,
    disconnect_after: dict[str, int] | None = None,
) -> tuple[list[Outcome], float]:
    """Send every job, at most ``concurrency`` in flight; (outcomes, wall s).
    ``timeout``: the client's per-request timeout (it gives up, the
    connection closes); ``disconnect_after``: job key -> stream chunks after
    which that client drops the connection."""
    t0 = time.monotonic()
    outs = asyncio.run(_run(base, model, jobs, concurrency, timeout, disconnect_after or {}))
    return outs, time.monotonic() - t0


# -- workloads -------------------------------------------------------------

_WORDS = (
    "fox dog draft verify block token cache page speculative accept reject "
    "greedy batch queue server stream chunk prefix decode target model"
).split()


def mixed_jobs(n: int, seed: int, max_tokens: int, prompt_len: tuple[int, int]) -> list[Job]:
    """n jobs cycling over the four kinds (completions/chat x stream/not),
    each with its own seeded prompt, so outputs of different jobs differ."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        api = "completions" if i % 4 < 2 else "chat"
        stream = i % 2 == 1
        length = rng.randint(*prompt_len)
        if api == "completions":
            # printable ASCII bytes: one byte-level token each
            prompt = tuple(rng.randint(32, 126) for _ in range(length))
            jobs.append(Job(f"{seed}-{i}", api, stream, prompt=prompt, max_tokens=max_tokens))
        else:
            words = " ".join(rng.choice(_WORDS) for _ in range(max(1, length // 6)))
            jobs.append(Job(f"{seed}-{i}", api, stream, messages=(("user", f"[{i}] {words}"),), max_tokens=max_tokens))
    return jobs


def reference_outputs(llm, jobs: list[Job]) -> dict[str, dict]:
    """Greedy outputs of an offline engine for each job's prompt (by key):
    {"token_ids", "text", "prompt_token_ids"}."""
    from vllm import SamplingParams

    refs: dict[str, dict] = {}
    by_len: dict[int, list[Job]] = {}
    for j in jobs:
        by_len.setdefault(j.max_tokens, []).append(j)
    for max_tokens, group in by_len.items():
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        comp = [j for j in group if j.api == "completions"]
        chat = [j for j in group if j.api == "chat"]
        if comp:
            outs = llm.generate([{"prompt_token_ids": list(j.prompt)} for j in comp], sp, use_tqdm=False)
            for j, o in zip(comp, outs, strict=True):
                refs[j.key] = {
                    "token_ids": list(o.outputs[0].token_ids),
                    "text": o.outputs[0].text,
                    "prompt_token_ids": list(o.prompt_token_ids),
                }
        if chat:
            outs = llm.chat([[{"role": r, "content": c} for r, c in j.messages] for j in chat], sp, use_tqdm=False)
            for j, o in zip(chat, outs, strict=True):
                refs[j.key] = {
                    "token_ids": list(o.outputs[0].token_ids),
                    "text": o.outputs[0].text,
                    "prompt_token_ids": list(o.prompt_token_ids),
                }
    return refs


def problems(out: Outcome, ref: dict, report: lossless.Report | None = None) -> list[str]:
    """Why this outcome is not the reference output, complete and alone.
    Token ids compare by the suite's lossless rule for MODEL_DTYPE (float32:
    exact, tests/support/lossless.py); with ``report`` the verdict is kept
    there too."""
    j = out.job
    if not out.ok:
        return [f"{j.key}: HTTP {out.status}, {out.error}"]
    bad = []
    verdict = lossless.compare(out.token_ids, ref["token_ids"], dtype=MODEL_DTYPE, key=j.key)
    if report is not None:
        report.add(verdict)
    if not verdict.ok:
        bad.append(
            f"{j.key} ({j.api}, stream={j.stream}): {len(out.token_ids)} tokens vs "
            f"{len(ref['token_ids'])} in the reference, first difference at "
            f"{verdict.parting.position}: {verdict.parting.describe()}"
        )
    if verdict.equal and out.text != ref["text"]:
        bad.append(f"{j.key}: text differs from the reference")
    if out.prompt_token_ids is not None and out.prompt_token_ids != ref["prompt_token_ids"]:
        bad.append(f"{j.key}: prompt token ids differ from the reference")
    if out.finish_reason != "length":
        bad.append(f"{j.key}: finish_reason {out.finish_reason!r}, expected 'length'")
    if out.completion_tokens != j.max_tokens:
        bad.append(f"{j.key}: usage.completion_tokens {out.completion_tokens}, expected {j.max_tokens}")
    if len(out.response_ids) != 1:
        bad.append(f"{j.key}: {len(out.response_ids)} response ids {sorted(out.response_ids)}")
    return bad


def check(outs: list[Outcome], references: dict) -> tuple[lossless.Report, list[str]]:
    """Every outcome against its reference: the lossless report over the
    answered ones (counts for the figures) and every problem found."""
    report = lossless.Report(MODEL_DTYPE)
    bad = [p for o in outs for p in problems(o, references[o.job.key], report)]
    return report, bad


def check_prefixes(outs: list[Outcome], references: dict) -> lossless.Report:
    """Outputs cut short (a client went away, the server stopped): what was
    received is the start of the reference output, token for token."""
    report = lossless.Report(MODEL_DTYPE)
    for o in outs:
        report.compare(o.job.key, o.token_ids, references[o.job.key]["token_ids"], prefix=True)
    return report


def latency_summary(outs: list[Outcome]) -> dict[str, float]:
    lat = sorted(o.latency_s for o in outs if o.ok)
    if not lat:
        return {}
    q = statistics.quantiles(lat, n=100, method="inclusive") if len(lat) > 1 else [lat[0]] * 99
    return {"p50_s": q[49], "p99_s": q[98], "max_s": lat[-1]}


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def wait_idle(server, timeout: float = 30) -> dict[str, float]:
    """/metrics once no request is running or waiting (or at the timeout:
    the caller's assertions then show what is still there)."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.25)


# -- the suite's server and workloads (tests/serve_load) ---------
# The KV cache is tiny on purpose (--num-gpu-blocks-override, which the CPU
# backend honours too): MAX_NUM_SEQS requests cannot all keep their blocks,
# so the scheduler has to preempt (checked on /metrics). The same arguments
# run on a GPU; there VLLM_CPU_KVCACHE_SPACE is ignored.
# The model runs in float32, the server and the reference engine alike, so
# every output must equal the target-only one token for token under any
# batching (tests/support/lossless.py: in bf16 the verification step's
# numerics depend on the batch and outputs may part at near-ties). The KV
# cache stays fp8: its bytes per token do not depend on the model dtype, and
# --num-gpu-blocks-override fixes the block count whatever the dtypes.

MODEL_DTYPE = "float32"
MAX_MODEL_LEN = 256
BLOCK_SIZE = 32
NUM_BLOCKS = 12  # 384 tokens: about two requests of the load at once
MAX_NUM_SEQS = 4
KV_DTYPE = "fp8"

LOAD_REQUESTS = 32
LOAD_CONCURRENCY = 12  # 3 x MAX_NUM_SEQS
LOAD_MAX_TOKENS = 64
LOAD_PROMPT_LEN = (16, 96)

# After every fault: one short greedy request must still match its reference.
FOLLOW_UP = Job(
    "follow-up", "completions", False, prompt=tuple(b"After the fault, the server still answers: "), max_tokens=24
)
# Prompts whose prompt + max_tokens is exactly max_model_len (accepted).
BOUNDARY_JOBS = [
    Job("boundary-250+6", "completions", False, prompt=tuple(b"ABCDE" * 50), max_tokens=6),
    Job("boundary-255+1", "completions", True, prompt=tuple(32 + (i * 7) % 95 for i in range(255)), max_tokens=1),
]
# Enough that the load outlasts the /metrics polls that wait for decoding to
# start, also on a fast CPU whose other core is busy (16, then 48 jobs
# finished first on an AVX-512 EPYC); SIGTERM cuts it short.
SHUTDOWN_JOBS = mixed_jobs(96, seed=2, max_tokens=96, prompt_len=LOAD_PROMPT_LEN)
# Long generations that the clients abandon part-way (disconnect or time out).
ABANDONED_JOBS = mixed_jobs(16, seed=3, max_tokens=160, prompt_len=(16, 64))


def load_jobs() -> list[Job]:
    """LOAD_REQUESTS mixed jobs, and every sixth one (from the first) a
    completion of one of the trained pair's training prompts
    (vllm.fork.tiny_pairs.trained_prompts): the trained drafter drafts those
    continuations nearly token for token and the others hardly at all, so
    accepted and rejected drafts share the preempted batches."""
    from vllm.fork.tiny_pairs import trained_prompts

    jobs = mixed_jobs(LOAD_REQUESTS, seed=1, max_tokens=LOAD_MAX_TOKENS, prompt_len=LOAD_PROMPT_LEN)
    for i, prompt in enumerate(trained_prompts()):
        jobs.insert(
            i * 6,
            Job(f"trained-{i}", "completions", stream=i % 2 == 1, prompt=tuple(prompt), max_tokens=LOAD_MAX_TOKENS),
        )
    return jobs


def server_args(
    spec_config: dict | None, kv_dtype: str = KV_DTYPE, num_blocks: int = NUM_BLOCKS, dtype: str = MODEL_DTYPE
) -> list[str]:
    """`vllm serve` arguments of the suite's server (spec_config None: target only)."""
    return [
        "--dtype",
        dtype,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enforce-eager",
        "--seed",
        "0",
        "--kv-cache-dtype",
        kv_dtype,
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--block-size",
        str(BLOCK_SIZE),
        "--num-gpu-blocks-override",
        str(num_blocks),
    ] + ([] if spec_config is None else ["--speculative-config", json.dumps(spec_config)])


SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def assert_still_serving(server, references: dict) -> None:
    """The next greedy request after a fault is answered, and correctly."""
    out, _ = run_jobs(server.base, server.model, [FOLLOW_UP], concurrency=1)
    bad = problems(out[0], references[FOLLOW_UP.key])
    assert not bad, f"after the fault: {bad}\n{server.log_tail(3000)}"
