"""Tiny, seeded targets of the model families DFlash users serve, each with a
DFlash drafter trained against it.

    python -m vllm.fork.tiny_families --family FAMILY --out DIR [--seed N]

writes ``DIR/target`` and ``DIR/draft`` as :mod:`vllm.fork.tiny_pairs` does
for its Qwen3 pairs (same byte-level tokenizer, same drafter layout: a z-lab
``DFlashDraftModel`` of 2 Qwen3 layers, hidden size 256, block size 4, reading
target layers 1 and 2), for a target shaped like the real family, small only
in size:

``llama``
    ``LlamaForCausalLM`` (LLaMA-3.1-8B's layout): 4 dense layers, RoPE.
``qwen3_moe``
    ``Qwen3MoeForCausalLM`` (Qwen3-Coder-30B-A3B's layout): 4 layers, each a
    sparse MoE block (8 experts, top-2, normalized routing weights).
``qwen3_5``
    ``Qwen3_5ForConditionalGeneration`` (Qwen3.5/3.6 dense): the hybrid
    layout of the real checkpoints, 3 gated-delta-net (linear attention)
    layers to 1 full-attention layer, gated attention output, partial
    interleaved M-RoPE (``mrope_section`` over a quarter of the head), and a
    (tiny) vision tower, as the published checkpoints carry one. Served
    text-only (``limit_mm_per_prompt={"image": 0, "video": 0}``).
``qwen3_5_moe``
    ``Qwen3_5MoeForConditionalGeneration`` (Qwen3.6-35B-A3B's layout): the
    hybrid layout above with MoE blocks (8 experts, top-2, a shared expert).
``gpt_oss``
    ``GptOssForCausalLM`` (gpt-oss-20b/120b, unquantized as in their BF16
    releases): 4 layers alternating sliding-window (32 tokens here, 128 in
    the real ones) and full attention, a learned attention sink per head,
    YaRN RoPE, biases on every projection, and MoE blocks (8 experts, top-2)
    with the clamped SwiGLU of gpt-oss. Sinks are stored in bfloat16, as the
    checkpoints store them.

``--fp8-weights`` stores the target's attention and MLP projections as FP8
(e4m3) with one scale per 128x128 block, the format of the published FP8
checkpoints (Qwen3.6-35B-A3B-FP8: ``quant_method: fp8``, ``weight_block_size:
[128, 128]``, dynamic activation scales); embeddings, LM head, norms and the
gated-delta-net layers stay unquantized, and so does the drafter. The drafter
learns the continuations of the quantized target.

The target is random (transformers' initializer, seeded), with embedding and
LM head rows of standard deviation 1 so its greedy choices are clear-cut. The
drafter is trained as tiny_pairs' ``trained`` drafter is: on the target's
greedy continuations of :func:`vllm.fork.tiny_pairs.trained_prompts`, from the
outputs of target layers 1 and 2 computed by transformers. Fed those features
it drafts most tokens of those continuations; on other prompts few.
``draft/dflash_training.json`` records the reference acceptance.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from vllm.fork import tiny_pairs as tp

__all__ = ["FAMILIES", "ensure_family_pair", "generate_family_pair", "serve_overrides"]

FAMILIES = ("llama", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gpt_oss")
NUM_EXPERTS = 8
EXPERTS_PER_TOKEN = 2
MOE_INTERMEDIATE = 128
# Qwen3.5's rotary embedding covers a quarter of the head, interleaved over
# (temporal, height, width) sections that sum to half the rotary dimension.
PARTIAL_ROTARY = 0.25
MROPE_SECTION = [3, 3, 2]
# 3 gated-delta-net layers to 1 full-attention layer, as in every Qwen3.5/3.6.
HYBRID_LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]
LINEAR_KEY_HEADS = 2
LINEAR_VALUE_HEADS = 4
LINEAR_HEAD_DIM = 32
# gpt-oss: sliding-window layers first, then alternating with full attention.
GPT_OSS_LAYER_TYPES = ["sliding_attention", "full_attention"] * 2
GPT_OSS_SLIDING_WINDOW = 32
# gpt-oss-20b's RoPE: YaRN stretching a 4k-token base 32 times.
GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
}
RECORD = "pair.json"


def serve_overrides(family: str) -> dict:
    """Engine arguments a family's target needs besides the usual ones (the
    Qwen3.5 checkpoints are vision-language models served text-only)."""
    if family.startswith("qwen3_5"):
        return {"limit_mm_per_prompt": {"image": 0, "video": 0}}
    return {}


def _text_fields() -> dict:
    return {
        "vocab_size": tp.VOCAB_SIZE,
        "hidden_size": tp.HIDDEN,
        "intermediate_size": tp.INTERMEDIATE,
        "num_hidden_layers": tp.TARGET_LAYERS,
        "num_attention_heads": tp.NUM_HEADS,
        "num_key_value_heads": tp.NUM_KV_HEADS,
        "head_dim": tp.HEAD_DIM,
        "max_position_embeddings": tp.MAX_POSITIONS,
        "initializer_range": tp.WEIGHT_STD,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": tp.BOS_TOKEN,
        "eos_token_id": tp.EOS_TOKEN,
        "pad_token_id": tp.BOS_TOKEN,
    }


def _moe_fields() -> dict:
    return {
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": EXPERTS_PER_TOKEN,
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "norm_topk_prob": True,
    }


def _hybrid_text_fields() -> dict:
    return {
        **_text_fields(),
        "layer_types": list(HYBRID_LAYER_TYPES),
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": LINEAR_HEAD_DIM,
        "linear_value_head_dim": LINEAR_HEAD_DIM,
        "linear_num_key_heads": LINEAR_KEY_HEADS,
        "linear_num_value_heads": LINEAR_VALUE_HEADS,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": tp.ROPE_THETA,
            "partial_rotary_factor": PARTIAL_ROTARY,
            "mrope_section": list(MROPE_SECTION),
            "mrope_interleaved": True,
        },
    }


def _tiny_vision() -> dict:
    return {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": tp.HIDDEN,
        "num_position_embeddings": 64,
        "initializer_range": tp.WEIGHT_STD,
    }


def _build_target(family: str):
    """The family's transformers model with random weights (seeded by the caller)."""
    import transformers as tf

    rope = {"rope_type": "default", "rope_theta": tp.ROPE_THETA}
    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**_text_fields(), rope_parameters=rope))
    if family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            **_text_fields(), **_moe_fields(), decoder_sparse_step=1, mlp_only_layers=[], rope_parameters=rope
        )
        return tf.Qwen3MoeForCausalLM(cfg)
    if family == "qwen3_5":
        cfg = tf.Qwen3_5Config(
            text_config=_hybrid_text_fields(), vision_config=_tiny_vision(), tie_word_embeddings=False
        )
        return tf.Qwen3_5ForConditionalGeneration(cfg)
    if family == "qwen3_5_moe":
        text = {**_hybrid_text_fields(), **_moe_fields(), "shared_expert_intermediate_size": MOE_INTERMEDIATE}
        text.pop("intermediate_size")
        cfg = tf.Qwen3_5MoeConfig(text_config=text, vision_config=_tiny_vision(), tie_word_embeddings=False)
        return tf.Qwen3_5MoeForConditionalGeneration(cfg)
    if family == "gpt_oss":
        fields = {**_text_fields(), "intermediate_size": MOE_INTERMEDIATE}
        cfg = tf.GptOssConfig(
            **fields,
            num_local_experts=NUM_EXPERTS,
            num_experts_per_tok=EXPERTS_PER_TOKEN,
            layer_types=list(GPT_OSS_LAYER_TYPES),
            sliding_window=GPT_OSS_SLIDING_WINDOW,
            rope_parameters=dict(GPT_OSS_ROPE),
            attention_bias=True,
        )
        return tf.GptOssForCausalLM(cfg)
    raise ValueError(f"family must be one of {', '.join(FAMILIES)}: {family!r}")


