"""Tiny, seeded Qwen3 target + DFlash drafter pairs, generated locally.

    python -m vllm.fork.tiny_pairs --out DIR [--acceptance none|partial|full|trained|text]
                                   [--seed N] [--draft-kv-scales K V]

writes ``DIR/target`` (a ``Qwen3ForCausalLM``) and ``DIR/draft`` (a DFlash
drafter in the z-lab layout: ``architectures: ["DFlashDraftModel"]``,
``block_size``, ``num_target_layers``, ``dflash_config: {mask_token_id,
target_layer_ids}``; its checkpoint has no ``embed_tokens``/``lm_head``, so
vLLM shares the target's, as with z-lab drafters). Both directories carry the
same local byte-level tokenizer (``PreTrainedTokenizerFast`` with a chat
template) and bf16 safetensors weights (fp32 for a trained drafter). No
network access is needed, and the same arguments give byte-identical files
(for ``trained``: on the same machine and torch version).

Sizes are chosen for vLLM's CPU backend: head_dim 64 (CPU attention supports
it, and it is a multiple of 32 as the fp8 KV cache on CPU requires), hidden
size 256, 4 target layers, 2 draft layers, vocabulary of 260 tokens.

Acceptance knob -- how a draft compares with the target under greedy decoding:

``none``
    target and drafter are independent random models: drafts are almost never
    accepted.
``full``
    every draft is accepted. One residual-stream dimension ``D`` is made a
    positive constant: every embedding row has ``E[:, D] = C > 0`` and, in
    every layer of both models, the rows ``D`` of ``o_proj`` and ``down_proj``
    (the only writes into the residual stream) are zero, so the hidden state
    entering the final norm has ``h[D] = C`` at every position, whatever the
    context. Both final norms have weight ``e_D`` (1 at ``D``, 0 elsewhere),
    so the normed state is ``(C / rms(h)) * e_D`` and the logits are
    ``lm_head[:, D] * C / rms(h)``. The (shared) lm_head column ``D`` is
    ``B > 0`` at token ``FULL_TOKEN`` and 0 elsewhere, so both models put a
    strictly positive logit on ``FULL_TOKEN`` and exactly 0 on every other
    token, in any precision: the target always emits ``FULL_TOKEN`` and every
    draft token equals it. Everything else (attention, MLPs, the context K/V
    the drafter attends to) stays random and is computed for real.
``partial``
    the drafter is the ``full`` drafter (always proposes ``FULL_TOKEN``); the
    target keeps ``h[D] = C`` but its final norm weight is all ones, so its
    random logits compete with the ``FULL_TOKEN`` bias: the target emits
    ``FULL_TOKEN`` at some positions only, and drafts are partly accepted.
``trained``
    the ``none`` target, and a drafter trained (10-30 s on 2 CPU cores)
    against it, on the features the DFlash convention gives it: the outputs
    of target layers ``TARGET_LAYER_IDS`` (transformers' ``hidden_states[id +
    1]``), for the greedy continuations of :func:`trained_prompts`. The
    random target is chaotic, so the drafter can only learn those
    continuations by keying on the context features: fed exactly these
    features (in fp32, greedy, ``TRAINED_NEW_TOKENS`` tokens) it drafts
    nearly every token; fed the outputs of other layers, or nothing, far
    fewer. ``draft/dflash_training.json`` records the prompts and the
    acceptance counts :mod:`vllm.fork.dflash_reference` measured with the
    right layers, the layers one below, and no features.
``text``
    a target that answers in words and a drafter trained against it: the
    target (random start, smaller ``lm_head``) is trained for
    ``TEXT_TARGET_STEPS`` steps (about 30-40 s on 2 cores) on The Zen of
    Python, the text the standard library's ``this`` module carries, so it
    continues any line of it ("Beautiful is better than" -> " ugly.\nExplicit
    is better than implicit. ..."); the drafter is then trained as for
    ``trained``, on the target's greedy continuations of every line's start.
    Offline and seeded like the others.

:func:`ensure_pair` (and the command line) keep a pair that is already in
``DIR`` when it was made by this same generator, torch version and
arguments (recorded in ``DIR/pair.json``), and otherwise write a new one
beside it and swap it in, so a reader never sees half a pair.

``--draft-kv-scales K V`` makes the drafter checkpoint declare an fp8
quantization config (``quant_method: fp8``, static activations, every linear
layer listed in ``ignored_layers`` so the weights stay bf16) and ship
per-layer KV-cache scales ``layers.N.self_attn.{k,v}_proj.{k,v}_scale``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch

__all__ = [
    "ensure_pair",
    "generate_pair",
    "trained_prompts",
    "text_prompts",
    "training_text",
    "FULL_TOKEN",
    "MASK_TOKEN",
    "VOCAB_SIZE",
]

# --- vocabulary: 256 byte tokens + 4 special tokens -------------------------
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
EOS_TOKEN = 256 + SPECIAL_TOKENS.index("<|im_end|>")
BOS_TOKEN = 256 + SPECIAL_TOKENS.index("<|endoftext|>")
MASK_TOKEN = 256 + SPECIAL_TOKENS.index("<|mask|>")

# --- model sizes --------------------------------------------------------------
HIDDEN = 256
INTERMEDIATE = 512
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 64
TARGET_LAYERS = 4
DRAFT_LAYERS = 2
TARGET_LAYER_IDS = [1, 2]  # target layers whose hidden states feed the drafter
DFLASH_BLOCK_SIZE = 4  # drafter trained block: 1 bonus + 3 mask tokens
MAX_POSITIONS = 4096
ROPE_THETA = 1000000.0

# --- degenerate construction (acceptance "full"/"partial") -------------------
CONST_DIM = 7  # residual-stream dimension D held constant
CONST_VALUE = 1.0  # C
FULL_TOKEN = ord("a")  # byte tokens have id == byte value
FULL_BIAS = {"full": 1.0, "partial": 10.0}  # B / sqrt(hidden); partial: tuned

# --- trained drafter (acceptance "trained") ----------------------------------
TRAINED_NUM_PROMPTS = 6
TRAINED_PROMPT_LEN = 12
TRAINED_NEW_TOKENS = 64
TRAIN_STEPS = 80  # the loss is ~1e-3 by then
TRAIN_LR = 3e-3
# Logits of the random drafter are ~16 wide (lm_head rows have std 1): a
# smaller final norm weight starts training from unsaturated logits.
TRAIN_INIT_NORM = 0.3
TRAINING_RECORD = "dflash_training.json"

# --- a target that answers in words (acceptance "text") ----------------------
TEXT_TARGET_STEPS = 150  # the loss is ~0.02 by then; every line continues verbatim
TEXT_TARGET_LR = 5e-3
TEXT_WINDOW = 192  # tokens per training window (the text is 856 bytes)
TEXT_BATCH = 6
# The random lm_head (std 1) gives logits ~16 wide; a tenth of it starts the
# target's training from a loss near log(vocab) instead of ~50.
TEXT_LM_HEAD_SCALE = 0.1
TEXT_PROMPT_LEN = 12
TEXT_NEW_TOKENS = 64

ACCEPTANCE_MODES = ("none", "partial", "full", "trained", "text")
PAIR_RECORD = "pair.json"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

WEIGHT_STD = 0.08


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}  # token id == byte value
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|mask|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
    )
    assert len(fast) == VOCAB_SIZE
    fast.save_pretrained(str(out))


def _qwen3_config(num_layers: int) -> dict:
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_TOKEN,
        "eos_token_id": EOS_TOKEN,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": WEIGHT_STD,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": MAX_POSITIONS,
        "max_window_layers": num_layers,
        "model_type": "qwen3",
        "num_attention_heads": NUM_HEADS,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": NUM_KV_HEADS,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB_SIZE,
    }


def drafter_config(num_target_layers: int = TARGET_LAYERS) -> dict:
    """config.json of a z-lab DFlash drafter of DRAFT_LAYERS Qwen3 layers
    reading TARGET_LAYER_IDS of a target of ``num_target_layers`` layers."""
    config = _qwen3_config(DRAFT_LAYERS)
    config.update(
        {
            "architectures": ["DFlashDraftModel"],
            "block_size": DFLASH_BLOCK_SIZE,
            "num_target_layers": num_target_layers,
            "dflash_config": {"mask_token_id": MASK_TOKEN, "target_layer_ids": list(TARGET_LAYER_IDS)},
        }
    )
    return config


class _Rng:
    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def normal(self, *shape: int, std: float = WEIGHT_STD) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=torch.float32) * std


def _layer_weights(rng: _Rng, prefix: str, const_dim: bool) -> dict[str, torch.Tensor]:
    q, kv = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    w = {
        f"{prefix}.input_layernorm.weight": torch.ones(HIDDEN),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(HIDDEN),
        f"{prefix}.self_attn.q_proj.weight": rng.normal(q, HIDDEN),
        f"{prefix}.self_attn.k_proj.weight": rng.normal(kv, HIDDEN),
        f"{prefix}.self_attn.v_proj.weight": rng.normal(kv, HIDDEN),
        f"{prefix}.self_attn.o_proj.weight": rng.normal(HIDDEN, q),
        f"{prefix}.self_attn.q_norm.weight": torch.ones(HEAD_DIM),
        f"{prefix}.self_attn.k_norm.weight": torch.ones(HEAD_DIM),
        f"{prefix}.mlp.gate_proj.weight": rng.normal(INTERMEDIATE, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": rng.normal(INTERMEDIATE, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": rng.normal(HIDDEN, INTERMEDIATE),
    }
    if const_dim:
        # No write into residual dimension D: it keeps the embedding's C.
        w[f"{prefix}.self_attn.o_proj.weight"][CONST_DIM, :] = 0.0
        w[f"{prefix}.mlp.down_proj.weight"][CONST_DIM, :] = 0.0
    return w


def _save(out: Path, config: dict, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # KV-cache scales stay float32 (as in fp8 checkpoints).
    tensors = {k: (v if k.endswith("_scale") else v.to(dtype)).contiguous() for k, v in sorted(weights.items())}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer(out)


def trained_prompts(seed: int = 0) -> list[list[int]]:
    """Token ids (lowercase letters) of the prompts a ``trained`` drafter learns."""
    rng = random.Random(seed)
    return [
        [rng.randrange(ord("a"), ord("z") + 1) for _ in range(TRAINED_PROMPT_LEN)] for _ in range(TRAINED_NUM_PROMPTS)
    ]


def training_text() -> str:
    """The Zen of Python, decoded from the rot13 string in the standard
    library's ``this`` module; the file is parsed, not imported (importing it
    prints the text)."""
    import ast
    import codecs
    import importlib.util

    spec = importlib.util.find_spec("this")
    if spec is None or spec.origin is None:
        raise RuntimeError("the standard library's 'this' module is missing; the text pair needs it")
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and [getattr(t, "id", None) for t in node.targets] == ["s"]
        ):
            return codecs.decode(node.value.value, "rot13")
    raise RuntimeError(f"no text string 's' in {spec.origin}")


def text_prompts() -> list[list[int]]:
    """The first ``TEXT_PROMPT_LEN`` tokens of every line of the training text."""
    ids = list(training_text().encode()) * 2  # cyclic: the last line wraps around
    n = len(ids) // 2
    starts = [0] + [i + 1 for i in range(n - 1) if ids[i] == ord("\n")]
    return [ids[s : s + TEXT_PROMPT_LEN] for s in starts]


def _train_target_on_text(target_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """Train the target at ``target_dir`` on :func:`training_text`.

    Windows of the text read cyclically, half of them starting at a line, so
    the target continues a prompt taken from the start of any line.
    """
    import torch.nn.functional as F
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(TEXT_LM_HEAD_SCALE)
    model.train()
    ids = torch.tensor(list(training_text().encode()))
    n = len(ids)
    cyclic = torch.cat([ids, ids])
    line_starts = torch.tensor([0] + [i + 1 for i in range(n - 1) if ids[i] == ord("\n")])
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=TEXT_TARGET_LR)
    at_line = torch.arange(TEXT_BATCH) % 2 == 0
    for _ in range(TEXT_TARGET_STEPS):
        anywhere = torch.randint(0, n, (TEXT_BATCH,), generator=gen)
        lines = line_starts[torch.randint(0, len(line_starts), (TEXT_BATCH,), generator=gen)]
        starts = torch.where(at_line, lines, anywhere)
        x = torch.stack([cyclic[s : s + TEXT_WINDOW] for s in starts.tolist()])
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _train_draft(
    target_dir: Path,
    draft_weights: dict[str, torch.Tensor],
    prompts: list[list[int]],
    new_tokens: int,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Fit the drafter to the target's greedy continuations of ``prompts``
    (all of one length); return weights + record."""
    from transformers import Qwen3ForCausalLM

    from vllm.fork import dflash_reference as ref

    shape = ref.DraftShape(
        HIDDEN,
        INTERMEDIATE,
        NUM_HEADS,
        NUM_KV_HEADS,
        HEAD_DIM,
        DRAFT_LAYERS,
        DFLASH_BLOCK_SIZE,
        ROPE_THETA,
    )
    target = Qwen3ForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    embed = target.model.embed_tokens.weight.detach()
    lm_head = target.lm_head.weight.detach()
    init = dict(draft_weights, **{"norm.weight": draft_weights["norm.weight"] * TRAIN_INIT_NORM})
    prompt_len = len(prompts[0])
    with torch.no_grad():
        seqs = ref.greedy_continuations(target, prompts, new_tokens)
        features = {
            "right": ref.target_features(target, seqs, TARGET_LAYER_IDS),
            "one_below": ref.target_features(target, seqs, [i - 1 for i in TARGET_LAYER_IDS]),
        }
        features["none"] = torch.zeros_like(features["right"])
    trained = ref.train_drafter(
        init,
        shape,
        embed,
        lm_head,
        seqs,
        features["right"],
        prompt_len - 1,
        MASK_TOKEN,
        steps=TRAIN_STEPS,
        lr=TRAIN_LR,
    )
    record = {
        "prompt_token_ids": prompts,
        "continuations": seqs[:, prompt_len:].tolist(),
        "target_layer_ids": list(TARGET_LAYER_IDS),
        # [drafts, accepted at draft position 1, 2, ...] per feature choice
        "reference_acceptance": {
            name: ref.simulate_acceptance(trained, shape, embed, lm_head, seqs, f, prompt_len, MASK_TOKEN)
            for name, f in features.items()
        },
    }
    return trained, record


