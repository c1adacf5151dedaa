"""Greedy runs of the CPU end-to-end tests: their prompts, the token ids and
logprobs an engine gives for them, and the bf16 near-tie comparison."""

from __future__ import annotations

import time

import offline_engine
import worker_probes
from dflash_settings import MAX_TOKENS, dflash_spec_config

PROMPTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog, again and again and again.",
    "a",
    "DFlash drafts a whole block of tokens in one forward pass; " * 2,
]


def family_prompts() -> list:
    """Prompts for a family pair: the drafter's training prompts (drafted
    well) and PROMPTS (drafted poorly)."""
    from vllm.fork.tiny_pairs import trained_prompts

    return [*({"prompt_token_ids": ids} for ids in trained_prompts()), *PROMPTS]


def training_record(draft_dir: str) -> dict:
    """What a tiny pair's trainer recorded beside its drafter
    (vllm.fork.tiny_pairs.TRAINING_RECORD)."""
    import json
    from pathlib import Path

    from vllm.fork.tiny_pairs import TRAINING_RECORD

    return json.loads((Path(draft_dir) / TRAINING_RECORD).read_text())


def followed_prompt_indexes(draft_dir: str, reference_ids: list[list[int]]) -> list[int]:
    """The indexes, in :func:`family_prompts`, of the drafter's training
    prompts whose target-only output ``reference_ids`` is, in full, a
    continuation the drafter learned (its training record keeps one per fp8
    rounding). A drafter was trained against its target in transformers; the
    served target can leave that continuation where the two compute a token
    in different float32 order and the fp8 cache rounds the difference into
    a whole step. Where it follows it, the drafter should draft nearly every
    token right."""
    learned = training_record(draft_dir)["continuations"]
    return [
        i
        for i in range(len(next(iter(learned.values()))))
        if any(list(reference_ids[i]) == list(c[i]) for c in learned.values())
    ]


def learned_acceptance_length(draft_dir: str) -> float:
    """The drafter's mean acceptance length along its training prompts'
    continuations, as its trainer measured it in greedy speculative decoding
    (the lower of the fp8 roundings it learned)."""
    record = training_record(draft_dir)["reference_acceptance"]
    return min(1 + sum(accepted) / drafts for drafts, *accepted in record.values())


def draft_counts_for(llm, prompts: list, max_tokens: int):
    """The speculative-decoding counters (draft_counts.DraftCounts) of one
    greedy run of ``prompts`` on a live engine."""
    from draft_counts import DraftCounts

    before = offline_engine.spec_metrics(llm)
    generate_ids(llm, prompts, max_tokens)
    return DraftCounts.between(before, offline_engine.spec_metrics(llm))


def text_line_prompts(length: int = 40) -> list:
    """The first ``length`` tokens from the start of every line of the text
    the text pair learned (vllm.fork.tiny_pairs; the text is cyclic)."""
    from vllm.fork.tiny_pairs import training_text

    ids = list(training_text().encode()) * 2
    starts = [0] + [i + 1 for i in range(len(ids) // 2 - 1) if ids[i] == ord("\n")]
    return [{"prompt_token_ids": ids[s : s + length]} for s in starts]


def shared_prefix_prompts() -> list:
    """Four prompts that share their first 600 tokens (printable bytes) and
    differ in the last few: enough for a prefix-cache hit of several KV
    blocks, whatever the block size the target's layout imposes."""
    from vllm.fork.tiny_pairs import trained_prompts

    prefix = [32 + (i * 7) % 95 for i in range(600)]
    return [{"prompt_token_ids": prefix + ids} for ids in (*trained_prompts()[:3], [ord("q")])]


def greedy_params(max_tokens: int = MAX_TOKENS, logprobs: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def generate_ids(llm, prompts=PROMPTS, max_tokens: int = MAX_TOKENS):
    t0 = time.monotonic()
    outs = llm.generate(list(prompts), greedy_params(max_tokens), use_tqdm=False)
    dt = time.monotonic() - t0
    ids = [list(o.outputs[0].token_ids) for o in outs]
    texts = [o.outputs[0].text for o in outs]
    print(f"[e2e] generated {sum(map(len, ids))} tokens for {len(ids)} prompts in {dt:.2f} s")
    return ids, texts


def generate_with_logprobs(llm, prompts=PROMPTS, max_tokens: int = MAX_TOKENS, k: int | None = None):
    """Greedy ids and, per output position, the top-``k`` logprobs
    (``{token id: logprob}`` rows; k defaults to lossless.TOP_K) for a
    near-tie comparison (tests/support/lossless.py)."""
    import lossless

    params = greedy_params(max_tokens, logprobs=lossless.TOP_K if k is None else k)
    t0 = time.monotonic()
    outs = llm.generate(list(prompts), params, use_tqdm=False)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    rows = [lossless.logprob_rows(o.outputs[0].logprobs) for o in outs]
    print(
        f"[e2e] generated {sum(map(len, ids))} tokens (with logprobs) for {len(ids)} prompts "
        f"in {time.monotonic() - t0:.2f} s"
    )
    return ids, rows


def near_tie_report(got: dict, want: dict):
    """bf16 losslessness of two runs of :func:`generate_with_logprobs` over
    PROMPTS (``{"ids", "logprobs"}`` each): tests/support/lossless.py's
    near-tie rule, one entry per prompt."""
    import lossless

    return lossless.compare_all(
        [f"prompt {i}" for i in range(len(got["ids"]))],
        got["ids"],
        want["ids"],
        dtype="bfloat16",
        got_logprobs=got["logprobs"],
        want_logprobs=want["logprobs"],
    )


def family_outputs(
    family: str, pair: tuple[str, str], *, dflash: bool, max_tokens: int, prompts: list | None = None, **engine_args
) -> dict:
    """Greedy ids of a family pair's target (float32, fp8 KV cache) for
    ``prompts`` (default: family_prompts()), with its DFlash drafter or
    alone; with the drafter also its counters and KV state, and the engine
    stays up (``"llm"``). Alone, the engine is shut down."""
    from vllm.fork.tiny_families import serve_overrides

    target, draft = pair
    if dflash:
        engine_args["speculative_config"] = dflash_spec_config(draft)
    llm = offline_engine.start_llm(
        (f"family-{family}", "dflash" if dflash else "target"),
        model=target,
        dtype="float32",
        kv_cache_dtype="fp8",
        **serve_overrides(family),
        **engine_args,
    )
    ids, _ = generate_ids(llm, family_prompts() if prompts is None else prompts, max_tokens)
    if not dflash:
        offline_engine.shutdown_llm()
        return {"ids": ids}
    return {
        "llm": llm,
        "ids": ids,
        "metrics": offline_engine.spec_metrics(llm),
        "preemptions": offline_engine.engine_counter(llm, "vllm:num_preemptions"),
        "state": llm.collective_rpc(worker_probes.worker_kv_state)[0],
    }
