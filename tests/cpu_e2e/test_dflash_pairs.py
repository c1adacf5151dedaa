"""A full-acceptance pair (every draft accepted) and a drafter whose fp8
KV cache has scales of its own (they must reach the draft attention)."""

from __future__ import annotations

import dflash_settings
import greedy_runs
import offline_engine
import pytest
import worker_probes
from draft_counts import DraftCounts


# Not 0001, 0003, 0004, 0005 or 0007: their proofs take guards that need no
# engine (each would otherwise add half a minute or more to its proof).
@pytest.mark.needs_patch("0002", no_avx512_pass=True)
def test_full_acceptance_pair_accepts_every_draft(full_pair, measurements):
    from vllm.fork.tiny_pairs import FULL_TOKEN

    llm = offline_engine.start_dflash_fp8("dflash-full", full_pair)
    ids, _ = greedy_runs.generate_ids(llm)
    m = offline_engine.spec_metrics(llm)
    counts = DraftCounts.read(m)
    drafts, draft_tokens, accepted = counts.drafts, counts.draft_tokens, counts.accepted
    mal = counts.mean_acceptance_length
    measurements["mean acceptance length full pair kv=fp8"] = mal
    print(
        f"\n[e2e] full pair: drafts {drafts}, draft tokens {draft_tokens}, accepted {accepted}, "
        f"per position {m.get('vllm:spec_decode_num_accepted_tokens_per_pos')}, "
        f"mean acceptance length {mal:.3f} (num_speculative_tokens + 1 = {dflash_settings.NUM_SPEC_TOKENS + 1})"
    )
    assert all(t == [FULL_TOKEN] * dflash_settings.MAX_TOKENS for t in ids)
    assert drafts > 0
    assert accepted == draft_tokens == drafts * dflash_settings.NUM_SPEC_TOKENS
    assert mal == dflash_settings.NUM_SPEC_TOKENS + 1


def test_stop_string_inside_an_accepted_block_ends_the_output_there(full_pair):
    """The full pair accepts every draft, so each step brings
    NUM_SPEC_TOKENS + 1 tokens "a": a stop string "aaa" completes inside such
    a block. Without speculation the output is the three tokens that complete
    it (text empty, the stop string excluded); with DFlash it must be too --
    token ids, logprobs, finish and stop reason -- not the whole block.
    Reuses the full pair's engine."""
    from vllm import SamplingParams
    from vllm.fork.tiny_pairs import FULL_TOKEN

    llm = offline_engine.start_dflash_fp8("dflash-full", full_pair)
    stop = chr(FULL_TOKEN) * 3
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, stop=[stop], logprobs=0, include_stop_str_in_output=include)
        for include in (False, True)
    ]
    excluded, included = (llm.generate([greedy_runs.PROMPTS[0]], p, use_tqdm=False)[0].outputs[0] for p in params)
    for out, text in ((excluded, ""), (included, stop)):
        assert list(out.token_ids) == [FULL_TOKEN] * 3, out
        assert len(out.logprobs) == 3, out.logprobs
        assert (out.text, out.finish_reason, out.stop_reason) == (text, "stop", stop), out


def test_draft_attention_works_with_repacked_linear_weights(full_pair):
    """CPU GEMM dispatch may repack a linear layer's weight and leave
    ``.weight`` empty (oneDNN/SGL on AVX-512 builds); the draft attention must
    call its qkv_proj layer, not F.linear on the weight. The repacking is
    applied to the drafter explicitly, so this holds on every CPU. Reuses the
    full pair's engine from the test above when it runs first."""
    from vllm.fork.tiny_pairs import FULL_TOKEN

    llm = offline_engine.start_dflash_fp8("dflash-full", full_pair)
    changed, already = llm.collective_rpc(worker_probes.worker_repack_draft_linear_weights)[0]
    try:
        before = offline_engine.spec_metrics(llm)["vllm:spec_decode_num_drafts"]
        ids, _ = greedy_runs.generate_ids(llm, max_tokens=16)
        drafts = offline_engine.spec_metrics(llm)["vllm:spec_decode_num_drafts"] - before
    finally:
        offline_engine.shutdown_llm()  # the drafter is altered: no later test may reuse it
    print(
        f"\n[e2e] repacked {changed} draft linear layers here, {already} by the base's own GEMM dispatch; "
        f"{drafts} drafts after that"
    )
    assert changed + already > 0
    assert all(t == [FULL_TOKEN] * 16 for t in ids)
    assert drafts > 0


def test_draft_kv_scales_reach_draft_attention(kv_scales_pair, measurements):
    """The drafter declares an fp8 quantization config (all linear layers
    ignored, so weights stay bf16) and ships k/v scales 0.5/0.25 per layer;
    with quant_config passed to the draft layers they load the scales.
    (The k_scale/v_scale parameters themselves are gone after loading: vLLM
    folds them into the layer's float scales, which is what we read.)"""
    llm = offline_engine.start_dflash_fp8("dflash-kvscales", kv_scales_pair)
    ids, _ = greedy_runs.generate_ids(llm, max_tokens=32)
    state = llm.collective_rpc(worker_probes.worker_kv_state)[0]
    offline_engine.shutdown_llm()
    draft_layers = {n: s for n, s in state["layers"].items() if s["role"] == "draft"}
    target_layers = {n: s for n, s in state["layers"].items() if s["role"] == "target"}
    print(
        "\n[e2e] kv scales: "
        + ", ".join(f"{n}: k={s['k_scale']} v={s['v_scale']}" for n, s in sorted(state["layers"].items()))
    )
    assert len(draft_layers) == 2
    for name, s in draft_layers.items():
        assert (s["k_scale"], s["v_scale"]) == (0.5, 0.25), (name, s)
        assert s["kv_cache_dtype"] == "fp8", (name, s)
    for name, s in target_layers.items():
        assert (s["k_scale"], s["v_scale"]) == (1.0, 1.0), (name, s)
    assert all(len(t) == 32 for t in ids)
