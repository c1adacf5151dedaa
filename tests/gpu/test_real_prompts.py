"""The real-model prompt sets and GSM8K answer extraction (runs anywhere)."""

from __future__ import annotations

import pytest
import real_prompts as rp


@pytest.mark.parametrize("dataset, minimum", [("gsm8k", 10), ("humaneval", 10), ("mt_bench", 10)])
def test_prompt_sets_load(dataset, minimum):
    rows = rp.load_prompts(dataset)
    assert len(rows) >= minimum
    for row in rows:
        assert rp.user_message(dataset, row).strip()


def test_gsm8k_answers_are_numbers():
    for row in rp.load_prompts("gsm8k"):
        assert rp.gsm8k_answer(row).lstrip("-").isdigit(), row


@pytest.mark.parametrize(
    "text, answer",
    [
        ("so she makes 9 * 2 = 18 dollars. \\boxed{18}", "18"),
        ("The profit is \\boxed{\\$70,000}.", "70000"),
        ("\\boxed{18.00}", "18"),
        ("no box: first 3 then 45", "45"),
        ("\\boxed{2.5}", "2.5"),
        ("nothing here", None),
    ],
)
def test_extracted_answer(text, answer):
    assert rp.extracted_answer(text) == answer