@contextlib.contextmanager
def attention_shape(num_heads: int, num_kv_heads: int, head_dim: int):
    """Pairs generated inside this block have attention layers of these sizes
    (every other size unchanged): a benchmark can give the tiny pair a real
    model's attention, say Qwen3-8B's 32 query and 8 KV heads of 128, so that
    attention is what a decode step spends its time on."""
    global NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
    if num_heads % num_kv_heads or head_dim % 32:
        raise ValueError(
            f"attention_shape: num_heads ({num_heads}) must be a multiple of num_kv_heads "
            f"({num_kv_heads}) and head_dim ({head_dim}) of 32 (the CPU attention kernels' unit)"
        )
    saved = NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
    NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = num_heads, num_kv_heads, head_dim
    try:
        yield
    finally:
        NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = saved


def generate_pair(
    out_dir: str | os.PathLike,
    acceptance: str = "none",
    seed: int = 0,
    *,
    draft_kv_scales: tuple[float, float] | None = None,
) -> tuple[str, str]:
    """Write a target/drafter pair under ``out_dir``; return their paths."""
    if acceptance not in ACCEPTANCE_MODES:
        raise ValueError(f"acceptance must be one of {', '.join(ACCEPTANCE_MODES)}: {acceptance!r}")
    out = Path(out_dir)
    target_dir, draft_dir = out / "target", out / "draft"
    degenerate = acceptance in ("partial", "full")
    rng = _Rng(seed)

    # ---- target -------------------------------------------------------------
    embed = rng.normal(VOCAB_SIZE, HIDDEN, std=1.0)
    lm_head = rng.normal(VOCAB_SIZE, HIDDEN, std=1.0)
    tw: dict[str, torch.Tensor] = {}
    for i in range(TARGET_LAYERS):
        tw.update(_layer_weights(rng, f"model.layers.{i}", degenerate))
    final_norm = torch.ones(HIDDEN)
    if degenerate:
        embed[:, CONST_DIM] = CONST_VALUE
        lm_head[:, CONST_DIM] = 0.0
        lm_head[FULL_TOKEN, CONST_DIM] = FULL_BIAS[acceptance] * HIDDEN**0.5
        if acceptance == "full":
            final_norm = torch.zeros(HIDDEN)
            final_norm[CONST_DIM] = 1.0
    tw["model.embed_tokens.weight"] = embed
    tw["lm_head.weight"] = lm_head
    tw["model.norm.weight"] = final_norm
    tconf = _qwen3_config(TARGET_LAYERS)
    tconf["architectures"] = ["Qwen3ForCausalLM"]
    _save(target_dir, tconf, tw)
    if acceptance == "text":
        _save(target_dir, tconf, _train_target_on_text(target_dir, seed))

    # ---- drafter (z-lab DFlash layout; shares embed_tokens/lm_head) ---------
    dw: dict[str, torch.Tensor] = {}
    for i in range(DRAFT_LAYERS):
        dw.update(_layer_weights(rng, f"layers.{i}", degenerate))
    dw["fc.weight"] = rng.normal(HIDDEN, HIDDEN * len(TARGET_LAYER_IDS))
    dw["hidden_norm.weight"] = torch.ones(HIDDEN)
    draft_norm = torch.ones(HIDDEN)
    if degenerate:
        draft_norm = torch.zeros(HIDDEN)
        draft_norm[CONST_DIM] = 1.0
    dw["norm.weight"] = draft_norm
    dconf = drafter_config()
    if draft_kv_scales is not None:
        k_scale, v_scale = (float(s) for s in draft_kv_scales)
        ignored = ["model.fc"]
        for i in range(DRAFT_LAYERS):
            # vLLM names the draft layers after the target's (start_layer_id).
            p = f"model.layers.{TARGET_LAYERS + i}"
            ignored += [f"{p}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")]
            ignored += [f"{p}.self_attn.qkv_proj", f"{p}.self_attn.o_proj"]
            ignored += [f"{p}.mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")]
            ignored += [f"{p}.mlp.gate_up_proj"]
            dw[f"layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(k_scale)
            dw[f"layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(v_scale)
        dconf["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "static",
            "ignored_layers": ignored,
            "kv_cache_scheme": {"type": "float", "num_bits": 8, "dynamic": False},
        }
    if acceptance in ("trained", "text"):
        if acceptance == "trained":
            prompts, new_tokens = trained_prompts(seed), TRAINED_NEW_TOKENS
        else:
            prompts, new_tokens = text_prompts(), TEXT_NEW_TOKENS
        dw, record = _train_draft(target_dir, dw, prompts, new_tokens)
        _save(draft_dir, dconf, dw, dtype=torch.float32)
        (draft_dir / TRAINING_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    else:
        _save(draft_dir, dconf, dw)
    return str(target_dir), str(draft_dir)


def _pair_record(acceptance: str, seed: int, draft_kv_scales) -> dict:
    return {
        "generator_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        "torch": torch.__version__,
        "acceptance": acceptance,
        "seed": seed,
        "draft_kv_scales": None if draft_kv_scales is None else [float(s) for s in draft_kv_scales],
    }


def ensure_pair(
    out_dir: str | os.PathLike,
    acceptance: str = "none",
    seed: int = 0,
    *,
    draft_kv_scales: tuple[float, float] | None = None,
) -> tuple[tuple[str, str], bool]:
    """The pair under ``out_dir`` and whether it was (re)generated.

    A pair whose ``pair.json`` matches this generator, torch version and these
    arguments is kept (the ``text`` pair takes a minute to train). Otherwise
    the record goes first, a new pair is written in a sibling directory, its
    ``target`` and ``draft`` replace the old ones, and the record is written
    last: an interrupted run leaves no record, so the next one regenerates.
    Nothing else in ``out_dir`` is touched.
    """
    return keep_or_generate(
        out_dir,
        _pair_record(acceptance, seed, draft_kv_scales),
        lambda staging: generate_pair(staging, acceptance, seed, draft_kv_scales=draft_kv_scales),
    )


def keep_or_generate(out_dir: str | os.PathLike, want: dict, generate) -> tuple[tuple[str, str], bool]:
    """``out_dir``'s pair, kept when its record equals ``want``, else made by
    ``generate(staging_dir)`` and swapped in as :func:`ensure_pair` says."""
    out = Path(out_dir)
    paths = (str(out / "target"), str(out / "draft"))
    record = out / PAIR_RECORD
    try:
        if json.loads(record.read_text()) == want:
            return paths, False
    except (OSError, ValueError):
        pass
    out.mkdir(parents=True, exist_ok=True)
    record.unlink(missing_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        generate(staging)
        for part in ("target", "draft"):
            shutil.rmtree(out / part, ignore_errors=True)
            os.replace(staging / part, out / part)
        record.write_text(json.dumps(want, indent=1, sort_keys=True) + "\n")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return paths, True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--acceptance", choices=ACCEPTANCE_MODES, default="none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--draft-kv-scales",
        nargs=2,
        type=float,
        metavar=("K", "V"),
        help="drafter declares an fp8 quantization config with these KV scales",
    )
    args = ap.parse_args(argv)
    (t, d), written = ensure_pair(
        args.out,
        args.acceptance,
        args.seed,
        draft_kv_scales=tuple(args.draft_kv_scales) if args.draft_kv_scales else None,
    )
    print(f"target: {t}\ndraft:  {d}\n({'written' if written else 'up to date, kept'})")


if __name__ == "__main__":
    main()
