"""Proof of necessity: for every patch, a build without it fails the tests that guard it.

Each case builds the fork minus one patch from the cached base, unpacks it,
puts it ahead of the installed wheel on PYTHONPATH, and runs the tests marked
needs_patch(N) in a subprocess. None of them may pass and at least one must
fail (a guard that cannot run on this machine, like tests/gpu without CUDA,
skips); a patch no test guards fails here too, so nobody can drop a fix (or add one) without a test noticing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from forkbuild import assemble, config, patching  # noqa: E402

CFG = config.load(REPO)
SERIES = patching.read_series(CFG.patches_dir)


def _outcomes(junit: Path) -> dict[str, str]:
    outcomes = {}
    for case in ET.parse(junit).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[name] = ("failed" if kinds & {"failure", "error"} else
                          "skipped" if "skipped" in kinds else "passed")
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize("patch", SERIES, ids=[p.number for p in SERIES])
def test_build_without_patch_fails_its_tests(patch, tmp_path, monkeypatch):
    monkeypatch.setenv(config.SKIP_PATCHES_ENV, patch.number)
    wheel = assemble.build_wheel(CFG, CFG.targets["cpu"], tmp_path / "wheel")
    unpacked = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(unpacked)
    junit = tmp_path / "junit.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(unpacked), os.environ.get("PYTHONPATH")]))}
    env.pop(config.SKIP_PATCHES_ENV)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(REPO / "tests"), "--needs-patch", patch.number,
         "-p", "no:cacheprovider", "-q", f"--junitxml={junit}",
         "--ignore", str(REPO / "tests" / "necessity"),
         # CUDA-only tests skip on the CPU build this harness makes (a module
         # skip would count as "did not fail"); a GPU necessity run is
         # `pytest tests/gpu --needs-patch N` against a CUDA build without N.
         "--ignore", str(REPO / "tests" / "gpu")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800,
    )
    outcomes = _outcomes(junit) if junit.exists() else {}
    print(f"without {patch.name}: {outcomes}")
    # Guards that cannot run on this machine (tests/gpu without CUDA) skip; they
    # prove nothing either way, but none may pass and at least one must fail.
    failed = [name for name, outcome in outcomes.items() if outcome == "failed"]
    assert failed, f"no test here guards {patch.name}: mark one with @pytest.mark.needs_patch({patch.number!r}) ({outcomes})\n{result.stdout[-3000:]}"
    not_failed = {name: outcome for name, outcome in outcomes.items() if outcome == "passed"}
    assert not not_failed, (
        f"these tests did not fail on a build without {patch.name}, so they do not guard it: "
        f"{not_failed}\n{result.stdout[-3000:]}"
    )
