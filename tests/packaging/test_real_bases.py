"""The fork against the real pinned bases: the installed CPU wheel, the CUDA wheel's
contents, the series round trip, and the series against vLLM 0.22.0."""

from __future__ import annotations

import csv
import hashlib
import importlib.metadata
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from repo_paths import REPO

from forkbuild import assemble, build_request, config, patching
from forkbuild.base import find_base_wheel

CFG = config.load(REPO)
SERIES = patching.read_series(CFG.patches_dir)


def _installed_vllm_dir() -> Path:
    spec = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__file__)"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(spec.stdout.strip()).parent


@pytest.mark.installed_fork
def test_installed_fork_is_this_checkout():
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("no `vllm` distribution installed: run the suite through tools/run_tests.sh")
    assert version == CFG.fork_version(CFG.targets["cpu"])
    info = json.loads(
        subprocess.run(
            [sys.executable, "-m", "vllm.fork.info", "--json"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout
    )
    assert info["fork_version"] == version
    assert [(p["name"], p["sha256"]) for p in info["patches"]] == [(p.name, p.sha256) for p in SERIES], (
        "the installed wheel was built from other patches; rerun tools/run_tests.sh"
    )
    assert info["base"]["sha256"] == CFG.targets["cpu"].sha256


@pytest.mark.installed_fork
def test_repo_overlay_never_shadows_the_installed_package():
    installed = _installed_vllm_dir()
    assert installed != REPO / "vllm", "the checkout's vllm/ shadowed the installed package"
    assert not (REPO / "vllm" / "__init__.py").exists()
    assert (installed / "_fork_provenance.json").is_file()


@pytest.mark.installed_fork
def test_vllm_cli_reports_the_fork_version():
    result = subprocess.run(
        [str(Path(sys.executable).parent / "vllm"), "--version"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert CFG.fork_version(CFG.targets["cpu"]) in result.stdout


@pytest.mark.installed_fork
def test_installed_files_match_the_record():
    dist = importlib.metadata.distribution("vllm")
    bad = [str(f) for f in dist.files if f.hash and f.hash.value != _b64(Path(dist.locate_file(f)).read_bytes())]
    assert not bad, bad[:5]


def _b64(data: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@pytest.mark.slow
def test_cuda_wheel_contents_and_metadata(tmp_path):
    target = CFG.targets["cuda"]
    wheel = assemble.build_wheel(build_request.resolve(REPO, target.name), tmp_path)
    assert wheel.name == f"vllm-0.21.0+dflashfp8.{CFG.release}-cp38-abi3-manylinux_2_24_x86_64.whl"
    with zipfile.ZipFile(wheel) as zf, zipfile.ZipFile(find_base_wheel(target)) as base:
        dist = f"vllm-{CFG.fork_version(target)}.dist-info"
        metadata = zf.read(f"{dist}/METADATA").decode()
        assert "Name: vllm\n" in metadata and "cpu" not in CFG.fork_version(target)
        base_meta = base.read("vllm-0.21.0.dist-info/METADATA").decode()
        # The base's dependencies unchanged, and the fork's extras.
        extras = [
            f'Requires-Dist: {req}; extra == "{name}"' for name, reqs in CFG.optional_dependencies for req in reqs
        ]
        assert [line for line in metadata.splitlines() if line.startswith("Requires-Dist")] == extras + [
            line for line in base_meta.splitlines() if line.startswith("Requires-Dist")
        ]
        rows = {row[0]: row for row in csv.reader(io.StringIO(zf.read(f"{dist}/RECORD").decode()))}
        assert set(rows) == set(zf.namelist())
        patched = {fd.path for p in SERIES for fd in p.files}
        for info in base.infolist():
            name = info.filename
            if name.startswith("vllm-0.21.0.dist-info/") or name in patched or name == "vllm/_version.py":
                continue
            assert zf.getinfo(name).CRC == info.CRC, name  # copied verbatim
        added = {fd.path for p in SERIES for fd in p.files if fd.is_new}
        for path in patched - added:
            assert zf.read(path) != base.read(path), f"{path} should carry a patch"
        for path in added:
            assert path not in base.namelist() and zf.read(path), f"{path} should be added by a patch"
        assert zf.getinfo("vllm/_C.abi3.so").file_size == base.getinfo("vllm/_C.abi3.so").file_size


@pytest.mark.slow
def test_series_round_trips_through_the_maintainer_tool(tmp_path):
    tree = tmp_path / "tree"
    out = tmp_path / "exported"
    out.mkdir()
    tool = [sys.executable, str(REPO / "tools" / "fork.py")]
    overlay_out = tmp_path / "overlay"
    overlay_out.mkdir()
    subprocess.run(tool + ["unpack", str(tree), "--target", "cpu"], check=True, capture_output=True)
    subprocess.run(
        tool + ["export", str(tree), "--to", str(out), "--overlay-to", str(overlay_out)],
        check=True,
        capture_output=True,
    )
    for path in list(CFG.patches_dir.glob("*.patch")) + [CFG.patches_dir / "series"]:
        assert (out / path.name).read_bytes() == path.read_bytes(), f"{path.name} does not round-trip"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        p.name for p in CFG.patches_dir.iterdir() if p.suffix == ".patch" or p.name == "series"
    )
    own = sorted(p.relative_to(CFG.overlay_dir) for p in (CFG.overlay_dir / "fork").rglob("*.py"))
    assert own and own == sorted(p.relative_to(overlay_out) for p in (overlay_out / "fork").rglob("*.py"))
    for rel in own:
        assert (overlay_out / rel).read_bytes() == (CFG.overlay_dir / rel).read_bytes(), rel

    # The unpacked tree is the wheel: each of its files under vllm/ has the
    # wheel's bytes, and the wheel's vllm/ has no source file the tree lacks.
    wheel = assemble.build_wheel(build_request.resolve(REPO, "cpu"), tmp_path / "wheel")
    tree_files = {p.relative_to(tree).as_posix(): p for p in (tree / "vllm").rglob("*") if p.is_file()}
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = {n for n in zf.namelist() if n.startswith("vllm/")}
        assert set(tree_files) <= in_wheel, sorted(set(tree_files) - in_wheel)[:5]
        differ = [n for n, p in tree_files.items() if zf.read(n) != p.read_bytes()]
        assert not differ, differ[:5]
        sources = {n for n in in_wheel if n.endswith(".py")}
        assert sources <= set(tree_files), sorted(sources - set(tree_files))[:5]


@pytest.mark.slow
def test_dflash_fix_is_reported_as_in_upstream_022():
    if os.environ.get(config.OFFLINE_ENV):
        pytest.skip("offline: needs the vllm 0.22.0 sdist from the index")
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "fork.py"), "check", "--against", "0.22.0"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(result.stdout)
    lines = {line.split()[0]: line for line in result.stdout.splitlines()[1:] if line.strip()}
    first = SERIES[0]
    assert first.fields.get("Applied-Upstream") == "0.22.0"
    assert "already in upstream" in lines[first.name]
    for patch in SERIES:
        if patch.fields.get("Applied-Upstream", "").startswith("0.22"):
            assert "already in upstream" in lines[patch.name], lines[patch.name]
