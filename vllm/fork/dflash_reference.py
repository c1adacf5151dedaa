"""A plain-torch DFlash drafter (z-lab layout), for training tiny drafters.

The forward pass follows the DFlash convention, independent of vLLM: the
drafter's context is ``fc`` of the target's hidden states
``hidden_states[id + 1]`` (the *output* of target layer ``id``) for every
``id`` in ``dflash_config.target_layer_ids``, taken from transformers'
implementation of the target. For an anchor position ``p`` (tokens up to
``p`` verified, next token ``x[p + 1]`` known), the drafter runs one
non-causal pass over the block ``[x[p + 1], mask, ..., mask]`` at positions
``p + 1 ... p + block_size``; each layer's queries attend to the context K/V
(``hidden_norm(fc(features))`` through that layer's k/v projections, for
positions ``0 ... p``) and to the whole block; the output at a mask position
predicts the token at that position.

:func:`train_drafter` fits such a drafter to a target's greedy continuations
(seeded, on CPU); :func:`simulate_acceptance` replays greedy speculative
decoding with it and counts accepted drafts per position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["DraftShape", "draft_logits", "target_features", "train_drafter", "simulate_acceptance"]


@dataclass(frozen=True)
class DraftShape:
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    block_size: int
    rope_theta: float
    rms_norm_eps: float = 1e-6


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding; x is [..., heads, head_dim], positions [...]."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [..., head_dim / 2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[..., None, :].to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1)[..., None, :].to(x.dtype)
    half = head_dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def target_features(target, input_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """[batch, seq, hidden * len(layer_ids)]: outputs of target layers ``layer_ids``."""
    out = target(input_ids=input_ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


def draft_logits(
    w: dict[str, torch.Tensor],
    shape: DraftShape,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    features: torch.Tensor,  # [B, T, F]
    block_ids: torch.Tensor,  # [B, A, block_size]: x[p + 1], mask, ...
    anchors: torch.Tensor,  # [B, A]: last context position p of each block
) -> torch.Tensor:
    """Logits [B, A, block_size - 1, vocab] at the mask positions of each block."""
    s = shape
    bsz, seq = features.shape[:2]
    num_anchors, block = block_ids.shape[1:]
    group = s.num_heads // s.num_kv_heads
    ctx = _rms_norm(features @ w["fc.weight"].T, w["hidden_norm.weight"], s.rms_norm_eps)
    ctx_pos = torch.arange(seq)
    block_pos = anchors[..., None] + 1 + torch.arange(block)  # [B, A, K]
    # Context position t is visible to the block anchored at p iff t <= p.
    ctx_visible = ctx_pos[None, None, :] <= anchors[..., None]  # [B, A, T]
    h = embed[block_ids]  # [B, A, K, H]
    residual = None
    for i in range(s.num_layers):
        p = f"layers.{i}."
        if residual is None:
            residual = h
        else:
            residual = h + residual
        x = _rms_norm(residual, w[p + "input_layernorm.weight"], s.rms_norm_eps)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).unflatten(-1, (s.num_heads, s.head_dim))
        k = (x @ w[p + "self_attn.k_proj.weight"].T).unflatten(-1, (s.num_kv_heads, s.head_dim))
        v = (x @ w[p + "self_attn.v_proj.weight"].T).unflatten(-1, (s.num_kv_heads, s.head_dim))
        q = _rope(_rms_norm(q, w[p + "self_attn.q_norm.weight"], s.rms_norm_eps), block_pos, s.rope_theta)
        k = _rope(_rms_norm(k, w[p + "self_attn.k_norm.weight"], s.rms_norm_eps), block_pos, s.rope_theta)
        ck = (ctx @ w[p + "self_attn.k_proj.weight"].T).unflatten(-1, (s.num_kv_heads, s.head_dim))
        cv = (ctx @ w[p + "self_attn.v_proj.weight"].T).unflatten(-1, (s.num_kv_heads, s.head_dim))
        ck = _rope(_rms_norm(ck, w[p + "self_attn.k_norm.weight"], s.rms_norm_eps), ctx_pos, s.rope_theta)
        # Heads of one KV group share K/V: [B, A, K, kv, group, d].
        qg = q.unflatten(-2, (s.num_kv_heads, group))
        scale = 1.0 / math.sqrt(s.head_dim)
        ctx_scores = torch.einsum("bakngd,btnd->bangkt", qg, ck) * scale
        ctx_scores = ctx_scores.masked_fill(~ctx_visible[:, :, None, None, None, :], float("-inf"))
        blk_scores = torch.einsum("bakngd,bajnd->bangkj", qg, k) * scale
        probs = torch.softmax(torch.cat([ctx_scores, blk_scores], -1), -1)
        attn = torch.einsum("bangkt,btnd->bakngd", probs[..., :seq], cv)
        attn = attn + torch.einsum("bangkj,bajnd->bakngd", probs[..., seq:], v)
        h = attn.flatten(-3) @ w[p + "self_attn.o_proj.weight"].T
        residual = h + residual
        x = _rms_norm(residual, w[p + "post_attention_layernorm.weight"], s.rms_norm_eps)
        gate = x @ w[p + "mlp.gate_proj.weight"].T
        up = x @ w[p + "mlp.up_proj.weight"].T
        h = (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    out = _rms_norm(h + residual, w["norm.weight"], s.rms_norm_eps)
    return out[:, :, 1:] @ lm_head.T


@torch.no_grad()
def greedy_continuations(target, prompts: list[list[int]], num_new: int) -> torch.Tensor:
    """[len(prompts), prompt_len + num_new]: prompts (of one length) + greedy tokens.

    A plain argmax loop: no generation config, and EOS is neither suppressed
    nor a stop, as with vLLM's ``ignore_eos``.
    """
    ids = torch.tensor(prompts)
    for _ in range(num_new):
        next_ids = target(input_ids=ids).logits[:, -1].argmax(-1)
        ids = torch.cat([ids, next_ids[:, None]], dim=1)
    return ids


def _blocks(seqs: torch.Tensor, anchors: torch.Tensor, block: int, mask_token: int):
    """Block input ids [B, A, K] and the tokens they should predict [B, A, K - 1]."""
    offsets = torch.arange(1, block + 1)
    pos = anchors[..., None] + offsets  # positions p + 1 ... p + K
    gathered = torch.gather(seqs[:, None, :].expand(-1, anchors.shape[1], -1), 2, pos)
    block_ids = torch.full_like(gathered, mask_token)
    block_ids[..., 0] = gathered[..., 0]
    return block_ids, gathered[..., 1:]


def train_drafter(
    w: dict[str, torch.Tensor],
    shape: DraftShape,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    seqs: torch.Tensor,
    features: torch.Tensor,
    first_anchor: int,
    mask_token: int,
    *,
    steps: int,
    lr: float,
    log_every: int = 0,
) -> dict[str, torch.Tensor]:
    """Full-batch Adam on the cross-entropy of every draft position.

    Every block anchored at ``first_anchor ...`` of every sequence is a
    training example; ``embed``/``lm_head`` (the target's) stay frozen.
    """
    params = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    opt = torch.optim.Adam(params.values(), lr=lr)
    anchors = torch.arange(first_anchor, seqs.shape[1] - shape.block_size)
    anchors = anchors[None].expand(len(seqs), -1)
    block_ids, labels = _blocks(seqs, anchors, shape.block_size, mask_token)
    for step in range(steps):
        logits = draft_logits(params, shape, embed, lm_head, features, block_ids, anchors)
        loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"[dflash_reference] step {step}: loss {loss.item():.4f}")
    return {k: v.detach() for k, v in params.items()}


@torch.no_grad()
def simulate_acceptance(
    w: dict[str, torch.Tensor],
    shape: DraftShape,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    seqs: torch.Tensor,
    features: torch.Tensor,
    prompt_len: int,
    mask_token: int,
) -> list[int]:
    """Accepted drafts per position along greedy speculative decoding of ``seqs``.

    ``seqs`` are the target's greedy sequences (prompt of ``prompt_len`` tokens
    + continuation); returns ``[drafts, accepted at position 1, 2, ...]``.
    """
    num_spec = shape.block_size - 1
    seq_len = seqs.shape[1]
    anchors = torch.arange(prompt_len - 1, seq_len - shape.block_size)[None].expand(len(seqs), -1)
    block_ids, labels = _blocks(seqs, anchors, shape.block_size, mask_token)
    drafts = draft_logits(w, shape, embed, lm_head, features, block_ids, anchors).argmax(-1)
    hits = (drafts == labels).long().cumprod(-1)  # leading matches
    counts = [0] * (num_spec + 1)
    for b in range(len(seqs)):
        p = prompt_len - 1
        while p - (prompt_len - 1) < anchors.shape[1]:
            row = hits[b, p - (prompt_len - 1)]
            accepted = int(row.sum())
            counts[0] += 1
            for j in range(accepted):
                counts[j + 1] += 1
            p += 1 + accepted
    return counts
