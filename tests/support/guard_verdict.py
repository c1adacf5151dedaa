"""What the guards of one patch did on a build without it, and whether that proves the patch.

run_guards() runs the pytest subprocesses (one; one more per guard only when
that one died); the rest are pure functions. Neither needs a build or vllm, so
tests/necessity/test_guard_verdict.py checks them with fake runs and with a
small synthetic test tree that really crashes.

Rules (the module docstring of test_patches_are_needed.py explains why):

- a guard that PASSES on the build without the patch does not guard it: fail;
- the proof needs at least one guard that FAILED (assertion or error);
- a guard that CRASHED its process (killed by a signal, or no JUnit outcome)
  proves nothing: a crash can come from something unrelated to the patch
  (a CPU-feature fault, say). It is reported by name with its signal and the
  tail of its stderr; if every guard crashed, the case fails with that report;
- a guard that SKIPPED (cannot run on this machine) proves nothing either way.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

PASSED, FAILED, SKIPPED, CRASHED = "passed", "failed", "skipped", "crashed"

# pytest's exit codes after a session it finished itself: 0 all passed,
# 1 some failed, 5 nothing collected (no guard). Anything else (2
# interrupted, 3 internal error, 4 usage error, a negative code: a signal)
# means the run did not get to report every guard.
FINISHED_EXIT_CODES = (0, 1, 5)

TAIL_CHARS = 3000
TIMEOUT_S = 1800


@dataclass
class Run:
    """One pytest subprocess: its exit status and captured output.

    returncode None means it timed out and was killed."""

    returncode: int | None
    stdout: str = ""
    stderr: str = ""
    timeout_s: float | None = None

    @property
    def signal_name(self) -> str | None:
        if self.returncode is None or self.returncode >= 0:
            return None
        try:
            return signal.Signals(-self.returncode).name
        except ValueError:
            return f"signal {-self.returncode}"

    @property
    def died(self) -> bool:
        """Killed (signal or timeout) or ended without finishing its session."""
        return self.returncode not in FINISHED_EXIT_CODES

    def exit_status(self) -> str:
        if self.returncode is None:
            return f"timed out after {self.timeout_s}s and was killed"
        if self.signal_name:
            return f"rc={self.returncode} (killed by {self.signal_name})"
        return f"rc={self.returncode}"

    def tails(self, chars: int = TAIL_CHARS) -> str:
        """The end of stdout (pytest's summary) and of stderr; of stderr the
        start too, where a crash's "Fatal Python error: ..." and the stack of
        the test that died are (faulthandler writes them there, ahead of a
        long list of extension modules)."""
        stderr = self.stderr
        if len(stderr) > 2 * chars:
            stderr = f"{stderr[:chars]}\n[... {len(stderr) - 2 * chars} chars ...]\n{stderr[-chars:]}"
        return (
            f"--- stdout (last {chars} chars) ---\n{self.stdout[-chars:]}\n"
            f"--- stderr (first and last {chars} chars) ---\n{stderr}"
        )


@dataclass
class Guard:
    """The outcome of one guard (a selected test node id)."""

    nodeid: str
    outcome: str  # PASSED / FAILED / SKIPPED / CRASHED
    # The process that gave the outcome: the patch's single run, or the
    # guard's own rerun after that one died.
    run: Run | None = None
    rerun: bool = False

    def describe(self) -> str:
        where = "own process" if self.rerun else "the patch's run"
        status = self.run.exit_status() if self.run else "no process"
        return f"{self.nodeid}: {self.outcome} ({where}, {status})"


@dataclass
class Verdict:
    ok: bool
    message: str
    guards: list[Guard] = field(default_factory=list)


def read_junit(junit: Path) -> dict[str, str]:
    """{node id: passed/failed/skipped} from a JUnit file; {} if it is missing or unreadable.

    The node id is the testcase's "nodeid" property (tests/support/necessity_plugin.py adds it
    under --needs-patch), else JUnit's own "classname::name"."""
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return {}
    outcomes = {}
    for case in root.iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        name = props.get("nodeid") or f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[name] = FAILED if kinds & {"failure", "error"} else SKIPPED if "skipped" in kinds else PASSED
    return outcomes


def guards_to_rerun(run: Run, outcomes: dict[str, str], selected: list[str] | None) -> list[str]:
    """The selected guards that need their own process: none when the run
    finished and reported every guard (the normal path: one process a patch)."""
    if selected is None:  # the run died before its collection was recorded
        return []
    missing = [nodeid for nodeid in selected if nodeid not in outcomes]
    if run.died or missing:
        return missing
    return []


