"""DFlash + fp8 KV cache under tensor parallelism: TP=2 on CPU.

vLLM's CPU backend runs tensor parallelism with one worker process per rank
(shared-memory and gloo communicators). The fork's patches run on every rank
(the drafter's layers and KV caches, the layer taps, the CPU runner), so each
rank is checked, not rank 0 alone. The pair is the text pair (a target trained
on The Zen of Python, its drafter trained against it), in float32: its KV
heads (2) split one per rank.

The ranks' threads are bound explicitly (parallel_workers.threads_bind_for_ranks):
vLLM's automatic binding stops at start-up with "Not enough allowed NUMA
nodes to bind threads of 2 local CPUWorkers" on a one-node machine.

Every engine here has two ranks, so the module is `extended` (a CI job of its
own, `bash tools/run_tests.sh -m extended`); that job also proves these guards
(`-m extended_guards --necessity-with-extended`, tests/support/necessity_plugin.py).
"""

from __future__ import annotations

import json
import os
import time

import dflash_settings
import greedy_runs
import offline_engine
import parallel_workers
import pytest
import worker_probes
from draft_counts import DraftCounts
from vllm_server import VllmServer

pytestmark = pytest.mark.extended

TP = 2
MAX_TOKENS = 48
# Starts of lines of the text the target was trained on.
PROMPTS = [
    "Beautiful is better than",
    "Errors should never",
    "Now is better",
    "The Zen of",
    "If the implementation is hard",
]
KV_TENSOR_DTYPE = {"auto": "torch.float32", "fp8": "torch.uint8"}
# Every draft of this drafter is accepted on these prompts at TP=1 (4.0 of
# 4); a drafter fed the wrong target layers, or nothing, stays far below.
MIN_MEAN_ACCEPTANCE_LENGTH = 3.5


def start_tp_engine(key, pair, kv_dtype: str, dflash: bool, tp: int = TP, draft_kv_dtype: str | None = None):
    target, draft = pair
    kwargs = dict(
        model=target, dtype="float32", kv_cache_dtype=kv_dtype, enable_prefix_caching=False, tensor_parallel_size=tp
    )
    if tp > 1:
        kwargs["distributed_executor_backend"] = "mp"
    if dflash:
        extra = {} if draft_kv_dtype is None else {"kv_cache_dtype": draft_kv_dtype}
        kwargs["speculative_config"] = dflash_settings.dflash_spec_config(draft, **extra)
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = parallel_workers.threads_bind_for_ranks(tp)
    try:
        return offline_engine.start_llm(key, **kwargs)
    finally:
        if saved is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved


def run(key, pair, kv_dtype: str, dflash: bool, tp: int = TP, draft_kv_dtype: str | None = None) -> dict:
    """One engine's greedy outputs, per-rank KV state and spec-decode counters;
    the engine is shut down after (its ranks take every core)."""
    llm = start_tp_engine(key, pair, kv_dtype, dflash, tp, draft_kv_dtype)
    try:
        ids, texts = greedy_runs.generate_ids(llm, PROMPTS, MAX_TOKENS)
        return {
            "ids": ids,
            "texts": texts,
            "ranks": llm.collective_rpc(worker_probes.worker_kv_state),
            "metrics": offline_engine.spec_metrics(llm) if dflash else {},
        }
    finally:
        offline_engine.shutdown_llm()


@pytest.fixture(scope="module")
def dflash_fp8_tp2(text_pair):
    return run(("dflash-text-tp2", "fp8"), text_pair, "fp8", dflash=True)


@pytest.fixture(scope="module")
def target_fp8_tp2(text_pair):
    return run(("target-text-tp2", "fp8"), text_pair, "fp8", dflash=False)


@pytest.mark.needs_patch("0001", "0002")
def test_every_rank_gives_the_draft_layers_an_fp8_cache(dflash_fp8_tp2):
    ranks = dflash_fp8_tp2["ranks"]
    assert len(ranks) == TP
    for rank, state in enumerate(ranks):
        draft = {n: s for n, s in state["layers"].items() if s["role"] == "draft"}
        print(
            f"\n[tp] rank {rank}: "
            + ", ".join(f"{n}: {s['kv_cache_dtype']}/{s['tensor_dtype']}" for n, s in sorted(state["layers"].items()))
        )
        assert len(draft) == 2 and len(state["layers"]) == 6, sorted(state["layers"])
        for name, s in state["layers"].items():
            assert (s["kv_cache_dtype"], s["tensor_dtype"]) == ("fp8", KV_TENSOR_DTYPE["fp8"]), (rank, name, s)


