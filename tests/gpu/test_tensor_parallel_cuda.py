"""DFlash + fp8 KV cache scaled over two or more GPUs: TP=2 (vLLM's mp and
Ray executors) and data parallelism (DP=2).

The GPU side of tests/cpu_e2e/test_dflash_tensor_parallel.py: on the text pair
(a target trained on The Zen of Python and its DFlash drafter), in bf16, every
rank's draft layers take the fp8 cache and hold half the KV heads, the
answer is the text's continuation, DFlash accepts most drafts, and its greedy
output equals target-only TP=2 up to bf16 near-ties (tests/support/lossless.py),
with the mp executor and with Ray's (a Ray instance the engine starts on this
machine). `vllm serve --data-parallel-size 2` answers the text with both
engines drafting.
Skipped, with the reason, on machines with fewer than two GPUs. The GPU
workflow runs it on a multi-GPU runner (workflow input `tensor_parallel`).
Not run by this project yet: no multi-GPU machine was available.
"""

from __future__ import annotations

import json

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


def _run(pair, dflash: bool, backend: str = "mp") -> dict:
    target, draft = pair
    kwargs = dict(
        model=target,
        kv_cache_dtype="fp8",
        tensor_parallel_size=TP,
        distributed_executor_backend=backend,
        **gpu_e2e.ENGINE_KW,
    )
    if dflash:
        kwargs["speculative_config"] = dflash_settings.dflash_spec_config(draft)
    llm = offline_engine.start_llm(("tp2", dflash, backend), **kwargs)
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


@pytest.fixture(scope="module")
def dflash_over_ray(text_pair):
    return _run(text_pair, dflash=True, backend="ray")


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


def test_greedy_dflash_tp2_over_ray_is_lossless(dflash_over_ray, target_only, measurements):
    assert len(dflash_over_ray["ranks"]) == TP
    report = greedy_runs.near_tie_report(dflash_over_ray, target_only)
    measurements["TP=2 over Ray fp8 bf16 lossless"] = report.summary()
    assert report.ok, report.explain()
    mal, drafts, accepted = gpu_e2e.mean_acceptance(dflash_over_ray["metrics"])
    measurements["TP=2 over Ray DFlash fp8 mean acceptance length (text pair)"] = round(mal, 3)
    assert mal >= MIN_MEAN_ACCEPTANCE_LENGTH, (drafts, accepted)


def test_data_parallel_server_answers_the_text_with_both_engines_drafting(text_pair, tmp_path, measurements):
    from vllm_server import VllmServer, http

    from vllm.fork.tiny_pairs import training_text

    target, draft = text_pair
    args = [*dflash_settings.dflash_fp8_serve_args(draft), "--data-parallel-size", "2"]
    zen = training_text()
    with VllmServer(target, args, tmp_path / "dp2.log") as srv:
        body = {"model": srv.model_id(), "prompt": PROMPTS[0], "max_tokens": 32, "temperature": 0.0}
        answers = [http("POST", srv.base + "/v1/completions", body) for _ in range(8)]
        drafts = srv.metrics_by_engine("vllm:spec_decode_num_drafts_total")
        accepted = srv.metrics_by_engine("vllm:spec_decode_num_accepted_tokens_total")
        measurements["DP=2 server: start s"] = round(srv.start_s, 1)
    for status, text in answers:
        assert status == 200, text[:500]
        completion = json.loads(text)["choices"][0]["text"]
        assert (zen + zen).find(PROMPTS[0] + completion[:32]) >= 0, completion
    assert set(drafts) == {"0", "1"} and all(accepted.get(e, 0) > 0 for e in drafts), (drafts, accepted)
