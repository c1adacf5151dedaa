"""`bash tools/serve.sh` with no arguments, the README's main command: it
keeps the installed fork when it is up to date, serves the embedded pair (a
target trained on The Zen of Python and its DFlash drafter) with an fp8 KV
cache, and prints two curl commands; run as printed, the first gets the text's
continuation and the second shows DFlash accepting most drafts. Ctrl-C stops
it all.

It trains the pair on a fresh checkout (about 80 s) and starts a server
of its own, so it is `extended`: `bash tools/run_tests.sh -m extended` (a CI
job of its own). The venv is the one running the tests (installed from this
checkout by tools/run_tests.sh), so the script's install check keeps it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest
from draft_counts import DraftCounts
from prometheus_text import parse_metrics
from repo_paths import REPO
from vllm_server import (
    TAG_VAR,
    dying_with_this_process,
    free_port,
    still_running,
    tagged_processes,
    vllm_dist_skip_reason,
)

READY_TIMEOUT_S = 900
STOP_BOUND_S = 60
LEFTOVER_GRACE_S = 30
MIN_MEAN_ACCEPTANCE_LENGTH = 2.0


def _printed_commands(log: str) -> list[str]:
    """The shell commands serve.sh prints after "==> ready", continuation lines joined."""
    after = log.split("==> ready:", 1)[1].split("\n", 1)[1]
    joined = after.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.startswith("curl ")]


@pytest.mark.extended
def test_serve_script_answers_with_the_text_and_accepts_drafts(tmp_path, measurements):
    if reason := vllm_dist_skip_reason():
        pytest.skip(reason)
    from vllm.fork.tiny_pairs import training_text

    tag = uuid.uuid4().hex
    env = {**os.environ, "PORT": str(free_port()), "VLLM_FORK_VENV": sys.prefix, TAG_VAR: tag}
    log_path = tmp_path / "serve.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            dying_with_this_process(["bash", "tools/serve.sh"]),
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        while "==> ready:" not in log_path.read_text(errors="replace"):
            if proc.poll() is not None:
                pytest.fail(
                    f"tools/serve.sh exited with {proc.returncode} before it was ready:\n"
                    f"{log_path.read_text(errors='replace')[-6000:]}"
                )
            if time.monotonic() - t0 > READY_TIMEOUT_S:
                pytest.fail(f"not ready after {READY_TIMEOUT_S} s:\n{log_path.read_text()[-6000:]}")
            time.sleep(2)
        ready_s = time.monotonic() - t0
        completion_cmd, metrics_cmd = _printed_commands(log_path.read_text(errors="replace"))
        answer = subprocess.run(
            ["bash", "-c", completion_cmd], capture_output=True, text=True, timeout=120, check=True
        ).stdout
        metrics = subprocess.run(
            ["bash", "-c", metrics_cmd], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    finally:
        try:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal
        except ProcessLookupError:
            pass
        try:
            code = proc.wait(timeout=STOP_BOUND_S)
        except subprocess.TimeoutExpired:
            code = None
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # A process that is exiting gets a moment before it counts as left.
        _gone, left = psutil.wait_procs(tagged_processes(tag), timeout=LEFTOVER_GRACE_S)
        left = [p for p in left if still_running(p)]
        for p in left:
            p.kill()
    got = json.loads(answer)["choices"][0]["text"]
    mean_len = DraftCounts.read(parse_metrics(metrics)).mean_acceptance_length
    measurements["tools/serve.sh (default pair)"] = {
        "ready_s": round(ready_s, 1),
        "mean_acceptance_length": round(mean_len, 2),
        "stopped_by_ctrl_c": code is not None,
    }
    prompt = re.search(r'"prompt": "([^"]+)"', completion_cmd).group(1)
    zen = training_text()
    expected = (zen + zen)[zen.index(prompt) + len(prompt) :]
    assert got.startswith(expected[:40]), f"not the text's continuation: {got!r}\n{answer}"
    assert mean_len > MIN_MEAN_ACCEPTANCE_LENGTH, metrics
    assert code is not None, f"tools/serve.sh still running {STOP_BOUND_S} s after Ctrl-C"
    assert not left, f"left running after Ctrl-C: {left}"
