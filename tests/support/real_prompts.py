"""Prompt sets for the real-model DFlash checks (tests/gpu/test_real_models_cuda.py).

tests/gpu/data/{gsm8k,humaneval,mt_bench}.jsonl hold a few public questions
of each set; VLLM_FORK_REAL_PROMPTS_DIR points at fuller files of the same
names and format (GSM8K: ``question``/``answer`` with ``#### N``; HumanEval:
``prompt``; MT-Bench: ``turns``, the first one is used).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from repo_paths import TESTS

DATA = Path(os.environ.get("VLLM_FORK_REAL_PROMPTS_DIR") or TESTS / "gpu" / "data")


def load_prompts(dataset: str, data: Path = DATA) -> list[dict]:
    rows = [json.loads(line) for line in (data / f"{dataset}.jsonl").read_text().splitlines() if line.strip()]
    assert rows, f"no prompts in {data / dataset}.jsonl"
    return rows


def user_message(dataset: str, row: dict) -> str:
    if dataset == "gsm8k":
        return row["question"] + "\nPlease reason step by step, and put your final answer within \\boxed{}."
    if dataset == "humaneval":
        return (
            "Write a solution to the following problem and make sure that it passes the tests:\n"
            f"```python\n{row['prompt']}\n```"
        )
    return row["turns"][0]


def gsm8k_answer(row: dict) -> str:
    return row["answer"].split("####")[-1].strip().replace(",", "")


def extracted_answer(text: str) -> str | None:
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    candidates = boxed or re.findall(r"-?\d[\d,]*\.?\d*", text)
    if not candidates:
        return None
    nums = re.findall(r"-?\d[\d,]*\.?\d*", candidates[-1])
    value = (nums[-1] if nums else candidates[-1]).replace(",", "").rstrip(".")
    try:
        number = float(value)
    except ValueError:
        return value.strip()
    return str(int(number)) if number.is_integer() else str(number)
