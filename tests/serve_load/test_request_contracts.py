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

import dflash_settings
import pytest
import serve_workload as workload
from stepwise_outputs import final_output, generate_in_steps

FIRST_STOP_POSITION = 4  # leave the prefill's token and the first drafts alone
MIN_CASES = 3


def _stop_case(tokenizer, prompt: list[int], ref_ids: list[int]) -> dict | None:
    """The case's stop string (two printable reference tokens) and the
    response expected without speculation."""

    def printable(t: int) -> bool:
        return 33 <= t <= 126

    for p in range(FIRST_STOP_POSITION, len(ref_ids) - 1):
        if printable(ref_ids[p]) and printable(ref_ids[p + 1]):
            stop = chr(ref_ids[p]) + chr(ref_ids[p + 1])
            return {"stop": stop, **_expected(tokenizer, prompt, ref_ids, stop=[stop])}
    return None


@pytest.fixture(scope="module")
def stop_cases(tokenizer, load_jobs, references):
    cases = []
    for job in load_jobs:
        if not job.key.startswith("trained-"):
            continue
        case = _stop_case(tokenizer, list(job.prompt), references[job.key]["token_ids"])
        if case is not None:
            cases.append({"job": job, "job_ref": references[job.key]["token_ids"], **case})
    assert len(cases) >= MIN_CASES, f"only {len(cases)} trained-prompt references have a usable stop string"
    return cases


@pytest.fixture(scope="module")
def trained_job(load_jobs):
    """The first load job on one of the trained pair's training prompts."""
    return next(job for job in load_jobs if job.key.startswith("trained-"))


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def _choices(client, api: str, stream: bool, **kwargs) -> tuple[dict[int, dict], int | None]:
    """Per choice index: text, token_ids, logprobs (a list of {token: logprob}
    for the top entries, or None), the chosen tokens' logprobs,
    finish_reason, stop_reason; and
    usage.completion_tokens. Streamed responses joined."""
    create = client.completions.create if api == "completions" else client.chat.completions.create
    extra = kwargs.pop("extra_body", {})
    kwargs["extra_body"] = {"ignore_eos": True, "return_token_ids": True, **extra}
    responses = create(stream=True, stream_options={"include_usage": True}, **kwargs) if stream else [create(**kwargs)]
    choices: dict[int, dict] = {}
    usage = None
    for r in responses:
        if r.usage is not None:
            usage = r.usage.completion_tokens
        for c in r.choices:
            got = choices.setdefault(
                c.index,
                {
                    "text": "",
                    "token_ids": [],
                    "logprobs": None,
                    "chosen_logprobs": [],
                    "finish_reason": None,
                    "stop_reason": None,
                },
            )
            extra_fields = c.model_extra or {}
            got["text"] += (
                c.text if api == "completions" else (c.delta.content if stream else c.message.content)
            ) or ""
            got["token_ids"] += list(extra_fields.get("token_ids") or [])
            if c.logprobs is not None:
                if api == "completions":
                    tops = c.logprobs.top_logprobs or [{} for _ in c.logprobs.tokens]
                    got["chosen_logprobs"] += list(c.logprobs.token_logprobs)
                else:
                    tops = [{t.token: t.logprob for t in e.top_logprobs} for e in c.logprobs.content or []]
                    got["chosen_logprobs"] += [e.logprob for e in c.logprobs.content or []]
                got["logprobs"] = (got["logprobs"] or []) + list(tops)
            if c.finish_reason is not None:
                got["finish_reason"], got["stop_reason"] = c.finish_reason, extra_fields.get("stop_reason")
    return choices, usage


