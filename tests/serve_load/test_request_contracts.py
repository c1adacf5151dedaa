"""Speculative decoding changes only the speed: the OpenAI API's request
contracts hold with DFlash (and an fp8 KV cache) as they do without it.

Driven by the official `openai` client against the suite's DFlash server; the
expectations come from the target-only greedy references (float32: exact).
The prompts are the trained pair's training prompts, whose continuations the
drafter drafts nearly token for token: most steps accept several tokens, so a
stop string completes inside an accepted block.

Seeded sampling: the same seed gives the same output with DFlash, alone, next
to copies of itself and next to unseeded requests. It need not equal the
target-only output for that seed (the accepted tokens follow the target's
distribution, but speculation draws its random numbers in another order).

A stop string is taken from each reference continuation: its first two
printable ASCII characters in a row after the first few tokens. The expected
response is what the frontend makes of the reference tokens coming one per
step, as they do without speculation (tests/support/stepwise_outputs.py):
the output ends with the token that completes the stop string's first
occurrence.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

import dflash_e2e as e2e
import serve_load as sl
from stepwise_outputs import final_output, generate_in_steps

FIRST_STOP_POSITION = 4  # leave the prefill's token and the first drafts alone
MIN_CASES = 3


def _stop_case(tokenizer, prompt: list[int], ref_ids: list[int]) -> dict | None:
    """The case's stop string and the response expected without speculation."""
    from vllm.sampling_params import RequestOutputKind

    def printable(t: int) -> bool:
        return 33 <= t <= 126

    for p in range(FIRST_STOP_POSITION, len(ref_ids) - 1):
        if printable(ref_ids[p]) and printable(ref_ids[p + 1]):
            stop = chr(ref_ids[p]) + chr(ref_ids[p + 1])
            want = final_output(generate_in_steps(tokenizer, prompt, ref_ids, 1,
                                                  RequestOutputKind.FINAL_ONLY, stop=[stop]))
            return {"stop": stop, "token_ids": want["token_ids"], "text": want["text"],
                    "finish_reason": want["finish_reason"], "stop_reason": want["stop_reason"]}
    return None


@pytest.fixture(scope="module")
def stop_cases(trained_pair, load_jobs, references):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(trained_pair[0])
    cases = []
    for job in load_jobs:
        if not job.key.startswith("trained-"):
            continue
        case = _stop_case(tokenizer, list(job.prompt), references[job.key]["token_ids"])
        if case is not None:
            cases.append({"job": job, **case})
    assert len(cases) >= MIN_CASES, (
        f"only {len(cases)} trained-prompt references have a usable stop string")
    return cases


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def _complete(client, model: str, case: dict, stream: bool) -> dict:
    """One /v1/completions request with the case's stop string; what the
    response says, streamed responses joined."""
    kwargs = dict(model=model, prompt=list(case["job"].prompt), max_tokens=sl.LOAD_MAX_TOKENS,
                  temperature=0.0, stop=[case["stop"]], logprobs=1,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    if not stream:
        r = client.completions.create(**kwargs)
        choice = r.choices[0]
        return {"text": choice.text, "token_ids": list(choice.model_extra["token_ids"]),
                "logprobs": len(choice.logprobs.tokens), "finish_reason": choice.finish_reason,
                "stop_reason": choice.model_extra.get("stop_reason"),
                "completion_tokens": r.usage.completion_tokens}
    got = {"text": "", "token_ids": [], "logprobs": 0, "finish_reason": None,
           "stop_reason": None, "completion_tokens": None}
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True},
                                           **kwargs):
        if chunk.usage is not None:
            got["completion_tokens"] = chunk.usage.completion_tokens
        for choice in chunk.choices:
            got["text"] += choice.text
            got["token_ids"] += list((choice.model_extra or {}).get("token_ids") or [])
            got["logprobs"] += len(choice.logprobs.tokens) if choice.logprobs else 0
            if choice.finish_reason is not None:
                got["finish_reason"] = choice.finish_reason
                got["stop_reason"] = (choice.model_extra or {}).get("stop_reason")
    return got


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_stop_string_ends_output_tokens_logprobs_and_usage_as_without_speculation(
        live_server, stop_cases, client, stream, figures):
    before = live_server.metrics()
    wrong = []
    for case in stop_cases:
        got = _complete(client, live_server.model, case, stream)
        want = {"text": case["text"], "token_ids": case["token_ids"],
                "logprobs": len(case["token_ids"]), "finish_reason": case["finish_reason"],
                "stop_reason": case["stop_reason"], "completion_tokens": len(case["token_ids"])}
        if got != want:
            wrong.append((case["job"].key, case["stop"],
                          {k: (got[k], want[k]) for k in want if got[k] != want[k]}))
    accepted = sl.delta(before, live_server.metrics(), "vllm:spec_decode_num_accepted_tokens_total")
    figures[f"stop strings ({'stream' if stream else 'plain'})"] = {
        "cases": len(stop_cases), "wrong": len(wrong), "accepted_draft_tokens": accepted}
    assert accepted > 0, "no draft token was accepted: these requests did not test DFlash"
    assert not wrong, "(job, stop, {field: (got, want)}): " + repr(wrong)


