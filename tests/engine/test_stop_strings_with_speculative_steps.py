"""A stop string ends the output where it ends without speculative decoding.

With DFlash one engine step can bring several accepted tokens. The text was
always cut at the stop string, but the token ids, their logprobs and so the
usage (completion_tokens counts token ids) kept the tokens accepted after it
in the same step. These tests feed the output processor the same generated
tokens one per step (what the engine gives without speculation: the
reference), several per step and all in one step, and require identical
outputs: text, token ids, logprobs, cumulative logprob, finish and stop reason,
final and streamed (DELTA) alike. No engine, no model: the tokenizer is the
tiny pairs' byte-level one (token id == byte value).
"""

from __future__ import annotations

import pytest
from stepwise_outputs import final_output, generate_in_steps, streamed_output

PROMPT_IDS = [72, 105, 58]  # "Hi:"
STEPS = {"one per step (no speculation)": 1, "four per step": 4, "all in one step": 10_000}
REFERENCE = "one per step (no speculation)"
ALL_IN_ONE = "all in one step"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from vllm.fork import tiny_pairs

    out = tmp_path_factory.mktemp("byte-tokenizer")
    tiny_pairs._write_tokenizer(out)
    return AutoTokenizer.from_pretrained(str(out))


def _ids(text: str) -> list[int]:
    return list(text.encode())


# name -> (generated text, sampling params, expected text, expected number of tokens)
CASES = {
    "stop in the middle": ("one. two. three", {"stop": ["."]}, "one", 4),
    "stop spanning tokens": ("the fox. jumps", {"stop": ["fox."]}, "the ", 8),
    "stop kept in the text": ("one. two", {"stop": ["."], "include_stop_str_in_output": True}, "one.", 4),
    "first of several stops": ("ab;cd.ef", {"stop": [".", ";"]}, "ab", 3),
    "stop before min_tokens is ignored": ("a.bcdef.gh", {"stop": ["."], "min_tokens": 4}, "a.bcdef", 8),
    "multi-byte stop": ("caf\u00e9 au lait", {"stop": ["\u00e9"]}, "caf", 5),
}


# Patch 0015's guards are the all-in-one-step cases: each has tokens after the
# stop string in that step, so each fails without the patch. A split of four
# may end a step right at the stop string, and one per step is the reference.
SPLITS = [pytest.param(name, marks=[pytest.mark.needs_patch("0015")] if name == ALL_IN_ONE else []) for name in STEPS]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("steps", SPLITS)
def test_final_output_ends_at_the_stop_string(tokenizer, case, steps):
    from vllm.sampling_params import RequestOutputKind

    generated, params, text, num_tokens = CASES[case]
    ids = _ids(generated)
    reference = final_output(generate_in_steps(tokenizer, PROMPT_IDS, ids, 1, RequestOutputKind.FINAL_ONLY, **params))
    assert (reference["text"], len(reference["token_ids"])) == (text, num_tokens), reference
    got = final_output(
        generate_in_steps(tokenizer, PROMPT_IDS, ids, STEPS[steps], RequestOutputKind.FINAL_ONLY, **params)
    )
    assert got == reference


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("steps", [p for p in SPLITS if p.values[0] != REFERENCE])
def test_streamed_output_ends_at_the_stop_string(tokenizer, case, steps):
    from vllm.sampling_params import RequestOutputKind

    generated, params, _text, _num = CASES[case]
    ids = _ids(generated)
    reference = streamed_output(generate_in_steps(tokenizer, PROMPT_IDS, ids, 1, RequestOutputKind.DELTA, **params))
    got = streamed_output(
        generate_in_steps(tokenizer, PROMPT_IDS, ids, STEPS[steps], RequestOutputKind.DELTA, **params)
    )
    assert got == reference


@pytest.mark.needs_patch("0015")
def test_stop_string_before_the_engine_stop_token_of_the_same_step(tokenizer):
    """The engine ends the request on EOS in a step that also completed a stop
    string before it: the output ends at the stop string, as it would have
    without speculation (the EOS would never have been generated)."""
    from vllm.sampling_params import RequestOutputKind

    eos = tokenizer.eos_token_id
    ids = _ids("ab.cd") + [eos]
    reference = final_output(
        generate_in_steps(tokenizer, PROMPT_IDS, _ids("ab.cd"), 1, RequestOutputKind.FINAL_ONLY, stop=["."])
    )
    got = final_output(
        generate_in_steps(
            tokenizer, PROMPT_IDS, ids, len(ids), RequestOutputKind.FINAL_ONLY, engine_stops_on_last=True, stop=["."]
        )
    )
    assert got == reference
    assert got["token_ids"] == _ids("ab.")


def test_without_a_stop_string_every_token_stays(tokenizer):
    from vllm.sampling_params import RequestOutputKind

    ids = _ids("no stop here")
    got = final_output(
        generate_in_steps(tokenizer, PROMPT_IDS, ids, len(ids), RequestOutputKind.FINAL_ONLY, stop=["#"])
    )
    assert got["token_ids"] == ids and got["text"] == "no stop here"
    assert len(got["logprobs"]) == len(ids)
