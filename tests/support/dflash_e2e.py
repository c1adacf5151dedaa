"""Helpers for the CPU end-to-end DFlash tests (imported by conftest.py).

Engines are expensive on 2 cores (~35 s start, ~4 GiB), so at most one is
alive at a time: :func:`start_llm` shuts down the previous one first.
Functions that run inside the engine's worker process (via
``LLM.collective_rpc``) live here and are pickled by value.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import cloudpickle
import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(fn)
# Offline engines run their engine core in the test process; the model
# (target, drafter, attention, KV cache) still runs in vLLM's worker process.
# That saves a process start (~7 s of imports on 2 cores) per engine and its
# CPU while idle. The full process layout users get is what the `vllm serve`
# tests run (tools/lib/vllm_server.py does not pass this on).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# Every KV format the CPU backend stores: "fp8_e4m3" is the format "fp8"
# names (the kernel tests in tests/kernels run every spelling), so the
# end-to-end engines, two per entry, skip that alias.
KV_DTYPES = ["auto", "fp8", "fp8_e5m2"]
NUM_SPEC_TOKENS = 3
MAX_MODEL_LEN = 1024
# Prompt + output cross the CPU default KV block size (128 tokens).
MAX_TOKENS = 160
PROMPTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog, again and again and again.",
    "a",
    "DFlash drafts a whole block of tokens in one forward pass; " * 2,
]

_current: dict = {"llm": None, "key": None}


def kv_bytes_per_elem(kv_dtype: str, model_dtype: torch.dtype) -> int:
    """Bytes a KV cache element takes: the model dtype's for "auto", an
    explicit unquantized dtype's own, one for the fp8 formats."""
    if kv_dtype == "auto":
        return model_dtype.itemsize
    if kv_dtype in ("bfloat16", "float16"):
        return getattr(torch, kv_dtype).itemsize
    return 1


def shutdown_llm() -> None:
    llm = _current["llm"]
    _current["llm"] = _current["key"] = None
    if llm is None:
        return
    client = llm.llm_engine.engine_core
    try:
        client.shutdown()
    except Exception as e:  # pragma: no cover - best effort
        print(f"[e2e] engine shutdown raised {e!r}")
    # After an engine died mid-request its client's sockets can still hold
    # unsent messages; collecting the client's ZeroMQ context would then wait
    # for them forever (Context.term), hanging the session's teardown.
    ctx = getattr(client, "ctx", None)
    if ctx is not None:
        ctx.destroy(linger=0)
    del llm, client
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception as e:  # pragma: no cover - best effort
        print(f"[e2e] cleanup_dist_env_and_memory raised {e!r}")


@contextlib.contextmanager
def _no_dynamo_if_eager(enforce_eager: bool):
    """TORCHDYNAMO_DISABLE=1 for the processes an eager engine spawns.

    An eager engine still compiles a few helpers with Inductor, the random
    sampler first (the start-up's dummy sampler run calls it), and on CPU the
    first compile of a process costs about 10 s: Inductor checks that each
    vector ISA loads by importing torch in a Python subprocess per ISA
    variant. That was half of an engine's start here, and the suite starts
    dozens. The helpers run eagerly instead: greedy decoding never samples
    at random, and a test's DFlash engine and its target-only reference run
    the same code either way. vllm serve tests, the compiled-model tests and
    non-eager engines keep vLLM's default."""
    if not enforce_eager or "TORCHDYNAMO_DISABLE" in os.environ:
        yield
        return
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        yield
    finally:
        del os.environ["TORCHDYNAMO_DISABLE"]


def start_llm(key, **kwargs):
    """Start an engine (reusing the live one if ``key`` matches)."""
    if _current["key"] == key and _current["llm"] is not None:
        return _current["llm"]
    shutdown_llm()
    from vllm import LLM

    kwargs.setdefault("dtype", "bfloat16")
    kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
    kwargs.setdefault("max_num_seqs", 8)
    kwargs.setdefault("seed", 0)
    kwargs.setdefault("enforce_eager", True)
    kwargs.setdefault("disable_log_stats", False)
    t0 = time.monotonic()
    with _no_dynamo_if_eager(kwargs["enforce_eager"]):
        llm = LLM(**kwargs)
    print(f"[e2e] engine {key} started in {time.monotonic() - t0:.1f} s")
    _current["llm"], _current["key"] = llm, key
    return llm