SEED = 42
TEMPERATURE = 0.9


def _sampled_token_ids(client, model: str, prompt: list[int], seed: int | None) -> tuple[int, ...]:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=sl.LOAD_MAX_TOKENS,
                                  temperature=TEMPERATURE, seed=seed,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    return tuple(r.choices[0].model_extra["token_ids"])


def test_seeded_sampling_is_reproducible_alone_and_under_concurrency(live_server, load_jobs, client, figures):
    prompt = list(next(job for job in load_jobs if job.key.startswith("trained-")).prompt)
    before = live_server.metrics()
    alone = [_sampled_token_ids(client, live_server.model, prompt, SEED) for _ in range(2)]
    # Three copies of the seeded request and three unseeded ones, all at once.
    seeds = [SEED, None, SEED, None, SEED, None]
    with ThreadPoolExecutor(len(seeds)) as pool:
        together = list(pool.map(lambda s: _sampled_token_ids(client, live_server.model, prompt, s), seeds))
    accepted = sl.delta(before, live_server.metrics(), "vllm:spec_decode_num_accepted_tokens_total")
    seeded = alone + [ids for ids, s in zip(together, seeds) if s is not None]
    unseeded = [ids for ids, s in zip(together, seeds) if s is None]
    figures["seeded sampling"] = {
        "seeded_requests": len(seeded), "distinct_seeded_outputs": len(set(seeded)),
        "distinct_unseeded_outputs": len(set(unseeded)), "accepted_draft_tokens": accepted}
    assert accepted > 0, "no draft token was accepted: these requests did not test DFlash"
    assert len(set(seeded)) == 1, f"seed {SEED} gave {len(set(seeded))} different outputs: {seeded}"
    # The requests really sample: without a seed, three requests do not all repeat the seeded one.
    assert any(ids != seeded[0] for ids in unseeded), unseeded


# Around one speculative step: fewer tokens than a step drafts, exactly a
# step's worth, and past it.
MAX_TOKENS_CASES = range(1, e2e.NUM_SPEC_TOKENS + 3)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_max_tokens_around_one_step_returns_exactly_that_many(live_server, load_jobs, references,
                                                              client, stream, figures):
    """max_tokens 1 .. k+2: exactly that many tokens, the target-only greedy
    prefix (float32: exact), finish_reason "length", usage to match."""
    job = next(job for job in load_jobs if job.key.startswith("trained-"))
    ref = references[job.key]["token_ids"]
    before = live_server.metrics()
    wrong = []
    for max_tokens in MAX_TOKENS_CASES:
        kwargs = dict(model=live_server.model, prompt=list(job.prompt), max_tokens=max_tokens,
                      temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})
        if stream:
            ids, finish, usage = [], None, None
            for chunk in client.completions.create(stream=True, stream_options={"include_usage": True},
                                                   **kwargs):
                usage = chunk.usage.completion_tokens if chunk.usage is not None else usage
                for choice in chunk.choices:
                    ids += list((choice.model_extra or {}).get("token_ids") or [])
                    finish = choice.finish_reason or finish
        else:
            r = client.completions.create(**kwargs)
            ids = list(r.choices[0].model_extra["token_ids"])
            finish, usage = r.choices[0].finish_reason, r.usage.completion_tokens
        got = (ids, finish, usage)
        want = (ref[:max_tokens], "length", max_tokens)
        if got != want:
            wrong.append((max_tokens, got, want))
    accepted = sl.delta(before, live_server.metrics(), "vllm:spec_decode_num_accepted_tokens_total")
    figures[f"max_tokens 1..{MAX_TOKENS_CASES[-1]} ({'stream' if stream else 'plain'})"] = {
        "cases": len(MAX_TOKENS_CASES), "wrong": len(wrong), "accepted_draft_tokens": accepted}
    assert accepted > 0, "no draft token was accepted: these requests did not test DFlash"
    assert not wrong, "(max_tokens, (ids, finish_reason, completion_tokens) got, want): " + repr(wrong)
