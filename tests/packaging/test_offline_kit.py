"""The offline kit's packing and installer, on a kit of two small wheels made here.

What a real kit adds is only more wheels: the fork's, resolved and downloaded
by tools/make_offline_kit.sh. That end to end run (a CPU and a CUDA kit, each
installed with no network and checked) is tools/ci/check_offline_kits.sh, a CI job
of its own (README, "Offline install"). Here: the split and its manifest, the
installer's checks (missing or corrupt part, wheel off the lock, wrong Python,
missing system torch, a dependency the kit lacks), that a failed install leaves
no venv behind, and the walk that leaves torch to the system.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from forkrepo import _record_line
from repo_paths import REPO


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


offline_kit = _load("offline_kit", REPO / "tools" / "offline_kit" / "make.py")
PYTHON = "{}.{}".format(*sys.version_info[:2])


def _wheel(folder: Path, name: str, version: str, files: dict[str, str], requires: tuple[str, ...] = ()) -> Path:
    dist_info = f"{name}-{version}.dist-info"
    contents = {path: text.encode() for path, text in files.items()}
    contents[f"{dist_info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires)
    ).encode()
    contents[f"{dist_info}/WHEEL"] = b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    contents[f"{dist_info}/RECORD"] = (
        "".join(_record_line(n, d) for n, d in contents.items()) + f"{dist_info}/RECORD,,\n"
    ).encode()
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in contents.items():
            zf.writestr(member, data)
    return path


def make_toy_kit(kit: Path, *, split: str = "", system_torch: bool = False, python: str = PYTHON) -> Path:
    """A kit as make_offline_kit.sh lays it out: a `vllm` whose fork.info runs, and its dependency."""
    wheels = kit / "wheels"
    wheels.mkdir(parents=True)
    _wheel(
        wheels,
        "vllm",
        "0.21.0+cpu.dflashfp8.1",
        {
            "vllm/__init__.py": "",
            "vllm/fork/__init__.py": "",
            "vllm/fork/info.py": "import kit_dependency\nprint('toy fork', kit_dependency.VALUE)\n",
        },
        requires=("kit-dependency==1.0",),
    )
    _wheel(wheels, "kit_dependency", "1.0", {"kit_dependency.py": "VALUE = 42\n"})
    lines = offline_kit.write_lock(wheels, kit / "requirements.lock")
    with tarfile.open(kit / "src.tar", "w") as tar:
        tar.add(REPO / "tools" / "offline_kit" / "make.py", arcname="tools/offline_kit/make.py")
    (kit / "kit.json").write_text(
        json.dumps(
            {
                "format": offline_kit.KIT_FORMAT,
                "target": "cpu",
                "fork_version": "0.21.0+cpu.dflashfp8.1",
                "fork_wheel": "vllm-0.21.0+cpu.dflashfp8.1-py3-none-any.whl",
                "python": python,
                "platform": "linux_x86_64",
                "torch": "2.11.0",
                "system_torch": system_torch,
                "left_to_the_system": [],
                "wheels": len(lines),
                "src_files": 1,
            }
        )
    )
    for name, source in offline_kit.INSTALLER_FILES.items():
        shutil.copy2(source, kit / name)
    if split:
        offline_kit.split_payload(kit, offline_kit.parse_size(split))
    return kit


def _no_network() -> list[str]:
    """`unshare -n` where it works (root): the install then has no network at all."""
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True) if shutil.which("unshare") else None
    return ["unshare", "-n"] if probe is not None and probe.returncode == 0 else []


def install(kit: Path, venv: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*_no_network(), "bash", str(kit / "install.sh"), str(venv), "--python", sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_split_kit_installs_with_no_network_and_runs(tmp_path):
    kit = make_toy_kit(tmp_path / "kit", split="2K")
    manifest = json.loads((kit / "MANIFEST.json").read_text())
    assert len(manifest["parts"]) >= 3
    assert all(p["size"] <= 2048 for p in manifest["parts"])
    assert sorted(p.name for p in kit.iterdir()) == [
        "MANIFEST.json",
        "install.sh",
        "install_kit.py",
        "kit.json",
        "parts",
    ]
    venv = tmp_path / "venv"
    result = install(kit, venv)
    assert result.returncode == 0, result.stderr
    assert "toy fork 42" in result.stdout
    assert (venv / "vllm-fork-src" / "tools" / "offline_kit" / "make.py").is_file()
    if not _no_network():
        pytest.skip("installed with --no-index only: `unshare -n` needs root here")


def test_unsplit_kit_checks_and_installs_into_an_existing_venv(tmp_path):
    kit = make_toy_kit(tmp_path / "kit")
    check = subprocess.run(
        ["bash", str(kit / "install.sh"), "--check", "--python", sys.executable], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr
    assert f"for Python {PYTHON}" in check.stdout and "2 wheels" in check.stdout
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    result = install(kit, venv)
    assert result.returncode == 0, result.stderr
    assert "toy fork 42" in result.stdout


@pytest.mark.parametrize("damage", ["missing", "corrupt", "truncated"])
def test_a_damaged_part_is_named_and_nothing_is_installed(tmp_path, damage):
    kit = make_toy_kit(tmp_path / "kit", split="2K")
    part = kit / "parts" / f"{offline_kit.PART_PREFIX}001"
    if damage == "missing":
        part.unlink()
    elif damage == "corrupt":
        data = bytearray(part.read_bytes())
        data[100] ^= 0xFF
        part.write_bytes(bytes(data))
    else:
        part.write_bytes(part.read_bytes()[:-10])
    venv = tmp_path / "venv"
    result = install(kit, venv)
    assert result.returncode == 1
    assert f"parts/{part.name}" in result.stderr
    assert ("missing" if damage == "missing" else "corrupt") in result.stderr
    assert not venv.exists()


def test_a_wheel_off_the_lock_is_refused(tmp_path):
    kit = make_toy_kit(tmp_path / "kit")
    _wheel(kit / "wheels", "kit_dependency", "1.0", {"kit_dependency.py": "VALUE = 'tampered'\n"})
    result = install(kit, tmp_path / "venv")
    assert result.returncode == 1
    assert "no wheel with the locked hash for: kit-dependency==1.0" in result.stderr
    assert "not in the lock: kit_dependency-1.0-py3-none-any.whl" in result.stderr
    assert not (tmp_path / "venv").exists()


def test_a_dependency_the_kit_lacks_fails_and_the_new_venv_is_removed(tmp_path):
    kit = make_toy_kit(tmp_path / "kit")
    (kit / "wheels" / "kit_dependency-1.0-py3-none-any.whl").unlink()
    offline_kit.write_lock(kit / "wheels", kit / "requirements.lock")
    venv = tmp_path / "venv"
    result = install(kit, venv)
    assert result.returncode == 1
    assert "pip could not install the kit" in result.stderr and "kit-dependency" in result.stderr.lower()
    assert f"removed {venv} again" in result.stderr
    assert not venv.exists()


def test_a_kit_for_another_python_says_which_to_use(tmp_path):
    kit = make_toy_kit(tmp_path / "kit", python="3.99")
    result = install(kit, tmp_path / "venv")
    assert result.returncode == 1
    assert "this kit is for Python 3.99" in result.stderr and "--python python3.99" in result.stderr
    assert not (tmp_path / "venv").exists()


def test_a_system_torch_kit_needs_the_torch_it_was_made_for(tmp_path):
    kit = make_toy_kit(tmp_path / "kit", system_torch=True)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)  # no torch in it
    result = install(kit, venv)
    assert result.returncode == 1
    assert "needs torch 2.11.0" in result.stderr and "no torch" in result.stderr
    assert venv.exists()  # the user's own venv is never removed


def _report_item(name: str, requires: list[str], requested: bool = False, extras: list[str] | None = None) -> dict:
    item = {"metadata": {"name": name, "version": "1", "requires_dist": requires}, "requested": requested}
    if extras:
        item["requested_extras"] = extras
    return item


def test_system_torch_leaves_out_torch_and_what_only_torch_needs():
    items = [
        _report_item(
            "vllm",
            [
                "torch==2.11.0",
                "torchvision",
                "numpy",
                "fastapi[standard]",
                "six; python_version < '3'",
                "pandas; extra == 'bench'",
            ],
            requested=True,
        ),
        _report_item("torch", ["numpy", "sympy", "nvidia-cublas; platform_system == 'Linux'", "triton"]),
        _report_item("torchvision", ["torch==2.11.0", "pillow"]),
        _report_item("fastapi", ["starlette", "uvicorn; extra == 'standard'"]),
        *(
            _report_item(name, [])
            for name in ("numpy", "sympy", "nvidia-cublas", "triton", "pillow", "starlette", "uvicorn", "six", "pandas")
        ),
        _report_item("pytest", ["pluggy"], requested=True),
        _report_item("pluggy", []),
    ]
    kept, left_out = offline_kit.without_system_packages(items, ("torch",))
    assert sorted(i["metadata"]["name"] for i in kept) == [
        "fastapi",
        "numpy",
        "pillow",
        "pluggy",
        "pytest",
        "starlette",
        "torchvision",
        "uvicorn",
        "vllm",
    ]
    # six and pandas are in no kit walk (marker false, extra not asked): pip would not have resolved them.
    assert left_out == ["nvidia-cublas", "pandas", "six", "sympy", "torch", "triton"]


@pytest.mark.parametrize(
    "text, size", [("60M", 60 << 20), ("1G", 1 << 30), ("512k", 512 << 10), ("1000", 1000), ("60MiB", 60 << 20)]
)
def test_split_sizes(text, size):
    assert offline_kit.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "0", "sixty", "60T", "-5M"])
def test_a_bad_split_size_says_what_to_give(text):
    with pytest.raises(offline_kit.KitError, match="give a size such as 60M"):
        offline_kit.parse_size(text)


def _make(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "tools" / "make_offline_kit.sh"), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYENV_ROOT": "/nonexistent"},
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--target", "rocm", "OUT"], "unknown target 'rocm': use cuda or cpu"),
        (["--python", "3.99", "OUT"], "no Python 3.99 here"),
        ([], "say where the kit goes"),
        (["--frobnicate", "OUT"], "unknown option --frobnicate"),
        (["--with-requirements", "no-such-file.txt", "OUT"], "no requirement file"),
    ],
)
def test_make_offline_kit_refuses_bad_arguments(tmp_path, args, message):
    args = [str(tmp_path / a) if a == "OUT" else a for a in args]
    result = _make(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert not (tmp_path / "OUT").exists()


def test_make_offline_kit_never_writes_into_a_kit_that_exists(tmp_path):
    out = tmp_path / "kit"
    out.mkdir()
    (out / "something").write_text("kept")
    result = _make(str(out))
    assert result.returncode == 2 and "already exists and is not empty" in result.stderr
    assert [p.name for p in out.iterdir()] == ["something"]