@pytest.mark.needs_patch("0001")
def test_every_rank_holds_half_the_kv_heads_and_the_expected_blocks(dflash_fp8_tp2, measurements):
    """Per rank: one of the two KV heads, and VLLM_CPU_KVCACHE_SPACE / (bytes
    per block over the 4 target + 2 draft layers) blocks -- twice TP=1's,
    fp8 taking one byte per element on every layer."""
    from vllm.fork.tiny_pairs import NUM_KV_HEADS

    space = int(float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * (1 << 30))
    blocks = []
    for rank, state in enumerate(dflash_fp8_tp2["ranks"]):
        per_block = 0
        for name, s in state["layers"].items():
            _two, _nb, kv_heads, block_size, head = s["tensor_shape"]
            assert kv_heads == NUM_KV_HEADS // TP, (rank, name, s["tensor_shape"])
            per_block += 2 * kv_heads * block_size * head * 1
        expected = space // per_block
        blocks.append(state["num_blocks"])
        assert abs(state["num_blocks"] - expected) <= max(2, expected // 100), (rank, state["num_blocks"], expected)
    measurements["TP=2 DFlash fp8 KV blocks per rank"] = blocks


def test_greedy_dflash_tp2_equals_target_only_tp2(dflash_fp8_tp2, target_fp8_tp2, measurements):
    """float32, fp8 KV: exact equality, token for token, and the answer is the text."""
    from vllm.fork.tiny_pairs import training_text

    got, want = dflash_fp8_tp2["ids"], target_fp8_tp2["ids"]
    equal = sum(g == w for g, w in zip(got, want))
    measurements["TP=2 fp8 float32: DFlash equal to target-only"] = f"{equal}/{len(PROMPTS)}"
    for prompt, text in zip(PROMPTS, dflash_fp8_tp2["texts"]):
        print(f"\n[tp] {prompt!r} -> {text!r}")
    assert got == want
    zen = training_text()
    assert (zen + zen).find(PROMPTS[0] + dflash_fp8_tp2["texts"][0][:32]) >= 0


@pytest.mark.needs_patch("0007")
def test_tp2_drafter_gets_its_target_layers(dflash_fp8_tp2, measurements):
    """The drafter was trained on the outputs of its target_layer_ids: fed
    those on every rank, nearly every draft is accepted."""
    m = dflash_fp8_tp2["metrics"]
    counts = DraftCounts.read(m)
    drafts, accepted, mal = counts.drafts, counts.accepted, counts.mean_acceptance_length
    measurements["TP=2 DFlash fp8 mean acceptance length (text pair)"] = round(mal, 3)
    print(f"\n[tp] drafts {drafts}, accepted {accepted}, mean acceptance length {mal:.3f}")
    assert mal >= MIN_MEAN_ACCEPTANCE_LENGTH, m


@pytest.fixture(scope="module")
def target_fp8_tp1(text_pair):
    return run(("target-text-tp1", "fp8"), text_pair, "fp8", dflash=False, tp=1)


def test_greedy_dflash_tp2_equals_target_only_tp1(dflash_fp8_tp2, target_fp8_tp1, measurements):
    """float32, fp8 KV: TP=2 with DFlash gives what one rank without it gives."""
    got, want = dflash_fp8_tp2["ids"], target_fp8_tp1["ids"]
    measurements["TP=2 DFlash vs TP=1 target-only, fp8 float32: equal"] = (
        f"{sum(g == w for g, w in zip(got, want))}/{len(PROMPTS)}"
    )
    assert len(target_fp8_tp1["ranks"]) == 1
    assert got == want


def test_auto_kv_tp2_every_rank_and_lossless(text_pair, measurements):
    """The `auto` KV cache (float32 here) with TP=2: every rank's draft layers
    take it, and DFlash equals target-only exactly."""
    dflash = run(("dflash-text-tp2", "auto"), text_pair, "auto", dflash=True)
    target = run(("target-text-tp2", "auto"), text_pair, "auto", dflash=False)
    for rank, state in enumerate(dflash["ranks"]):
        for name, layer in state["layers"].items():
            assert layer["tensor_dtype"] == KV_TENSOR_DTYPE["auto"], (rank, name, layer)
    measurements["TP=2 auto KV float32: DFlash equal to target-only"] = (
        f"{sum(g == w for g, w in zip(dflash['ids'], target['ids']))}/{len(PROMPTS)}"
    )
    measurements["TP=2 DFlash auto KV blocks per rank"] = [r["num_blocks"] for r in dflash["ranks"]]
    assert dflash["ids"] == target["ids"]


@pytest.mark.needs_patch("0027")
def test_drafter_kv_dtype_of_its_own_with_tp2(text_pair, target_fp8_tp2, measurements):
    """Target fp8 + drafter auto (speculative_config kv_cache_dtype) with
    TP=2: every rank's target layers hold fp8 caches and its draft layers
    float32 ones, DFlash equals target-only exactly, and the drafter is
    accepted as with one cache dtype."""
    out = run(("dflash-text-tp2", "fp8", "draft-auto"), text_pair, "fp8", dflash=True, draft_kv_dtype="auto")
    for rank, state in enumerate(out["ranks"]):
        for name, layer in state["layers"].items():
            want = "auto" if layer["role"] == "draft" else "fp8"
            assert (layer["kv_cache_dtype"], layer["tensor_dtype"]) == (want, KV_TENSOR_DTYPE[want]), (
                rank,
                name,
                layer,
            )
    counts = DraftCounts.read(out["metrics"])
    measurements["TP=2 target fp8 + drafter auto, float32: DFlash equal to target-only"] = (
        f"{sum(g == w for g, w in zip(out['ids'], target_fp8_tp2['ids']))}/{len(PROMPTS)}"
    )
    measurements["TP=2 target fp8 + drafter auto: mean acceptance length"] = round(counts.mean_acceptance_length, 3)
    assert out["ids"] == target_fp8_tp2["ids"]
    assert counts.mean_acceptance_length >= MIN_MEAN_ACCEPTANCE_LENGTH, out["metrics"]


def test_full_acceptance_pair_reaches_k_plus_one_with_tp2(full_pair, measurements):
    from vllm.fork.tiny_pairs import FULL_TOKEN

    out = run(("dflash-full-tp2", "fp8"), full_pair, "fp8", dflash=True)
    m = out["metrics"]
    counts = DraftCounts.read(m)
    drafts, accepted, mal = counts.drafts, counts.accepted, counts.mean_acceptance_length
    measurements["TP=2 full pair fp8 mean acceptance length"] = mal
    assert all(ids == [FULL_TOKEN] * MAX_TOKENS for ids in out["ids"])
    assert accepted == drafts * dflash_settings.NUM_SPEC_TOKENS and mal == dflash_settings.NUM_SPEC_TOKENS + 1


def test_served_api_with_tp2(text_pair, tmp_path, measurements):
    """`vllm serve --tensor-parallel-size 2` with DFlash and an fp8 KV cache
    answers with the text and shows DFlash's counters."""
    target, draft = text_pair
    args = [
        *dflash_settings.dflash_fp8_serve_args(draft),
        "--tensor-parallel-size",
        str(TP),
        "--distributed-executor-backend",
        "mp",
    ]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": parallel_workers.threads_bind_for_ranks(TP)}
    with VllmServer(target, args, tmp_path / "server.log", env=env) as srv:
        body = {"model": srv.model_id(), "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0.0}
        status, text = srv.post("/v1/completions", body)
        assert status == 200, text
        answer = json.loads(text)["choices"][0]["text"]
        metrics = srv.metrics()
        measurements["TP=2 vllm serve: start s"] = round(srv.start_s, 1)
    print(f"\n[tp] served: {answer!r}")
    assert answer.startswith(" ugly.\nExplicit is better than implicit.")
    assert metrics.get("vllm:spec_decode_num_accepted_tokens_total", 0) > 0, metrics


PP_START_BOUND_S = 120


def test_pipeline_parallelism_with_a_dflash_drafter_fails_fast(text_pair, measurements):
    """vLLM 0.21.0 has no pipeline parallelism for DFlash drafters: the start
    fails at configuration, before any model is loaded, naming pipeline
    parallelism and tensor parallelism as what works (patch 0021; its guard is
    in tests/engine/test_dflash_config_errors.py)."""
    from vllm import LLM

    target, draft = text_pair
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        LLM(
            model=target,
            dtype="float32",
            kv_cache_dtype="fp8",
            enforce_eager=True,
            pipeline_parallel_size=2,
            distributed_executor_backend="mp",
            speculative_config=dflash_settings.dflash_spec_config(draft),
        )
    seconds = time.monotonic() - t0
    measurements["PP=2 + DFlash refused"] = {
        "s": round(seconds, 1),
        "error": f"{type(info.value).__name__}: {info.value}"[:200],
    }
    assert "does not support pipeline parallelism" in str(info.value), info.value
    assert "--tensor-parallel-size" in str(info.value), info.value
    assert seconds < PP_START_BOUND_S
