"""``VLLM_BATCH_INVARIANT=1`` on the CPU backend: a request's output does not
depend on the requests batched with it (patch 0032).

Upstream's batch-invariance check (a prompt alone, then the same prompt in a
batch of others: bitwise-equal logprobs), run on CPU with the gpt-oss family
target of vllm.fork.tiny_families -- linear layers, MoE experts, attention
sinks, sliding-window and full attention -- in float32 with an fp8 KV cache.
Each needle prompt (up to 900 tokens) is generated alone and then among
prompts of other lengths; its greedy token ids and top-5 logprobs must be
equal bit for bit.

Where the MoE layers take the torch path (CPUs without AVX-512: the AVX2
kernel library has no grouped GEMM) the mode is what makes this hold:
without it the needles' logprobs differed from their logprobs alone in the
last bits (measured, as on such a CPU). With AVX-512, this tiny target's
products happened to be batch-invariant without the mode too, so the
patch's guards are the kernel tests (tests/kernels/
test_cpu_batch_invariant_gemm.py), which fail without it on every CPU. The
engine is asked to compile the model: the mode must run it eagerly instead
(compiled, the tiled products failed the engine's start).

One engine start of its own, so it runs in the extended job (and in its
pass as without AVX-512).
"""

from __future__ import annotations

import greedy_runs
import offline_engine
import pair_cache
import pytest

pytestmark = pytest.mark.extended

MAX_TOKENS = 24
NEEDLES = [
    {"prompt_token_ids": [104, 101, 108, 108, 111] * 3},
    {"prompt_token_ids": list(range(40, 120))},
    {"prompt_token_ids": [(i * 37) % 250 for i in range(900)]},
    "DFlash drafts a block of tokens",
]
FILLERS = [
    "a",
    "The quick brown fox jumps over the lazy dog, again and again and again.",
    {"prompt_token_ids": list(range(200, 250)) * 3},
    "zz " * 30,
    {"prompt_token_ids": [7, 9, 11]},
]


@pytest.fixture(scope="module")
def batch_invariant_llm():
    from vllm.fork.tiny_families import serve_overrides

    target, _ = pair_cache.make_family_pair("gpt_oss")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_BATCH_INVARIANT", "1")
        llm = offline_engine.start_llm(
            ("family-gpt_oss", "batch invariant"),
            model=target,
            dtype="float32",
            kv_cache_dtype="fp8",
            max_num_seqs=16,
            # A needle's second run would otherwise start from the blocks its
            # first run cached: a prefix-cache hit, not batch composition.
            enable_prefix_caching=False,
            # As served: vLLM compiles the model unless told not to (the
            # batch-invariant mode runs it eagerly, and says so).
            enforce_eager=False,
            **serve_overrides("gpt_oss"),
        )
        yield llm
        offline_engine.shutdown_llm()


def test_a_prompt_gets_the_same_logprobs_alone_and_in_a_batch(batch_invariant_llm):
    alone = [greedy_runs.generate_with_logprobs(batch_invariant_llm, [p], MAX_TOKENS, k=5) for p in NEEDLES]
    # Each needle at another place among the fillers.
    batch = []
    for i, needle in enumerate(NEEDLES):
        batch += FILLERS[i : i + 2] + [needle]
    ids, rows = greedy_runs.generate_with_logprobs(batch_invariant_llm, batch, MAX_TOKENS, k=5)
    positions = [batch.index(needle) for needle in NEEDLES]
    differ = []
    for needle, (alone_ids, alone_rows), at in zip(NEEDLES, alone, positions):
        if ids[at] != alone_ids[0]:
            differ.append(f"{str(needle)[:40]}: token ids {ids[at]} batched, {alone_ids[0]} alone")
        elif rows[at] != alone_rows[0]:
            step = next(s for s, (a, b) in enumerate(zip(rows[at], alone_rows[0])) if a != b)
            differ.append(
                f"{str(needle)[:40]}: logprobs at output position {step}: "
                f"{rows[at][step]} batched, {alone_rows[0][step]} alone"
            )
    assert not differ, "a prompt's output depends on its batch:\n" + "\n".join(differ)
