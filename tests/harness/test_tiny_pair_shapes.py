"""The generated pair's attention sizes can be a real model's
(``tiny_pairs.attention_shape``; benchmarks/bench_dflash_fp8.py
``--pair-attention``), for runs where attention must not be negligible."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from vllm.fork import tiny_pairs


def test_a_pair_generated_inside_has_those_attention_sizes_and_later_ones_do_not(tmp_path):
    before = tiny_pairs.NUM_HEADS, tiny_pairs.NUM_KV_HEADS, tiny_pairs.HEAD_DIM
    with tiny_pairs.attention_shape(32, 8, 128):
        target, draft = tiny_pairs.generate_pair(tmp_path / "pair", "full")
    assert (tiny_pairs.NUM_HEADS, tiny_pairs.NUM_KV_HEADS, tiny_pairs.HEAD_DIM) == before
    for model, prefix in ((target, "model.layers.0"), (draft, "layers.0")):
        config = json.loads((Path(model) / "config.json").read_text())
        assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (32, 8, 128)
        with safe_open(f"{model}/model.safetensors", "pt") as weights:
            assert weights.get_slice(f"{prefix}.self_attn.q_proj.weight").get_shape()[0] == 32 * 128
            assert weights.get_slice(f"{prefix}.self_attn.k_proj.weight").get_shape()[0] == 8 * 128


def test_sizes_the_cpu_kernels_cannot_take_are_refused():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        with tiny_pairs.attention_shape(30, 8, 128):
            pass
    with pytest.raises(ValueError, match="head_dim"):
        with tiny_pairs.attention_shape(32, 8, 100):
            pass