def _exercise_biases_and_sinks(target, gen: torch.Generator) -> None:
    """Random biases (transformers starts them at zero, where a bias the
    engine dropped would not show) and sinks rounded to bfloat16 (the dtype
    the checkpoints store them in)."""
    with torch.no_grad():
        for name, param in target.named_parameters():
            if name.endswith("bias") or name.endswith("_bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * tp.WEIGHT_STD)
            elif name.endswith("sinks"):
                param.copy_(torch.randn(param.shape, generator=gen).to(torch.bfloat16).float())


# No "flash", "flex" or "sdpa" in the names: transformers takes such names for
# those kernels and checks that the model supports them.
FP8_KV_ATTENTION = "attention_over_fp8_kv"
# For models without an SDPA path (gpt-oss: its sinks): their own eager attention.
FP8_KV_EAGER_ATTENTION = "eager_attention_over_fp8_kv"
FP8_MAX = 448.0
# How an fp8 (e4m3) cache rounds what it stores differs between vLLM's CPU
# paths: torch's conversion (the path of CPUs without AVX-512) rounds to
# nearest, the compiled kernels of AVX-512 builds drop the low mantissa bits
# (toward zero). The drafter learns the continuations of both.
FP8_ROUNDINGS = ("nearest", "toward_zero")
_rounding = {"mode": "nearest"}


def fp8_e4m3_round(x: torch.Tensor, mode: str) -> torch.Tensor:
    """``x`` as an fp8 (e4m3, scale 1) KV cache stores it, back in x's dtype."""
    clamped = x.float().clamp(-FP8_MAX, FP8_MAX)
    nearest = clamped.to(torch.float8_e4m3fn)
    if mode == "toward_zero":
        bits = nearest.view(torch.uint8)
        # Magnitude one step down where rounding to nearest went up.
        away = (nearest.float().abs() > clamped.abs()) & (bits & 0x7F > 0)
        nearest = torch.where(away, bits - 1, bits).view(torch.float8_e4m3fn)
    return nearest.float().to(x.dtype)


def _fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA over keys and values rounded to fp8 as vLLM's attention reads them
    from an fp8 KV cache: the continuations the drafter learns are then the
    ones the target gives when served with ``--kv-cache-dtype fp8``. A random
    target is chaotic; trained on continuations of unquantized attention, the
    drafter would see them diverge a few tokens in."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mode = _rounding["mode"]
    return sdpa_attention_forward(
        module, query, fp8_e4m3_round(key, mode), fp8_e4m3_round(value, mode), attention_mask, **kwargs
    )


def _fp8_kv_eager_attention(module, query, key, value, attention_mask, **kwargs):
    """The same for a model without an SDPA path: its own eager attention
    (gpt-oss: the one that applies its sinks) over fp8-rounded keys and values."""
    own_eager_attention = sys.modules[type(module).__module__].eager_attention_forward
    mode = _rounding["mode"]
    return own_eager_attention(
        module, query, fp8_e4m3_round(key, mode), fp8_e4m3_round(value, mode), attention_mask, **kwargs
    )


def _attend_as_fp8_kv_cache(model) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(FP8_KV_ATTENTION, _fp8_kv_attention)
    AttentionInterface.register(FP8_KV_EAGER_ATTENTION, _fp8_kv_eager_attention)
    # An implementation without a mask function of its own gets no mask at
    # all: SDPA is then causal by itself, eager attention would attend to
    # every position. Eager attention adds the mask eager_mask makes (causal,
    # sliding windows included) to its scores.
    AttentionMaskInterface.register(FP8_KV_EAGER_ATTENTION, eager_mask)
    model.set_attn_implementation(FP8_KV_ATTENTION if model._supports_sdpa else FP8_KV_EAGER_ATTENTION)


def _embeddings(model) -> tuple[torch.Tensor, torch.Tensor]:
    return model.get_input_embeddings().weight, model.get_output_embeddings().weight


def _train_drafter_against(target, seed: int) -> tuple[dict[str, torch.Tensor], dict]:
    """A DFlash drafter fitted to ``target``'s greedy continuations of the
    trained prompts, and the record of what it learned."""
    from vllm.fork import dflash_reference as ref

    rng = tp._Rng(seed + 1)
    init: dict[str, torch.Tensor] = {}
    for i in range(tp.DRAFT_LAYERS):
        init.update(tp._layer_weights(rng, f"layers.{i}", const_dim=False))
    init["fc.weight"] = rng.normal(tp.HIDDEN, tp.HIDDEN * len(tp.TARGET_LAYER_IDS))
    init["hidden_norm.weight"] = torch.ones(tp.HIDDEN)
    init["norm.weight"] = torch.ones(tp.HIDDEN) * tp.TRAIN_INIT_NORM
    shape = ref.DraftShape(
        tp.HIDDEN,
        tp.INTERMEDIATE,
        tp.NUM_HEADS,
        tp.NUM_KV_HEADS,
        tp.HEAD_DIM,
        tp.DRAFT_LAYERS,
        tp.DFLASH_BLOCK_SIZE,
        tp.ROPE_THETA,
    )
    prompts = tp.trained_prompts(seed)
    prompt_len = len(prompts[0])
    embed, lm_head = (t.detach() for t in _embeddings(target))
    seqs, features = {}, {}
    with torch.no_grad():
        for mode in FP8_ROUNDINGS:
            _rounding["mode"] = mode
            seqs[mode] = ref.greedy_continuations(target, prompts, tp.TRAINED_NEW_TOKENS)
            features[mode] = ref.target_features(target, seqs[mode], tp.TARGET_LAYER_IDS)
    _rounding["mode"] = "nearest"
    trained = ref.train_drafter(
        init,
        shape,
        embed,
        lm_head,
        torch.cat(list(seqs.values())),
        torch.cat(list(features.values())),
        prompt_len - 1,
        tp.MASK_TOKEN,
        steps=tp.TRAIN_STEPS,
        lr=tp.TRAIN_LR,
    )
    record = {
        "prompt_token_ids": prompts,
        "target_layer_ids": list(tp.TARGET_LAYER_IDS),
        # Per rounding of the fp8 KV cache: the target's greedy continuations
        # and [drafts, accepted at draft position 1, 2, ...] along them.
        "continuations": {mode: seqs[mode][:, prompt_len:].tolist() for mode in FP8_ROUNDINGS},
        "reference_acceptance": {
            mode: ref.simulate_acceptance(
                trained, shape, embed, lm_head, seqs[mode], features[mode], prompt_len, tp.MASK_TOKEN
            )
            for mode in FP8_ROUNDINGS
        },
    }
    return trained, record


FP8_BLOCK = 128
# The quantization config of the published block-FP8 checkpoints.
FP8_WEIGHT_QUANTIZATION = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
}
# Projections stored in FP8 with --fp8-weights (their weight names end so).
FP8_WEIGHT_SUFFIXES = tuple(
    f"{m}.weight"
    for m in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
)


