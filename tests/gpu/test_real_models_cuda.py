"""DFlash acceptance with real models, bf16 vs fp8 KV cache (opt-in).

Runs only when both variables name a model (a Hub id or a local directory);
nothing is downloaded otherwise:

    VLLM_FORK_REAL_TARGET=Qwen/Qwen3-8B
    VLLM_FORK_REAL_DRAFT=z-lab/Qwen3-8B-DFlash-b16

Thresholds as upstream's acceptance-length tests set them: with an fp8 KV
cache the mean acceptance length is within 3% of bf16's, for any pair; for a
target with published figures (KNOWN_TARGETS) the bf16 figure is at least
0.95 x the published one (Qwen3-8B, the DFlash paper, greedy, thinking off:
GSM8K 6.54, HumanEval 6.50, MT-Bench 4.24). Optional: GSM8K accuracy
(VLLM_FORK_GSM8K_ACCURACY=1, at least VLLM_FORK_GSM8K_MIN_ACCURACY, default
the target's published accuracy or 0.75, with fp8 no worse than bf16 by more
than one question or 3 points). The run that validated upstream PR #42692:

    VLLM_FORK_REAL_TARGET=Qwen/Qwen3.6-35B-A3B-FP8
    VLLM_FORK_REAL_DRAFT=z-lab/Qwen3.6-35B-A3B-DFlash
    VLLM_FORK_GSM8K_ACCURACY=1        # at least its 0.757 with fp8 KV

Vision-language checkpoints (Qwen3.5/3.6) are served text-only.

Prompts: tests/gpu/data/{gsm8k,humaneval,mt_bench}.jsonl, a few public
questions of each set (GSM8K test, HumanEval, MT-Bench first turns); point
VLLM_FORK_REAL_PROMPTS_DIR at a directory with fuller files of the same
names and format for a closer comparison with the paper. Other knobs:
VLLM_FORK_REAL_SPEC_TOKENS (15: the b16 drafter's block minus the bonus
token), VLLM_FORK_REAL_MAX_TOKENS (2048), VLLM_FORK_REAL_BACKEND (drafter
backend; default: the first of FLASH_ATTN, TRITON_ATTN, FLASHINFER that
vLLM validates for the fp8 cache here), VLLM_FORK_REAL_MIN_GPU_GB (40).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    import gpu_e2e

    pytest.skip(gpu_e2e.CUDA_SKIP_REASON, allow_module_level=True)

REAL_TARGET = os.environ.get("VLLM_FORK_REAL_TARGET")
REAL_DRAFT = os.environ.get("VLLM_FORK_REAL_DRAFT")
if not (REAL_TARGET and REAL_DRAFT):
    pytest.skip(
        "real-model DFlash checks are opt-in: set VLLM_FORK_REAL_TARGET and "
        "VLLM_FORK_REAL_DRAFT (e.g. Qwen/Qwen3-8B and z-lab/Qwen3-8B-DFlash-b16)",
        allow_module_level=True,
    )

import dflash_settings  # noqa: E402
import gpu_backends as gb  # noqa: E402
import gpu_e2e  # noqa: E402
import offline_engine  # noqa: E402
from real_prompts import extracted_answer, gsm8k_answer, load_prompts, user_message  # noqa: E402

DATASET_NAMES = ("gsm8k", "humaneval", "mt_bench")
# Published figures per target, by Hub id (the last path component of a local
# directory matches too): DFlash paper acceptance lengths (greedy, thinking
# off) and GSM8K accuracy.
KNOWN_TARGETS = {
    "Qwen3-8B": {"acceptance": {"gsm8k": 6.54, "humaneval": 6.50, "mt_bench": 4.24}},
    # GSM8K with DFlash and an fp8 KV cache in the run that validated PR #42692.
    "Qwen3.6-35B-A3B-FP8": {"gsm8k_accuracy": 0.757},
}
KNOWN = KNOWN_TARGETS.get(REAL_TARGET.rstrip("/").rsplit("/", 1)[-1], {})
PAPER_ACCEPTANCE = KNOWN.get("acceptance", {})
PAPER_FRACTION = 0.95
FP8_RTOL = 0.03
SPEC_TOKENS = int(os.environ.get("VLLM_FORK_REAL_SPEC_TOKENS", "15"))
MAX_TOKENS = int(os.environ.get("VLLM_FORK_REAL_MAX_TOKENS", "2048"))
MIN_GPU_GB = float(os.environ.get("VLLM_FORK_REAL_MIN_GPU_GB", "40"))
GSM8K_ACCURACY = os.environ.get("VLLM_FORK_GSM8K_ACCURACY") == "1"
GSM8K_MIN_ACCURACY = float(os.environ.get("VLLM_FORK_GSM8K_MIN_ACCURACY", str(KNOWN.get("gsm8k_accuracy", 0.75))))


def _gpu_gib() -> float:
    from vllm.platforms import current_platform

    return current_platform.get_device_total_memory() / (1 << 30)


pytestmark = pytest.mark.skipif(
    _gpu_gib() < MIN_GPU_GB, reason=f"needs a GPU with >= {MIN_GPU_GB} GiB (VLLM_FORK_REAL_MIN_GPU_GB)"
)


def head_size(model: str) -> int:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model)
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def drafter_backend(kv_dtype: str) -> str | None:
    if name := os.environ.get("VLLM_FORK_REAL_BACKEND"):
        return name
    ok = gb.working_backends(
        kv_dtype, head_size=head_size(REAL_DRAFT), dtype=torch.bfloat16, device_capability=gb.current_capability()
    )
    return ok[0] if ok else None


def text_only_overrides(model: str) -> dict:
    """Engine arguments that serve a vision-language checkpoint text-only."""
    from transformers import AutoConfig

    architectures = getattr(AutoConfig.from_pretrained(model), "architectures", None) or []
    if any(a.endswith("ForConditionalGeneration") for a in architectures):
        return {"limit_mm_per_prompt": {"image": 0, "video": 0}}
    return {}


def _delta(before: dict, after: dict) -> dict:
    out = {}
    for k, v in after.items():
        b = before.get(k, 0 if not isinstance(v, list) else [0] * len(v))
        out[k] = [x - y for x, y in zip(v, b)] if isinstance(v, list) else v - b
    return out


class RealRuns:
    def __init__(self):
        self._cache: dict = {}
        # Both runs use the drafter backend that serves fp8, so only the KV dtype differs.
        self.backend = drafter_backend("fp8")

    def get(self, kv_dtype: str) -> dict:
        if kv_dtype not in self._cache:
            try:
                self._cache[kv_dtype] = (True, self._run(kv_dtype))
            except Exception as e:
                offline_engine.shutdown_llm()
                self._cache[kv_dtype] = (False, e)
                raise
        ok, value = self._cache[kv_dtype]
        if not ok:
            raise RuntimeError(f"the {kv_dtype} run failed earlier: {value!r}") from value
        return value

    def _run(self, kv_dtype: str) -> dict:
        from vllm import SamplingParams

        if self.backend is None:
            pytest.skip(
                f"no drafter backend validates DFlash with an fp8 KV cache on this GPU "
                f"(sm {gb.current_capability()}; vLLM issue #41559)"
            )
        llm = offline_engine.start_llm(
            ("real", kv_dtype),
            model=REAL_TARGET,
            kv_cache_dtype=kv_dtype,
            speculative_config=dflash_settings.dflash_spec_config(
                REAL_DRAFT, num_speculative_tokens=SPEC_TOKENS, attention_backend=self.backend
            ),
            max_model_len=MAX_TOKENS + 2048,
            max_num_seqs=32,
            gpu_memory_utilization=0.85,
            enforce_eager=False,
            **text_only_overrides(REAL_TARGET),
        )
        tok = llm.get_tokenizer()
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        results = {}
        for dataset in DATASET_NAMES:
            rows = load_prompts(dataset)
            prompts = [
                tok.apply_chat_template(
                    [{"role": "user", "content": user_message(dataset, r)}],
                    tokenize=False,
                    add_generation_prompt=True,
                    enable_thinking=False,
                )
                for r in rows
            ]
            before = offline_engine.spec_metrics(llm)
            outs = llm.generate(prompts, params, use_tqdm=False)
            m = _delta(before, offline_engine.spec_metrics(llm))
            mal, drafts, accepted = gpu_e2e.mean_acceptance(m)
            per_pos = m.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
            results[dataset] = {
                "acceptance_length": mal,
                "drafts": drafts,
                "accepted": accepted,
                "per_position": [p / drafts for p in per_pos] if drafts else [],
                "texts": [o.outputs[0].text for o in outs],
                "rows": rows,
            }
        offline_engine.shutdown_llm()
        return results


@pytest.fixture(scope="module")
def real():
    runs = RealRuns()
    yield runs
    offline_engine.shutdown_llm()


DATASETS = [pytest.param(d, id=f"real-{d}") for d in DATASET_NAMES]


@pytest.mark.parametrize("case", DATASETS)
def test_bf16_kv_acceptance_length_reaches_the_paper(case, real, measurements):
    if case not in PAPER_ACCEPTANCE:
        pytest.skip(f"no published acceptance length for {REAL_TARGET} on {case} (KNOWN_TARGETS)")
    got = real.get("auto")[case]
    floor = PAPER_FRACTION * PAPER_ACCEPTANCE[case]
    measurements[f"real {case} acceptance length kv=auto"] = round(got["acceptance_length"], 3)
    print(
        f"\n[gpu] {REAL_TARGET} + {REAL_DRAFT} ({real.backend}), {case}, bf16 KV: mean acceptance "
        f"length {got['acceptance_length']:.3f} (paper {PAPER_ACCEPTANCE[case]}, floor {floor:.3f}); "
        f"per position {[round(p, 3) for p in got['per_position']]}"
    )
    assert got["acceptance_length"] >= floor


@pytest.mark.parametrize("case", DATASETS)
def test_fp8_kv_acceptance_length_within_3_percent_of_bf16(case, real, measurements):
    bf16 = real.get("auto")[case]["acceptance_length"]
    fp8 = real.get("fp8")[case]["acceptance_length"]
    rel = (fp8 - bf16) / bf16
    measurements[f"real {case} acceptance length kv=fp8"] = round(fp8, 3)
    measurements[f"real {case} acceptance fp8/bf16 - 1"] = round(rel, 4)
    print(f"\n[gpu] {case}: fp8 KV {fp8:.3f} vs bf16 KV {bf16:.3f} ({rel:+.2%})")
    assert abs(rel) <= FP8_RTOL


@pytest.mark.skipif(not GSM8K_ACCURACY, reason="GSM8K accuracy is opt-in: VLLM_FORK_GSM8K_ACCURACY=1")
@pytest.mark.parametrize("case", [pytest.param("gsm8k-accuracy", id="real-gsm8k-accuracy")])
def test_gsm8k_accuracy(case, real, measurements):
    acc = {}
    for kv in ("auto", "fp8"):
        run = real.get(kv)["gsm8k"]
        hits = [extracted_answer(t) == gsm8k_answer(r) for t, r in zip(run["texts"], run["rows"])]
        acc[kv] = sum(hits) / len(hits)
    n = len(real.get("auto")["gsm8k"]["rows"])
    measurements["real gsm8k accuracy"] = acc
    print(f"\n[gpu] GSM8K accuracy over {n} questions: {acc}")
    assert acc["auto"] >= GSM8K_MIN_ACCURACY
    assert acc["fp8"] >= acc["auto"] - max(0.03, 1 / n)
