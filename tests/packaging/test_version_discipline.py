"""A change to patches/ or vllm/ must come with a release bump.

pip treats an equal version as already installed (even with -U), so users
who upgrade would silently keep the old patches.
"""

from __future__ import annotations

from fork_maintainer.release_lock import LOCK_FILE, content_digest, read_lock
from repo_paths import REPO

from forkbuild import config


def test_release_lock_matches_patches_and_overlay():
    cfg = config.load(REPO)
    lock = read_lock(cfg)
    assert lock, f"{LOCK_FILE} is missing: run `python tools/fork.py lock`"
    assert lock["release"] == str(cfg.release), (
        f"{LOCK_FILE} locks release {lock['release']} but pyproject.toml says {cfg.release}: "
        "run `python tools/fork.py lock`"
    )
    assert lock["content"] == content_digest(cfg), (
        "patches/ or vllm/ changed without a release bump: increase [tool.vllm-fork].release "
        "in pyproject.toml, then run `python tools/fork.py lock`"
    )


def test_lock_refuses_changed_content_without_bump(fork_repo):
    from forkrepo import run_tool

    assert run_tool(fork_repo, "lock").returncode == 0
    (fork_repo.root / "vllm" / "new.py").write_text("X = 1\n")
    refused = run_tool(fork_repo, "lock")
    assert refused.returncode != 0 and "bump" in refused.stderr
    pyproject = fork_repo.root / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace("release = 1\n", "release = 2\n"))
    assert run_tool(fork_repo, "lock").returncode == 0