def _fp8_block_quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale per 128x128 block) with weight ~= fp8 * scale."""
    rows, cols = weight.shape
    blocks = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    padded = torch.zeros(blocks[0] * FP8_BLOCK, blocks[1] * FP8_BLOCK)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(blocks[0], FP8_BLOCK, blocks[1], FP8_BLOCK)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view_as(padded)[:rows, :cols].contiguous(), scale


def _store_fp8_weights(target, target_dir: Path) -> None:
    """Rewrite the saved target with block-FP8 projections and make the model
    in memory compute with exactly those weights (dequantized)."""
    from safetensors.torch import load_file, save_file

    path = target_dir / "model.safetensors"
    tensors = load_file(str(path))
    params = dict(target.named_parameters())
    quantized = []
    for name in sorted(tensors):
        if not name.endswith(FP8_WEIGHT_SUFFIXES) or tensors[name].dim() != 2:
            continue
        q, scale = _fp8_block_quantized(tensors[name])
        tensors[name] = q
        tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale
        rows, cols = q.shape
        dequantized = (
            q.float().view(rows, cols)
            * scale.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
        )
        with torch.no_grad():
            params[name].copy_(dequantized)
        quantized.append(name)
    if not quantized:
        raise RuntimeError(f"no projection of {target_dir} matched {FP8_WEIGHT_SUFFIXES}")
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((target_dir / "config.json").read_text())
    config["quantization_config"] = FP8_WEIGHT_QUANTIZATION
    (target_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def generate_family_pair(
    out_dir: str | os.PathLike, family: str, seed: int = 0, *, fp8_weights: bool = False
) -> tuple[str, str]:
    """Write ``out_dir/target`` and ``out_dir/draft``; return their paths."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}: {family!r}")
    out = Path(out_dir)
    target_dir, draft_dir = out / "target", out / "draft"
    torch.manual_seed(seed)
    target = _build_target(family).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in _embeddings(target):
            weight.copy_(torch.randn(weight.shape, generator=gen))
    _exercise_biases_and_sinks(target, gen)
    target.config.architectures = [type(target).__name__]
    target.save_pretrained(str(target_dir))
    tp._write_tokenizer(target_dir)
    if fp8_weights:
        _store_fp8_weights(target, target_dir)
    _attend_as_fp8_kv_cache(target)

    weights, record = _train_drafter_against(target, seed)
    tp._save(draft_dir, tp.drafter_config(), weights, dtype=torch.float32)
    (draft_dir / tp.TRAINING_RECORD).write_text(
        json.dumps({"family": family, "fp8_weights": fp8_weights, **record}, indent=1) + "\n"
    )
    return str(target_dir), str(draft_dir)


