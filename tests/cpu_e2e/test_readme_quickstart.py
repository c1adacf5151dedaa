"""The README's CPU quickstart, run word for word: the pair it generates,
`vllm serve` with DFlash and an fp8 KV cache, both `curl`s, and the Python
script.

The pair answers in words (a target trained on The Zen of Python), so the
checks read as a user reads the answer: it goes on with the text, and
DFlash's acceptance on /metrics is well above what an untrained drafter
reaches. The Python script (an engine of its own) and the chat answer
compared with it are `extended` (`bash tools/run_tests.sh -m extended`). The last test stops
the server as Ctrl-C in a terminal does; it is always killed at the end.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
from draft_counts import DraftCounts
from prometheus_text import parse_metrics
from readme_blocks import block_with, commands
from vllm_server import VllmServer, vllm_dist_skip_reason

COMMAND_TIMEOUT_S = 300
README_PORT = "127.0.0.1:8000"
CHAT_MESSAGES = [{"role": "user", "content": "Flat is better than nested."}]
# After the README's one request, 1 + accepted / drafts; a drafter that
# never matches gives 1, this one about 3.8 of at most 4.
MIN_MEAN_ACCEPTANCE_LENGTH = 2.0


def _run(command: str | list[str], cwd, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """A README command as a user's shell runs it, with this environment's
    `python` and `vllm` first on PATH; a failure reports exit status and stderr."""
    bin_dir = os.path.dirname(sys.executable)
    full_env = {**os.environ, **(env or {}), "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    args = ["bash", "-c", command] if isinstance(command, str) else command
    proc = subprocess.run(args, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, **kw)
    assert proc.returncode == 0, (
        f"{command!r} exited with {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    )
    return proc


def _text_after(prompt: str) -> str:
    from vllm.fork.tiny_pairs import training_text

    text = training_text()
    return (text + text)[text.index(prompt) + len(prompt) :]


@pytest.fixture(scope="module")
def quickstart(text_pair, tmp_path_factory):
    """A directory where the README's pair command has run (the suite's cached
    copy of the same pair is put there first, so the command finds it up to
    date instead of training it again)."""
    if reason := vllm_dist_skip_reason():
        pytest.skip(reason)
    cwd = tmp_path_factory.mktemp("quickstart")
    shutil.copytree(os.path.dirname(text_pair[0]), cwd / "pair")
    generate, serve = commands(block_with("bash", "python -m vllm.fork.tiny_pairs"))
    out = _run(generate, cwd).stdout
    assert "up to date, kept" in out, out
    return {"dir": cwd, "serve": serve}


@pytest.fixture(scope="module")
def script_output(quickstart):
    """The README's Python script, run as a file; then the same engine answers
    the chat request the server's answer is compared with."""
    script = block_with("python", "from vllm import LLM")
    prompt = re.search(r'generate\(\["([^"]+)"\]', script).group(1)
    chat = textwrap.indent(
        textwrap.dedent(f"""
        import json
        chat = llm.chat({CHAT_MESSAGES!r}, params)[0].outputs[0].text
        print("CHAT:" + json.dumps(chat))
    """),
        "    ",
    )
    (quickstart["dir"] / "quickstart.py").write_text(script + chat)
    # vLLM logs to stdout unless told not to configure logging; then only
    # warnings reach stderr, and stdout is what the script prints.
    out = _run(
        [sys.executable, "quickstart.py"],
        quickstart["dir"],
        env={"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CONFIGURE_LOGGING": "0"},
    ).stdout
    answer, _, chat_line = out.rpartition("CHAT:")
    return {"prompt": prompt, "answer": answer.removesuffix("\n"), "chat": json.loads(chat_line)}


@pytest.fixture(scope="module")
def server(quickstart, tmp_path_factory):
    """The README's `vllm serve` command: its environment assignments and
    arguments as written, on a free port instead of 8000."""
    words = shlex.split(quickstart["serve"])
    env = dict(w.split("=", 1) for w in words[: words.index("vllm")])
    model, *args = words[words.index("serve") + 1 :]
    srv = VllmServer(model, args, tmp_path_factory.mktemp("serve") / "server.log", env=env, cwd=quickstart["dir"])
    try:
        srv.start()
    except Exception as e:
        pytest.fail(str(e))
    try:
        yield srv
    finally:
        srv.stop()


# The Python script starts an engine of its own (~35 s on 2 cores): extended.
@pytest.mark.extended
def test_python_script_goes_on_with_the_text(script_output):
    answer, expected = script_output["answer"], _text_after(script_output["prompt"])
    print(f"\n[quickstart] script: {script_output['prompt']!r} -> {answer!r}")
    assert answer == expected[: len(answer)] and len(answer) >= 48, (
        f"not the text's continuation:\n got  {answer!r}\n text {expected[: len(answer)]!r}"
    )


def test_curl_answer_and_acceptance(server, quickstart, measurements):
    """The README's two curls, against this server: the first goes on with
    the text, the second shows DFlash's counters."""
    completion_cmd, metrics_cmd = [
        c.replace(README_PORT, server.base.removeprefix("http://")) for c in commands(block_with("bash", "curl -s"))
    ]
    answer = json.loads(_run(completion_cmd, quickstart["dir"]).stdout)["choices"][0]["text"]
    counters = parse_metrics(_run(metrics_cmd, quickstart["dir"]).stdout)
    counts = DraftCounts.read(counters)
    drafts, accepted, mean_len = counts.drafts, counts.accepted, counts.mean_acceptance_length
    measurements["README quickstart: mean acceptance length after one 64-token request"] = {
        "drafts": drafts,
        "accepted": accepted,
        "mean_acceptance_length": round(mean_len, 2),
    }
    print(f"\n[quickstart] curl: {answer!r}; drafts {drafts:.0f}, accepted {accepted:.0f}")
    expected = _text_after(re.search(r'"prompt": "([^"]+)"', completion_cmd).group(1))
    assert answer == expected[: len(answer)] and len(answer) >= 48, (
        f"not the text's continuation:\n got  {answer!r}\n text {expected[: len(answer)]!r}"
    )
    assert mean_len > MIN_MEAN_ACCEPTANCE_LENGTH, counters


@pytest.mark.extended
def test_served_chat_equals_the_scripts_chat(server, script_output):
    body = {"model": server.model_id(), "messages": CHAT_MESSAGES, "max_tokens": 64, "temperature": 0.0}
    status, text = server.post("/v1/chat/completions", body)
    assert status == 200, text
    got = json.loads(text)["choices"][0]["message"]["content"]
    assert got == script_output["chat"]


STOP_BOUND_S = 60


def test_ctrl_c_leaves_nothing_behind(server, measurements):
    """Ctrl-C in the terminal running `vllm serve`: SIGINT to its whole
    process group. Every process exits, and nothing is left in its temp
    directory (vLLM 0.21.0 left six ZeroMQ ipc socket files there)."""
    seconds, code, survivors = server.signal(signal.SIGINT, group=True, timeout=STOP_BOUND_S)
    temp_left = server.temp_files_left()
    measurements["vllm serve stopped by SIGINT to its process group"] = {
        "exit_code": code,
        "exit_s": round(seconds, 1),
        "temp_files_left": len(temp_left),
    }
    assert not survivors, f"still alive {STOP_BOUND_S} s after SIGINT: {survivors}\n{server.log_tail()}"
    assert not server.leftovers(), server.leftovers()
    assert not temp_left, f"left in the server's TMPDIR: {temp_left}"
