"""Patch 0007: a DFlash drafter is fed the target layers it was trained on.

``dflash_config.target_layer_ids`` name target layers whose *output* the
drafter reads (transformers' ``hidden_states[id + 1]``); vLLM's auxiliary
hidden state ``L`` is the output of layer ``L - 1``, so the runner must tap
``id + 1``. EAGLE-3 ids (``eagle_aux_hidden_state_layer_ids``) are already in
vLLM's convention and must pass through unchanged.

The patch's necessity proof takes the unit-level checks (no engine); the
engine checks below run in every suite.
"""

from __future__ import annotations

from types import SimpleNamespace

import greedy_runs
import offline_engine
import pytest
import torch
import worker_probes


def _runner_aux_layers(hf_config):
    """GPUModelRunner's choice of aux layers (CPUModelRunner inherits it)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stub = SimpleNamespace(speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf_config)))
    return GPUModelRunner._get_eagle3_aux_layers_from_config(stub)


# --- unit level: the ids the runner derives -------------------------------
@pytest.mark.needs_patch("0007")
def test_runner_taps_dflash_target_layer_ids_plus_one(random_pair):
    from transformers import AutoConfig

    from vllm.fork.tiny_pairs import TARGET_LAYER_IDS

    cfg = AutoConfig.from_pretrained(random_pair[1])  # z-lab layout
    assert cfg.dflash_config["target_layer_ids"] == TARGET_LAYER_IDS
    assert not getattr(cfg, "eagle_aux_hidden_state_layer_ids", None)
    assert _runner_aux_layers(cfg) == tuple(i + 1 for i in TARGET_LAYER_IDS)


@pytest.mark.needs_patch("0007")
def test_speculators_dflash_config_keeps_its_aux_layers():
    """Speculators' ``aux_hidden_state_layer_ids`` are vLLM aux ids: the runner
    uses them as they are, and dflash_config states them in DFlash terms."""
    from transformers import PretrainedConfig

    from vllm.transformers_utils.configs.speculators.algos import update_dflash

    fields: dict = {}
    update_dflash({"aux_hidden_state_layer_ids": [2, 10, 18], "mask_token_id": 7}, fields)
    assert fields["dflash_config"]["target_layer_ids"] == [1, 9, 17]
    assert _runner_aux_layers(PretrainedConfig(**fields)) == (2, 10, 18)


def test_runner_passes_eagle3_aux_layer_ids_through():
    from transformers import PretrainedConfig

    eagle3 = PretrainedConfig(eagle_aux_hidden_state_layer_ids=[1, 17, 32])
    assert _runner_aux_layers(eagle3) == (1, 17, 32)
    # An EAGLE-3 field next to a DFlash one wins, unshifted.
    both = PretrainedConfig(eagle_aux_hidden_state_layer_ids=[3, 5], dflash_config={"target_layer_ids": [3, 5]})
    assert _runner_aux_layers(both) == (3, 5)


# --- live engine (fp32, so that layer L and L - 1 are told apart) ----------
def _trained_llm(trained_pair):
    # the engine test_dflash_kv.py's float32 losslessness check leaves running
    return offline_engine.start_trained_fp32(trained_pair)


def _prompts(draft: str) -> list[dict]:
    return [{"prompt_token_ids": ids} for ids in greedy_runs.training_record(draft)["prompt_token_ids"]]


def test_drafter_gets_outputs_of_target_layer_ids(trained_pair, measurements):
    """The hidden states vLLM hands the drafter for a prompt are the outputs
    of layers target_layer_ids, as transformers' Qwen3 computes them."""
    from transformers import Qwen3ForCausalLM

    from vllm.fork.tiny_pairs import TARGET_LAYER_IDS

    target, draft = trained_pair
    llm = _trained_llm(trained_pair)
    print(f"\n[e2e] runner aux layers: {llm.collective_rpc(worker_probes.worker_aux_layers)[0]}")
    llm.collective_rpc(worker_probes.worker_record_first_propose)
    prompt = _prompts(draft)[0]
    greedy_runs.generate_ids(llm, [prompt], max_tokens=2)
    (seen,) = llm.collective_rpc(worker_probes.worker_read_first_propose)[0]

    ids = prompt["prompt_token_ids"]
    assert seen["target_token_ids"].tolist() == ids  # the prefill step
    assert seen["target_positions"].tolist() == list(range(len(ids)))
    hf = Qwen3ForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states

    def layer_outputs(layer_ids):
        return torch.cat([states[i + 1][0] for i in layer_ids], dim=-1)

    got = seen["target_hidden_states"].float()
    expected = layer_outputs(TARGET_LAYER_IDS)
    one_below = layer_outputs([i - 1 for i in TARGET_LAYER_IDS])
    diff = (got - expected).abs().max().item()
    diff_below = (got - one_below).abs().max().item()
    scale = expected.abs().max().item()
    measurements["layer tap: max |vLLM - HF layer outputs| (fp32)"] = diff
    print(
        f"[e2e] drafter input vs HF outputs of layers {TARGET_LAYER_IDS}: max abs diff {diff:.2e}; "
        f"vs layers one below: {diff_below:.2e} (max |value| {scale:.1f})"
    )
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * scale)