def _record(family: str, seed: int, fp8_weights: bool) -> dict:
    source = Path(__file__).read_bytes() + Path(tp.__file__).read_bytes()
    return {
        "generator_sha256": hashlib.sha256(source).hexdigest(),
        "torch": torch.__version__,
        "family": family,
        "seed": seed,
        "fp8_weights": fp8_weights,
    }


def ensure_family_pair(
    out_dir: str | os.PathLike, family: str, seed: int = 0, *, fp8_weights: bool = False
) -> tuple[tuple[str, str], bool]:
    """The pair under ``out_dir`` and whether it was (re)generated: a pair
    whose record matches is kept; otherwise a new one is written beside it and
    swapped in, the record last, so a reader never sees half a pair
    (:func:`vllm.fork.tiny_pairs.keep_or_generate`)."""
    return tp.keep_or_generate(
        out_dir,
        _record(family, seed, fp8_weights),
        lambda staging: generate_family_pair(staging, family, seed, fp8_weights=fp8_weights),
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=FAMILIES, required=True)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--fp8-weights", action="store_true", help="the target's projections in FP8 with 128x128 block scales"
    )
    args = ap.parse_args(argv)
    (t, d), written = ensure_family_pair(args.out, args.family, args.seed, fp8_weights=args.fp8_weights)
    print(f"target: {t}\ndraft:  {d}\n({'written' if written else 'up to date, kept'})")
    overrides = serve_overrides(args.family)
    if overrides:
        print(f"engine arguments this target needs: {json.dumps(overrides)}")


if __name__ == "__main__":
    main()
