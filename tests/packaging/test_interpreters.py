"""The fork builds with every Python it supports (requires-python >=3.10),
through the frontends users have.

The synthetic fork (tests/packaging/conftest.py) is built with each CPython
3.10-3.13 found on this machine, in the frontend's isolated build environment
as users' installs do (the backend's own build requirement, tomli on 3.10,
must be declared, not assumed):

- `pip wheel` of the checkout: the CPU wheel;
- `uv build --python X` for each target: an sdist, then the wheel built from
  that sdist (uv's default), so both kinds and both targets on every Python;
- `python -m build` (sdist, then wheel from it) for each target, with the
  interpreter running the suite (where `build` is installed).

An interpreter the machine lacks is skipped with its name; the one running
the suite always runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

VERSIONS = ["3.10", "3.11", "3.12", "3.13"]


def _runs(python: str, version: str) -> bool:
    p = subprocess.run(
        [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True
    )
    return p.returncode == 0 and p.stdout.strip() == version


def _find_python(version: str) -> str | None:
    if f"{sys.version_info.major}.{sys.version_info.minor}" == version:
        return sys.executable
    # pyenv keeps interpreters outside PATH (its shims fail unless a version is selected).
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = sorted(root.glob(f"{version}.*/bin/python{version}"), reverse=True) if root.is_dir() else []
    candidates.append(shutil.which(f"python{version}"))
    return next((str(c) for c in candidates if c and _runs(str(c), version)), None)


@pytest.mark.parametrize("version", VERSIONS)
def test_pip_wheel_builds_with_python(version, fork_repo, tmp_path):
    python = _find_python(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine (PATH or pyenv)")
    out = tmp_path / "wheels"
    result = subprocess.run(
        [python, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-w", str(out), str(fork_repo.root)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PIP_NO_INPUT": "1"},
    )
    assert result.returncode == 0, f"Python {version}: rc={result.returncode}\n{result.stderr[-3000:]}"
    wheels = [p.name for p in out.glob("vllm-*.whl")]
    print(f"\n[packaging] Python {version} ({python}): {wheels}")
    assert wheels == ["vllm-0.21.0+cpu.dflashfp8.1-cp38-abi3-manylinux_2_28_x86_64.whl"]


WHEEL_TAGS = {"cpu": "cp38-abi3-manylinux_2_28_x86_64", "cuda": "cp38-abi3-manylinux_2_24_x86_64"}
LOCAL = {"cpu": "+cpu.dflashfp8.1", "cuda": "+dflashfp8.1"}


def _expected(target: str) -> list[str]:
    return sorted([f"vllm-0.21.0{LOCAL[target]}-{WHEEL_TAGS[target]}.whl", f"vllm-0.21.0{LOCAL[target]}.tar.gz"])


def _frontend(cmd: list[str], target: str, out: Path) -> list[str]:
    env = {**os.environ, "VLLM_TARGET_DEVICE": target, "PIP_NO_INPUT": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, f"{' '.join(cmd)}: rc={result.returncode}\n{result.stderr[-3000:]}"
    return sorted(p.name for p in out.iterdir() if p.suffix in (".whl", ".gz"))


@pytest.mark.parametrize("target", ["cpu", "cuda"])
@pytest.mark.parametrize("version", VERSIONS)
def test_uv_build_sdist_then_wheel_with_python(version, target, fork_repo, tmp_path):
    python = _find_python(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine (PATH or pyenv)")
    uv = shutil.which("uv", path=os.path.dirname(sys.executable)) or shutil.which("uv")
    if uv is None:
        pytest.fail("uv is missing: it comes with tests/requirements.txt")
    out = tmp_path / "dist"
    built = _frontend([uv, "build", "--python", python, "--out-dir", str(out), str(fork_repo.root)], target, out)
    print(f"\n[packaging] uv build, Python {version}, {target}: {built}")
    assert built == _expected(target)


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_python_m_build_sdist_then_wheel(target, fork_repo, tmp_path):
    pytest.importorskip("build", reason="python -m build comes with tests/requirements.txt")
    out = tmp_path / "dist"
    built = _frontend([sys.executable, "-m", "build", "--outdir", str(out), str(fork_repo.root)], target, out)
    print(f"\n[packaging] python -m build, {target}: {built}")
    assert built == _expected(target)