PAIR_CACHE_ENV = "VLLM_FORK_TEST_PAIR_CACHE"


def _pair_cache_root() -> Path:
    if os.environ.get(PAIR_CACHE_ENV):
        return Path(os.environ[PAIR_CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "vllm-fork" / "tiny-pairs"


def make_pair(name: str, acceptance: str, **kw) -> tuple[str, str]:
    """A seeded tiny target + DFlash drafter pair (vllm.fork.tiny_pairs),
    generated once per content: the pair is a function of the generator's
    source, torch's version and the arguments, so it is cached under a key of
    those (VLLM_FORK_TEST_PAIR_CACHE, else ~/.cache/vllm-fork/tiny-pairs) and
    shared by every process of a run -- the trained pair costs 10-30 s of
    training on 2 cores, and the necessity proofs' subprocesses need it too.
    Tests must not write into it (copy it first)."""
    import vllm.fork.tiny_pairs as tiny_pairs

    spec = json.dumps({"acceptance": acceptance, "seed": 0, **kw}, sort_keys=True, default=str)
    return _cached_pair(
        name, [tiny_pairs.__file__], spec, lambda out: tiny_pairs.ensure_pair(out, acceptance, seed=0, **kw)
    )


def make_family_pair(family: str, *, fp8_weights: bool = False) -> tuple[str, str]:
    """A target of ``family`` (vllm.fork.tiny_families) and a DFlash drafter
    trained against it, cached as :func:`make_pair` caches its pairs."""
    import vllm.fork.tiny_families as tiny_families
    import vllm.fork.tiny_pairs as tiny_pairs

    name = f"family-{family}" + ("-fp8-weights" if fp8_weights else "")
    return _cached_pair(
        name,
        [tiny_families.__file__, tiny_pairs.__file__],
        json.dumps({"family": family, "seed": 0, "fp8_weights": fp8_weights}),
        lambda out: tiny_families.ensure_family_pair(out, family, seed=0, fp8_weights=fp8_weights),
    )


def family_prompts() -> list:
    """Prompts for a family pair: the drafter's training prompts (drafted
    well) and PROMPTS (drafted poorly)."""
    from vllm.fork.tiny_pairs import trained_prompts

    return [*({"prompt_token_ids": ids} for ids in trained_prompts()), *PROMPTS]


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


def family_outputs(
    family: str, pair: tuple[str, str], *, dflash: bool, max_tokens: int, prompts: list | None = None, **engine_args
) -> dict:
    """Greedy ids of a family pair's target (float32, fp8 KV cache) for
    ``prompts`` (default: family_prompts()), with its DFlash drafter or
    alone; with the drafter also its counters and KV state, and the engine
    stays up. Alone, the engine is shut down."""
    from vllm.fork.tiny_families import serve_overrides

    target, draft = pair
    if dflash:
        engine_args["speculative_config"] = dflash_spec_config(draft)
    llm = start_llm(
        (f"family-{family}", "dflash" if dflash else "target"),
        model=target,
        dtype="float32",
        kv_cache_dtype="fp8",
        **serve_overrides(family),
        **engine_args,
    )
    ids, _ = generate_ids(llm, family_prompts() if prompts is None else prompts, max_tokens)
    if not dflash:
        shutdown_llm()
        return {"ids": ids}
    return {
        "ids": ids,
        "metrics": spec_metrics(llm),
        "preemptions": engine_counter(llm, "vllm:num_preemptions"),
        "state": llm.collective_rpc(worker_kv_state)[0],
    }


def _cached_pair(name: str, sources: list[str], spec: str, generate) -> tuple[str, str]:
    """``generate(dir)`` written into a temporary directory and renamed into
    place under a key of ``sources``, torch's version and ``spec``, so no
    process ever sees half a pair."""
    digest = hashlib.sha256(
        b"".join(Path(f).read_bytes() for f in sources) + torch.__version__.encode() + spec.encode()
    ).hexdigest()[:16]
    root = _pair_cache_root()
    final = root / f"{name}-{digest}"

    def complete() -> bool:
        return (final / "target" / "config.json").is_file() and (final / "draft" / "config.json").is_file()

    if not complete():
        root.mkdir(parents=True, exist_ok=True)
        # One process generates a pair; the others (xdist workers, necessity
        # proofs) wait for it instead of training the same pair on the same
        # cores at the same time.
        with open(root / f".{name}-{digest}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not complete():
                partial = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
                try:
                    generate(partial)
                    os.replace(partial, final)
                except OSError:
                    if not final.is_dir():  # not another process that won the race
                        raise
                finally:
                    shutil.rmtree(partial, ignore_errors=True)
    return str(final / "target"), str(final / "draft")


def start_dflash_fp8(name: str, pair: tuple[str, str]):
    """A DFlash engine on ``pair`` with an fp8 KV cache."""
    target, draft = pair
    return start_llm(
        (name, "fp8"),
        model=target,
        kv_cache_dtype="fp8",
        speculative_config=dflash_spec_config(draft),
    )


def dflash_fp8_serve_args(draft_dir: str, dtype: str = "bfloat16") -> list[str]:
    """`vllm serve` arguments for the cpu_e2e servers: DFlash, fp8 KV, bf16
    unless `dtype` says otherwise."""
    return [
        "--dtype",
        dtype,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enforce-eager",
        "--seed",
        "0",
        "--kv-cache-dtype",
        "fp8",
        "--speculative-config",
        json.dumps(dflash_spec_config(draft_dir)),
    ]


def dflash_spec_config(draft_dir: str, **extra) -> dict:
    cfg = {
        "method": "dflash",
        "model": draft_dir,
        "num_speculative_tokens": NUM_SPEC_TOKENS,
    }
    cfg.update(extra)
    return cfg


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


def start_trained_fp32(pair: tuple[str, str]):
    """DFlash on the trained pair in float32 (auto KV cache, no prefix
    caching); one key, so tests in different modules share the engine."""
    target, draft = pair
    return start_llm(
        ("dflash-trained", "fp32"),
        model=target,
        dtype="float32",
        enable_prefix_caching=False,
        speculative_config=dflash_spec_config(draft),
    )


def engine_counter(llm, name: str) -> float:
    """One counter of vLLM's metrics (LLM.get_metrics()), 0 when absent."""
    return next((m.value for m in llm.get_metrics() if m.name == name), 0)


def spec_metrics(llm) -> dict:
    """Spec-decode counters from vLLM's metrics (LLM.get_metrics())."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = m.values if hasattr(m, "values") else m.value
    return out


# --------------------------------------------------------------------------
# Worker-side functions (run in the engine process by collective_rpc)
# --------------------------------------------------------------------------


def _kv_tensor(layer):
    kv = layer.kv_cache
    if isinstance(kv, (list, tuple)):
        kv = kv[0]
    return kv


def worker_kv_state(worker) -> dict:
    """Per attention layer: KV dtype, cache tensor dtype/shape, KV scales."""
    runner = worker.model_runner
    ctx = runner.vllm_config.compilation_config.static_forward_context
    draft_names = set(runner.drafter._draft_attn_layer_names) if hasattr(runner, "drafter") else set()
    layers = {}
    for name, layer in ctx.items():
        if not hasattr(layer, "kv_cache_dtype") or not hasattr(layer, "impl"):
            continue
        kv = _kv_tensor(layer)
        layers[name] = {
            "role": "draft" if name in draft_names else "target",
            "kv_cache_dtype": layer.kv_cache_dtype,
            "impl_kv_cache_dtype": getattr(layer.impl, "kv_cache_dtype", None),
            "tensor_dtype": str(kv.dtype),
            "tensor_shape": tuple(kv.shape),
            "k_scale": float(layer._k_scale_float),
            "v_scale": float(layer._v_scale_float),
        }
    cfg = runner.kv_cache_config
    return {
        "layers": layers,
        "num_blocks": int(cfg.num_blocks),
        "block_size": int(runner.cache_config.block_size),
        "kv_cache_memory_bytes": runner.cache_config.kv_cache_memory_bytes,
        "draft_names": sorted(draft_names),
    }


def worker_install_qsl_probe(worker) -> str:
    """Record the dtypes the drafter builds in set_inputs_first_pass."""
    drafter = worker.model_runner.drafter
    if getattr(drafter, "_e2e_probe", None) is not None:
        drafter._e2e_probe.clear()
        return "reset"
    probe: list = []
    orig = drafter.set_inputs_first_pass

    def wrapped(*args, **kwargs):
        result = orig(*args, **kwargs)
        cad = result[2]
        probe.append(
            (
                str(cad.query_start_loc_cpu.dtype),
                str(cad.query_start_loc.dtype),
                cad.query_start_loc_cpu.tolist(),
            )
        )
        return result

    drafter.set_inputs_first_pass = wrapped
    drafter._e2e_probe = probe
    return "installed"


def worker_read_qsl_probe(worker) -> dict:
    drafter = worker.model_runner.drafter
    return {
        "token_arange_np": str(drafter.token_arange_np.dtype),
        "arange": str(drafter.arange.dtype),
        "calls": list(drafter._e2e_probe),
    }


def _target_model(worker):
    model = worker.model_runner.get_model()
    return model.get_language_model() if hasattr(model, "get_language_model") else model


def worker_aux_layers(worker) -> tuple[int, ...]:
    """The ids of the target's layers whose hidden states feed the drafter."""
    return tuple(_target_model(worker).model.aux_hidden_state_layers)


def worker_set_aux_layers(worker, layers) -> tuple[int, ...]:
    _target_model(worker).set_aux_hidden_state_layers(tuple(layers))
    return worker_aux_layers(worker)


def repack_linear_weights(model) -> tuple[int, int]:
    """Do to ``model``'s unquantized linear layers what the base's CPU GEMM
    dispatch does where oneDNN or the SGL kernels are available (AVX-512
    builds): keep the weight only inside the layer's ``cpu_linear`` and leave
    ``.weight`` empty. On CPUs where the base keeps plain ``F.linear`` (AVX2)
    this makes a forward that reads ``.weight`` directly fail the same way, so
    a check does not depend on the CPU. Returns (layers changed here, layers
    the base had repacked already): on AVX-512/AMX CPUs the base's own
    dispatch may have done it to every layer, leaving nothing to change."""
    import torch.nn.functional as F

    from vllm.model_executor.layers.linear import LinearBase

    changed = already = 0
    # Linear layers only: embeddings and the LM head may be the target's own
    # (shared with the drafter), and they are not repacked by the base.
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, LinearBase) or getattr(module, "cpu_linear", None) is None or weight is None:
            continue
        if weight.numel() == 0:
            already += 1
            continue
        kept = weight.detach()
        module.cpu_linear = lambda x, _weight, bias, _kept=kept: F.linear(x, _kept, bias)
        module.weight = torch.nn.Parameter(torch.empty(0, dtype=kept.dtype), requires_grad=False)
        changed += 1
    return changed, already


def worker_repack_draft_linear_weights(worker) -> tuple[int, int]:
    """repack_linear_weights on the engine's drafter."""
    return repack_linear_weights(worker.model_runner.drafter.model)


def worker_record_first_propose(worker) -> str:
    """Keep (on CPU) the target inputs of the drafter's next propose call."""
    drafter = worker.model_runner.drafter
    if getattr(drafter, "_e2e_proposals", None) is not None:
        drafter._e2e_proposals.clear()
        return "reset"
    calls: list = []
    orig = drafter.propose

    def propose(*args, **kwargs):
        if not calls:
            calls.append(
                {
                    k: kwargs[k].detach().to("cpu", copy=True)
                    for k in ("target_token_ids", "target_positions", "target_hidden_states")
                }
            )
        return orig(*args, **kwargs)

    drafter.propose = propose
    drafter._e2e_proposals = calls
    return "installed"


def worker_read_first_propose(worker) -> list:
    return list(worker.model_runner.drafter._e2e_proposals)


import sys as _sys  # noqa: E402

cloudpickle.register_pickle_by_value(_sys.modules[__name__])
