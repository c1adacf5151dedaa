"""tools/ci/release_assets.py, which .github/workflows/release.yml runs on a
pushed tag, on a synthetic fork: the files a release carries and the tag
check that stops a release of the wrong number."""

from __future__ import annotations

import subprocess
import sys

from repo_paths import REPO

TAG = "v0.21.0-dflashfp8.1"  # the synthetic fork is release 1 of 0.21.0


def _release(fork_repo, *args):
    return subprocess.run(
        [sys.executable, "tools/ci/release_assets.py", *args], cwd=fork_repo.root, capture_output=True, text=True
    )


def test_a_tag_releases_both_targets_sdists_and_wheels_with_their_sums(fork_repo, tmp_path):
    out, notes = tmp_path / "release", tmp_path / "notes.md"
    url = "https://github.com/owner/fork/releases/download/" + TAG
    result = _release(fork_repo, "--tag", TAG, str(out), "--notes", str(notes), "--download-url", url)
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "SHA256SUMS",
        "vllm-0.21.0+cpu.dflashfp8.1-cp38-abi3-manylinux_2_28_x86_64.whl",
        "vllm-0.21.0+cpu.dflashfp8.1.tar.gz",
        "vllm-0.21.0+dflashfp8.1-cp38-abi3-manylinux_2_24_x86_64.whl",
        "vllm-0.21.0+dflashfp8.1.tar.gz",
    ], result.stdout
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=out, capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.count(": OK") == 4, check.stdout + check.stderr
    text = notes.read_text()
    assert f"pip install '{url}/vllm-0.21.0%2Bcpu.dflashfp8.1-cp38-abi3-manylinux_2_28_x86_64.whl'" in text


def test_a_tag_of_another_release_stops_before_anything_is_built(fork_repo, tmp_path):
    out = tmp_path / "release"
    result = _release(fork_repo, "--tag", "v0.21.0-dflashfp8.2", str(out))
    assert result.returncode == 2
    assert "pyproject.toml gives 'v0.21.0-dflashfp8.1'" in result.stderr, result.stderr
    assert not out.exists()


def test_a_failed_build_leaves_no_release_directory(fork_repo, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_FORK_BASE_WHEEL", str(tmp_path / "no-bases-here"))
    monkeypatch.setenv("VLLM_FORK_OFFLINE", "1")
    out = tmp_path / "release"
    result = _release(fork_repo, "--tag", TAG, str(out))
    assert result.returncode == 2, result.stderr
    assert "failed with exit status" in result.stderr
    assert not out.exists()


def test_the_release_workflow_runs_the_tool_on_tags():
    workflow = (REPO / ".github" / "workflows" / "release.yml").read_text()
    assert "python tools/ci/release_assets.py --tag" in workflow
    assert "tags:" in workflow and "contents: write" in workflow
