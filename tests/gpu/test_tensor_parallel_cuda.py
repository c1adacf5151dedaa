"""DFlash + fp8 KV cache with tensor parallelism (TP=2) on two or more GPUs.

The GPU side of tests/cpu_e2e/test_dflash_tensor_parallel.py: on the text pair
(a target trained on The Zen of Python and its DFlash drafter), in bf16, every
rank's draft layers take the fp8 cache and hold half the KV heads, the
answer is the text's continuation, DFlash accepts most drafts, and its greedy
output equals target-only TP=2 up to bf16 near-ties (tests/support/lossless.py).
Skipped, with the reason, on machines with fewer than two GPUs. The GPU
workflow runs it on a multi-GPU runner (workflow input `tensor_parallel`).
Not run by this project yet: no multi-GPU machine was available.
"""

from __future__ import annotations

import pytest
import torch

MIN_GPUS = 2
if torch.cuda.device_count() < MIN_GPUS:
    pytest.skip(
        f"tensor parallelism needs {MIN_GPUS} CUDA devices; torch sees {torch.cuda.device_count()}",
        allow_module_level=True,
    )

import dflash_settings  # noqa: E402
import gpu_e2e  # noqa: E402
import greedy_runs  # noqa: E402
import offline_engine  # noqa: E402
import worker_probes  # noqa: E402

TP = 2
MAX_TOKENS = 48
PROMPTS = ["Beautiful is better than", "Errors should never", "Now is better", "The Zen of"]
MIN_MEAN_ACCEPTANCE_LENGTH = 3.0


def _run(pair, dflash: bool) -> dict:
    target, draft = pair
    kwargs = dict(model=target, kv_cache_dtype="fp8", tensor_parallel_size=TP, **gpu_e2e.ENGINE_KW)
    if dflash:
        kwargs["speculative_config"] = dflash_settings.dflash_spec_config(draft)
    llm = offline_engine.start_llm(("tp2", dflash), **kwargs)
    try:
        ids, logprobs = greedy_runs.generate_with_logprobs(llm, PROMPTS, MAX_TOKENS)
        texts = [
            o.outputs[0].text for o in llm.generate(PROMPTS, greedy_runs.greedy_params(MAX_TOKENS), use_tqdm=False)
        ]
        return {
            "ids": ids,
            "logprobs": logprobs,
            "texts": texts,
            "ranks": llm.collective_rpc(worker_probes.worker_kv_state),
            "metrics": offline_engine.spec_metrics(llm) if dflash else {},
        }
    finally:
        offline_engine.shutdown_llm()


@pytest.fixture(scope="module")
def dflash(text_pair):
    return _run(text_pair, dflash=True)


@pytest.fixture(scope="module")
def target_only(text_pair):
    return _run(text_pair, dflash=False)


@pytest.mark.needs_patch("0001")
def test_every_rank_gives_the_draft_layers_an_fp8_cache(dflash):
    from vllm.fork.tiny_pairs import NUM_KV_HEADS

    assert len(dflash["ranks"]) == TP
    for rank, state in enumerate(dflash["ranks"]):
        draft = [s for s in state["layers"].values() if s["role"] == "draft"]
        assert len(draft) == 2, (rank, sorted(state["layers"]))
        for name, s in state["layers"].items():
            assert s["kv_cache_dtype"] == "fp8" and s["tensor_dtype"] == "torch.uint8", (rank, name, s)
            assert NUM_KV_HEADS // TP in s["tensor_shape"], (rank, name, s["tensor_shape"])


def test_answer_is_the_text_and_drafts_are_accepted(dflash, measurements):
    from vllm.fork.tiny_pairs import training_text

    zen = training_text()
    assert (zen + zen).find(PROMPTS[0] + dflash["texts"][0][:32]) >= 0, dflash["texts"][0]
    mal, drafts, accepted = gpu_e2e.mean_acceptance(dflash["metrics"])
    measurements["TP=2 DFlash fp8 mean acceptance length (text pair)"] = round(mal, 3)
    assert mal >= MIN_MEAN_ACCEPTANCE_LENGTH, (drafts, accepted)


def test_greedy_dflash_tp2_is_lossless(dflash, target_only, measurements):
    report = greedy_runs.near_tie_report(dflash, target_only)
    measurements["TP=2 fp8 bf16 lossless"] = report.summary()
    assert report.ok, report.explain()