def classify(
    selected: list[str] | None,
    run: Run,
    outcomes: dict[str, str],
    reruns: dict[str, tuple[Run, dict[str, str]]] | None = None,
) -> list[Guard]:
    """One Guard per selected node id (per reported one if the selection is unknown).

    A guard keeps the outcome the patch's run reported for it; otherwise its
    rerun's (reruns: node id -> (Run, its JUnit outcomes)); a guard with no
    outcome from either, or whose own process was killed, CRASHED."""
    reruns = reruns or {}
    nodeids = list(selected) if selected is not None else list(outcomes)
    nodeids += [n for n in outcomes if n not in nodeids]
    guards = []
    for nodeid in nodeids:
        if nodeid in outcomes:
            guards.append(Guard(nodeid, outcomes[nodeid], run))
        elif nodeid in reruns:
            own_run, own = reruns[nodeid]
            outcome = own.get(nodeid)
            if outcome is None and len(own) == 1:  # one case per process: whatever its name
                outcome = next(iter(own.values()))
            if own_run.signal_name or own_run.returncode is None or outcome is None:
                outcome = CRASHED
            guards.append(Guard(nodeid, outcome, own_run, rerun=True))
        else:
            guards.append(Guard(nodeid, CRASHED, run))
    return guards


def verdict(patch: str, number: str, run: Run, guards: list[Guard], selected_known: bool = True) -> Verdict:
    """Whether the guards prove that the build without `patch` is broken,
    with a report that always names the exit status and output tails."""
    by = {kind: [g for g in guards if g.outcome == kind] for kind in (PASSED, FAILED, SKIPPED, CRASHED)}
    lines = [f"without {patch}: pytest {run.exit_status()}; " + ", ".join(f"{len(by[k])} {k}" for k in by)]
    lines += [f"  {g.describe()}" for g in guards]
    for g in by[CRASHED]:
        if g.rerun and g.run is not None:
            lines.append(f"crashed guard {g.nodeid}: its process {g.run.exit_status()}\n{g.run.tails(1500)}")
    if not selected_known and run.died:
        lines.append("the run died before its guards were collected (a crash at import time?): nothing could be rerun")
    lines.append(f"the patch's run:\n{run.tails()}")
    report = "\n".join(lines)

    if by[PASSED]:
        return Verdict(
            False,
            (
                f"these tests did not fail on a build without {patch}, so they do not "
                f"guard it: {[g.nodeid for g in by[PASSED]]}\n{report}"
            ),
            guards,
        )
    if by[FAILED]:
        note = f" (crashed guards prove nothing: {[g.nodeid for g in by[CRASHED]]})" if by[CRASHED] else ""
        return Verdict(True, f"{patch} is needed: {len(by[FAILED])} guard(s) failed without it{note}\n{report}", guards)
    if by[CRASHED] or run.died:
        return Verdict(
            False,
            (
                f"no guard of {patch} failed by assertion or error on a build without it; "
                f"{len(by[CRASHED])} crashed, and a crash is no proof (it may not come "
                f"from the patch)\n{report}"
            ),
            guards,
        )
    return Verdict(
        False, (f"no test here guards {patch}: mark one with @pytest.mark.needs_patch({number!r})\n{report}"), guards
    )


def run_pytest(args: list[str], cwd: Path, env: dict[str, str] | None, timeout_s: float = TIMEOUT_S) -> Run:
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as exc:

        def text(out):
            return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")

        return Run(None, text(exc.stdout), text(exc.stderr), timeout_s=timeout_s)
    return Run(result.returncode, result.stdout, result.stderr)


def run_guards(
    paths: list[str],
    rootdir: Path,
    number: str,
    workdir: Path,
    env: dict[str, str] | None,
    extra_args: tuple[str, ...] = (),
    timeout_s: float = TIMEOUT_S,
):
    """Run the tests marked needs_patch(number) under paths in one pytest process;
    if it died, rerun each guard it gave no outcome for in its own process.

    Returns (run, outcomes, selected, reruns) for classify(): selected is the
    node ids (relative to rootdir) that tests/support/necessity_plugin.py wrote at collection
    (None if the run died before that), reruns {node id: (Run, outcomes)}."""
    junit = workdir / "junit.xml"
    selected_file = workdir / "selected.txt"
    run = run_pytest(
        [
            *paths,
            "--needs-patch",
            number,
            f"--needs-patch-selected={selected_file}",
            f"--junitxml={junit}",
            *extra_args,
        ],
        workdir,
        env,
        timeout_s,
    )
    outcomes = read_junit(junit)
    # Written at collection, before any test runs: known even if the run crashed.
    selected = selected_file.read_text().splitlines() if selected_file.exists() else None
    reruns = {}
    for i, nodeid in enumerate(guards_to_rerun(run, outcomes, selected)):
        own_junit = workdir / f"junit-guard-{i}.xml"
        own = run_pytest(
            [f"{rootdir}/{nodeid}", "--needs-patch", number, f"--junitxml={own_junit}", *extra_args],
            workdir,
            env,
            timeout_s,
        )
        reruns[nodeid] = (own, read_junit(own_junit))
    return run, outcomes, selected, reruns
