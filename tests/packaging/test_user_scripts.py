"""The scripts a user runs: tools/serve.sh explains itself, tools/install_fork.sh
keeps an install that is up to date and redoes one that is not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import REPO

# What tools/install_fork.sh builds the wheel and its installation from.
BUILD_INPUTS = ("pyproject.toml", "forkbuild", "patches", "vllm", "tools", "tests/requirements.txt")


def test_serve_help_lists_the_arguments_and_environment():
    result = subprocess.run(
        ["bash", str(REPO / "tools" / "serve.sh"), "--help"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    for word in (
        "TARGET DRAFT",
        "PORT",
        "NUM_SPEC_TOKENS",
        "--device auto|cuda|cpu",
        "VLLM_CPU_KVCACHE_SPACE",
        "--reinstall",
        "The Zen of Python",
    ):
        assert word in result.stdout, (word, result.stdout)
    assert "==>" not in result.stdout  # nothing was installed or started


def _copy_of_the_build_inputs(dest: Path) -> Path:
    for name in BUILD_INPUTS:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.mark.installed_fork
def test_install_is_kept_while_nothing_changed_and_redone_after_a_change(tmp_path):
    """Against this suite's own venv, in check mode (nothing is built or
    installed): tools/run_tests.sh installed it from this checkout, so a copy
    of the same inputs is up to date; one changed byte in a patch is not."""
    venv = Path(sys.prefix)
    if not (venv / ".vllm-fork-install").is_file():
        pytest.skip(f"{venv} was not installed by tools/install_fork.sh")
    repo = _copy_of_the_build_inputs(tmp_path / "repo")
    env = {**os.environ, "VLLM_FORK_VENV": str(venv)}
    command = ["bash", "tools/install_fork.sh", "--check", "cpu", "tests/requirements.txt"]

    same = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert same.returncode == 0, same.stderr
    assert "up to date" in same.stderr and same.stdout.strip().endswith(".whl"), same.stderr
    # As tools/serve.sh asks, without requirement files: the install made with
    # them is kept (a reinstall would pull files from under running engines).
    no_reqs = subprocess.run(command[:4], cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert no_reqs.returncode == 0 and "up to date" in no_reqs.stderr, no_reqs.stderr
    other = tmp_path / "other-requirements.txt"
    other.write_text("six\n")
    more = subprocess.run([*command[:4], str(other)], cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert more.returncode == 3, more.stderr

    series = repo / "patches" / "series"
    series.write_text(series.read_text() + "\n")
    changed = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert changed.returncode == 3, changed.stderr
    assert "not up to date" in changed.stderr


@pytest.mark.parametrize(
    ("script", "variable", "option"),
    [
        ("install_fork.sh", "VLLM_FORK_REINSTALL", "--reinstall"),
        ("install_fork.sh", "VLLM_FORK_INSTALL_CHECK", "--check"),
        ("serve.sh", "VLLM_FORK_REINSTALL", "--reinstall"),
        ("serve.sh", "VLLM_FORK_TARGET", "--device"),
    ],
)
def test_a_switch_that_became_an_option_is_refused_with_its_option(script, variable, option, tmp_path):
    """Set as the scripts once read it, the variable would now be ignored
    without a word: it stops the script before anything is made."""
    env = {**os.environ, variable: "1", "VLLM_FORK_VENV": str(tmp_path / "venv")}
    result = subprocess.run(["bash", str(REPO / "tools" / script)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and f"{variable} is no longer read" in result.stderr, result.stderr
    assert option in result.stderr
    assert not (tmp_path / "venv").exists()


def test_install_options_are_checked_before_anything_is_made(tmp_path):
    env = {**os.environ, "VLLM_FORK_VENV": str(tmp_path / "venv")}
    for args, message in (
        (["--frobnicate"], "unknown option --frobnicate"),
        (["--reinstall", "--check"], "exclude each other"),
    ):
        result = subprocess.run(
            ["bash", str(REPO / "tools" / "install_fork.sh"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "venv").exists()