def _acceptance(llm, prompts) -> tuple[list[int], list[list[int]]]:
    """[drafts, accepted at position 1, 2, ...] for one generate() call."""

    def counters():
        m = offline_engine.spec_metrics(llm)
        return [int(m["vllm:spec_decode_num_drafts"])] + [
            int(v) for v in m["vllm:spec_decode_num_accepted_tokens_per_pos"]
        ]

    before = counters()
    ids, _ = greedy_runs.generate_ids(llm, prompts, max_tokens=_new_tokens())
    return [a - b for a, b in zip(counters(), before)], ids


def _new_tokens() -> int:
    from vllm.fork.tiny_pairs import TRAINED_NEW_TOKENS

    return TRAINED_NEW_TOKENS


def _mal(counts: list[int]) -> float:
    return 1 + sum(counts[1:]) / counts[0]


def test_trained_drafter_accepts_more_with_its_layers(trained_pair, measurements):
    """Side by side on one engine: the runner's own aux layers vs the ids
    0.21.0 tapped (target_layer_ids unshifted), set in the worker."""
    from vllm.fork.tiny_pairs import TARGET_LAYER_IDS

    _, draft = trained_pair
    record = greedy_runs.training_record(draft)
    llm = _trained_llm(trained_pair)
    prompts = _prompts(draft)
    own_layers = llm.collective_rpc(worker_probes.worker_aux_layers)[0]
    build, build_ids = _acceptance(llm, prompts)
    try:
        assert llm.collective_rpc(worker_probes.worker_set_aux_layers, args=(TARGET_LAYER_IDS,))[0] == tuple(
            TARGET_LAYER_IDS
        )
        unshifted, unshifted_ids = _acceptance(llm, prompts)
    finally:
        llm.collective_rpc(worker_probes.worker_set_aux_layers, args=(own_layers,))

    rows = {
        f"this build (aux layers {own_layers})": build,
        f"0.21.0 ids (aux layers {tuple(TARGET_LAYER_IDS)})": unshifted,
    }
    ref = record["reference_acceptance"]
    rows["reference, DFlash convention"] = ref["right"]
    rows["reference, layers one below"] = ref["one_below"]
    print(f"\n[e2e] trained pair, {len(prompts)} prompts x {_new_tokens()} tokens, fp32, greedy:")
    for name, counts in rows.items():
        print(
            f"[e2e]   {name}: drafts {counts[0]}, accepted per position {counts[1:]}, "
            f"mean acceptance length {_mal(counts):.3f}"
        )
        measurements[f"trained pair acceptance: {name}"] = (counts, round(_mal(counts), 3))
    same = [a == b for a, b in zip(build_ids, unshifted_ids)]
    print(
        f"[e2e]   outputs identical in both runs: {same}; equal to the training "
        f"continuations: {[a == b for a, b in zip(build_ids, record['continuations'])]}"
    )
    assert build[0] > 0 and unshifted[0] > 0
    assert _mal(build) > _mal(unshifted)
