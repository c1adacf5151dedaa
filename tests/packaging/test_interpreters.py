"""The fork builds with every Python it supports (requires-python >=3.10).

`pip wheel` of the synthetic fork (tests/packaging/conftest.py) with each
CPython 3.10-3.13 found on this machine, through pip's isolated build
environment as users' installs do: the backend's own build requirement
(tomli on 3.10) must be declared, not assumed. An interpreter the machine
lacks is skipped with its name; the one running the suite always runs.
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
    p = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                       capture_output=True, text=True)
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
        [python, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-w", str(out),
         str(fork_repo.root)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PIP_NO_INPUT": "1"},
    )
    assert result.returncode == 0, f"Python {version}: rc={result.returncode}\n{result.stderr[-3000:]}"
    wheels = [p.name for p in out.glob("vllm-*.whl")]
    print(f"\n[packaging] Python {version} ({python}): {wheels}")
    assert wheels == ["vllm-0.21.0+cpu.dflashfp8.1-cp38-abi3-manylinux_2_28_x86_64.whl"]