@pytest.fixture(scope="module")
def tokenizer(trained_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(trained_pair[0])


def _expected(tokenizer, prompt_ids: list[int], ref_ids: list[int], **params) -> dict:
    """The response without speculation: the reference tokens one per step."""
    from vllm.sampling_params import RequestOutputKind

    want = final_output(generate_in_steps(tokenizer, prompt_ids, ref_ids, 1, RequestOutputKind.FINAL_ONLY, **params))
    return {
        "text": want["text"],
        "token_ids": want["token_ids"],
        "finish_reason": want["finish_reason"],
        "stop_reason": want["stop_reason"],
    }


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_stop_string_ends_output_tokens_logprobs_and_usage_as_without_speculation(
    live_server, stop_cases, client, stream, figures
):
    before = live_server.metrics()
    wrong = []
    for case in stop_cases:
        choices, usage = _choices(
            client,
            "completions",
            stream,
            model=live_server.model,
            prompt=list(case["job"].prompt),
            max_tokens=workload.LOAD_MAX_TOKENS,
            temperature=0.0,
            stop=[case["stop"]],
            logprobs=1,
        )
        got = {k: choices[0][k] for k in ("text", "token_ids", "finish_reason", "stop_reason")}
        got.update(logprobs=len(choices[0]["logprobs"] or []), completion_tokens=usage)
        want = {
            "text": case["text"],
            "token_ids": case["token_ids"],
            "logprobs": len(case["token_ids"]),
            "finish_reason": case["finish_reason"],
            "stop_reason": case["stop_reason"],
            "completion_tokens": len(case["token_ids"]),
        }
        if got != want:
            wrong.append((case["job"].key, case["stop"], {k: (got[k], want[k]) for k in want if got[k] != want[k]}))
    accepted = workload.delta(before, live_server.metrics(), "vllm:spec_decode_num_accepted_tokens_total")
    figures[f"stop strings ({'stream' if stream else 'plain'})"] = {
        "cases": len(stop_cases),
        "wrong": len(wrong),
        "accepted_draft_tokens": accepted,
    }
    assert accepted > 0, "no draft token was accepted: these requests did not test DFlash"
    assert not wrong, "(job, stop, {field: (got, want)}): " + repr(wrong)


SEED = 42
TEMPERATURE = 0.9


def _sampled_token_ids(client, model: str, prompt: list[int], seed: int | None) -> tuple[int, ...]:
    choices, _usage = _choices(
        client,
        "completions",
        False,
        model=model,
        prompt=prompt,
        max_tokens=workload.LOAD_MAX_TOKENS,
        temperature=TEMPERATURE,
        seed=seed,
    )
    return tuple(choices[0]["token_ids"])


def test_seeded_sampling_is_reproducible_alone_and_under_concurrency(live_server, trained_job, client, figures):
    prompt = list(trained_job.prompt)
    before = live_server.metrics()
    alone = [_sampled_token_ids(client, live_server.model, prompt, SEED) for _ in range(2)]
    # Two copies of the seeded request and an unseeded one, all at once. No more:
    # this server has 12 KV blocks (for the preemption tests), so six requests at
    # once can be preempted, and in one run of six a seeded copy parted from the
    # others after 55 of 64 tokens. A seed across preemption is another question.
    seeds = [SEED, None, SEED]
    with ThreadPoolExecutor(len(seeds)) as pool:
        together = list(pool.map(lambda s: _sampled_token_ids(client, live_server.model, prompt, s), seeds))
    accepted = workload.delta(before, live_server.metrics(), "vllm:spec_decode_num_accepted_tokens_total")
    seeded = alone + [ids for ids, s in zip(together, seeds) if s is not None]
    unseeded = [ids for ids, s in zip(together, seeds) if s is None]
    figures["seeded sampling"] = {
        "seeded_requests": len(seeded),
        "distinct_seeded_outputs": len(set(seeded)),
        "distinct_unseeded_outputs": len(set(unseeded)),
        "accepted_draft_tokens": accepted,
    }
    assert accepted > 0, "no draft token was accepted: these requests did not test DFlash"
    assert len(set(seeded)) == 1, f"seed {SEED} gave {len(set(seeded))} different outputs: {seeded}"
    # The request really samples: without a seed it does not repeat the seeded one.
    assert any(ids != seeded[0] for ids in unseeded), unseeded


# Around one speculative step: fewer tokens than a step drafts, exactly a
# step's worth, and past it.
MAX_TOKENS_CASES = range(1, dflash_settings.NUM_SPEC_TOKENS + 3)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_max_tokens_around_one_step_returns_exactly_that_many(
    live_server, trained_job, references, client, stream, figures
):
    """max_tokens 1 .. k+2: exactly that many tokens, the target-only greedy
    prefix (float32: exact), finish_reason "length", usage to match."""
    job = trained_job
    ref = references[job.key]["token_ids"]
    before = live_server.metrics()
    wrong = []
    for max_tokens in MAX_TOKENS_CASES:
        choices, usage = _choices(
            client,
            "completions",
            stream,
            model=live_server.model,
            prompt=list(job.prompt),
            max_tokens=max_tokens,
            temperature=0.0,
        )
        ids, finish = choices[0]["token_ids"], choices[0]["finish_reason"]
        got = (ids, finish, usage)
        want = (ref[:max_tokens], "length", max_tokens)
        if got != want:
            wrong.append((max_tokens, got, want))
    accepted = workload.delta(before, live_server.metrics(), "vllm:spec_decode_num_accepted_tokens_total")
    figures[f"max_tokens 1..{MAX_TOKENS_CASES[-1]} ({'stream' if stream else 'plain'})"] = {
        "cases": len(MAX_TOKENS_CASES),
        "wrong": len(wrong),
        "accepted_draft_tokens": accepted,
    }
    assert accepted > 0, "no draft token was accepted: these requests did not test DFlash"
    assert not wrong, "(max_tokens, (ids, finish_reason, completion_tokens) got, want): " + repr(wrong)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_stop_string_ends_the_message_as_without_speculation(
    live_server, load_jobs, references, tokenizer, client, stream, figures
):
    cases = []
    for job in load_jobs:
        if job.api != "chat":
            continue
        ref = references[job.key]
        case = _stop_case(tokenizer, ref["prompt_token_ids"], ref["token_ids"])
        if case is not None:
            cases.append((job, case))
    assert cases, "no chat reference has a usable stop string"
    wrong = []
    for job, case in cases:
        messages = [{"role": r, "content": c} for r, c in job.messages]
        choices, usage = _choices(
            client,
            "chat",
            stream,
            model=live_server.model,
            messages=messages,
            max_tokens=job.max_tokens,
            temperature=0.0,
            stop=[case["stop"]],
        )
        got = {k: choices[0][k] for k in ("text", "token_ids", "finish_reason", "stop_reason")}
        want = {k: case[k] for k in ("text", "token_ids", "finish_reason", "stop_reason")}
        got["completion_tokens"], want["completion_tokens"] = usage, len(case["token_ids"])
        if got != want:
            wrong.append((job.key, case["stop"], {k: (got[k], want[k]) for k in want if got[k] != want[k]}))
    figures[f"chat stop strings ({'stream' if stream else 'plain'})"] = {"cases": len(cases), "wrong": len(wrong)}
    assert not wrong, "(job, stop, {field: (got, want)}): " + repr(wrong)


def test_min_tokens_holds_back_a_stop_string_as_without_speculation(
    live_server, stop_cases, tokenizer, client, figures
):
    """min_tokens past the stop string's first occurrence: the output goes on
    to its next occurrence (or to max_tokens), exactly as without speculation."""
    wrong = []
    for case in stop_cases:
        job = case["job"]
        min_tokens = len(case["token_ids"]) + 1
        ref = list(case["job_ref"])
        want = _expected(tokenizer, list(job.prompt), ref, stop=[case["stop"]], min_tokens=min_tokens)
        choices, usage = _choices(
            client,
            "completions",
            False,
            model=live_server.model,
            prompt=list(job.prompt),
            max_tokens=len(ref),
            temperature=0.0,
            stop=[case["stop"]],
            extra_body={"min_tokens": min_tokens},
        )
        got = {k: choices[0][k] for k in want}
        if got != want or usage != len(want["token_ids"]):
            wrong.append((job.key, case["stop"], min_tokens, got, want, usage))
    figures["min_tokens + stop"] = {"cases": len(stop_cases), "wrong": len(wrong)}
    assert not wrong, repr(wrong)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_top_logprobs_n_and_echo_with_dflash(live_server, trained_job, references, tokenizer, client, stream, figures):
    """logprobs=3, greedy: the target-only tokens, each with top logprobs
    none of which is above the chosen token's (tokens that decode to the same
    text share one entry of the API's dict, so it may hold fewer than 3).
    n=2 (sampled; vLLM refuses n > 1 with greedy) with a seed: two choices of
    max_tokens tokens each, usage their sum, the same pair again on a repeat.
    echo (a text prompt that tokenizes to the job's ids): the prompt's text,
    then the target-only continuation."""
    job = trained_job
    ref = references[job.key]
    common = dict(model=live_server.model, prompt=list(job.prompt), max_tokens=job.max_tokens)
    before = live_server.metrics()
    greedy, greedy_usage = _choices(client, "completions", stream, temperature=0.0, logprobs=3, **common)
    pairs = [
        _choices(client, "completions", stream, temperature=TEMPERATURE, seed=SEED, n=2, **common) for _ in range(2)
    ]
    prompt_text = tokenizer.decode(list(job.prompt))
    assert tokenizer(prompt_text)["input_ids"] == list(job.prompt), "the prompt's text does not round-trip"
    # With return_token_ids the frontend returns the prompt as prompt_token_ids, not as text.
    echoed, _ = _choices(
        client,
        "completions",
        False,
        temperature=0.0,
        echo=True,
        extra_body={"return_token_ids": False},
        **{**common, "prompt": prompt_text},
    )
    accepted = workload.delta(before, live_server.metrics(), "vllm:spec_decode_num_accepted_tokens_total")
    problems = []
    g = greedy[0]
    if (g["token_ids"], g["text"], greedy_usage) != (ref["token_ids"], ref["text"], len(ref["token_ids"])):
        problems.append("logprobs=3: not the target-only output")
    tops, chosen = g["logprobs"] or [], g["chosen_logprobs"]
    if not (len(tops) == len(chosen) == len(ref["token_ids"])) or not all(tops):
        problems.append(
            f"logprobs=3: {len(tops)} top entries and {len(chosen)} token logprobs for {len(ref['token_ids'])} tokens"
        )
    above = [pos for pos, (top, lp) in enumerate(zip(tops, chosen)) if max(top.values()) > lp + 1e-4]
    if above:
        problems.append(f"logprobs=3: a top logprob above the greedy token's at positions {above}")
    for k, (choices, usage) in enumerate(pairs):
        lengths = [len(choices[i]["token_ids"]) for i in sorted(choices)]
        if lengths != [job.max_tokens] * 2 or usage != 2 * job.max_tokens:
            problems.append(f"n=2 run {k}: choice lengths {lengths}, usage.completion_tokens {usage}")
    if [c["token_ids"] for c in pairs[0][0].values()] != [c["token_ids"] for c in pairs[1][0].values()]:
        problems.append("n=2 with a seed: the repeat returned other choices")
    want_echo = prompt_text + ref["text"]
    if echoed[0]["text"] != want_echo:
        problems.append(f"echo: {echoed[0]['text']!r} != {want_echo!r}")
    figures[f"top_logprobs, n=2, echo ({'stream' if stream else 'plain'})"] = {
        "problems": len(problems),
        "accepted_draft_tokens": accepted,
    }
    assert accepted > 0, "no draft token was accepted: these requests did not test DFlash"
    assert not problems, problems
