"""Running the suite on several pytest-xdist workers (``-n N --dist loadgroup``).

Most of the suite's time is spent starting engines and servers, much of it
single-threaded Python, so a second worker on a second core shortens the run
(measured on 2 cores: 1580 s in one process, 983 s on two workers; each unit
runs slower than alone, the cores being shared). What must stay together does:

- every test of a file runs on one worker, in file order, so the engines a
  file shares (offline_engine.start_llm reuses the live engine) start once;
- tests/serve_load is one unit: its tests share one session server, and
  test_shutdown.py ends that server after the others;
- the necessity proofs are one unit per patch: each builds the fork without
  its patch and runs that patch's guards in a subprocess, independent of the
  rest, so they spread over the workers.
- tests/cpu_e2e/test_dflash_kv.py is one unit per KV dtype (each dtype has
  engines of its own) and one for its other tests: in the pass as without
  AVX-512 it is nearly all there is, and one worker alone took it (147 s;
  102 s split). test_dflash_layer_tap.py joins the latter unit after its
  float32 check, whose DFlash engine it reuses (same key, same settings).
- tests/cpu_e2e/test_dflash_families.py is one unit per target family (two
  engines each), for the same reason.

vLLM's CPU worker binds its OpenMP threads to cores ("auto": all cores but
one reserved); two engines started by two workers would both bind to the same
core. Each xdist worker gives its engines a core of their own instead
(VLLM_CPU_OMP_THREADS_BIND, unless the caller set it), or no binding when
there are more workers than cores.

Units are handed out longest first (serve_load, the KV-dtype engines of
cpu_e2e, the target families' engines, the necessity proofs, then the other files; measured on 2 cores),
so no worker is left with a long unit at the end;
that takes --no-loadscope-reorder (tools/run_tests.sh passes it), as xdist
otherwise orders units by their number of tests.
Figures a worker measured (the ``measured_section`` fixture) travel to the
controller and are printed in its terminal summary.

Without xdist (or with ``-n 0``) nothing here changes the run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from repo_paths import TESTS

# Longest units first; a file or directory not listed comes after them.
UNIT_ORDER = (
    "serve_load",
    "cpu_e2e/test_dflash_kv.py",
    "cpu_e2e/test_dflash_families.py",
    "necessity/test_patches_are_needed.py",
    "kernels/test_triton_noncausal_attention.py",
    "cpu_e2e",
    "gpu",
    "kernels",
)
WHOLE_DIRECTORIES = ("serve_load",)
ONE_UNIT_PER_TEST = ("necessity/test_patches_are_needed.py",)
# Files whose tests start engines of their own for each value of one
# parameter: a unit per value, so two workers share the file (its tests
# without that parameter stay one unit).
ONE_UNIT_PER_PARAM = {"cpu_e2e/test_dflash_kv.py": "kv_dtype", "cpu_e2e/test_dflash_families.py": "family"}
# A file whose tests reuse the engine another file's unit leaves running
# joins that unit, after it.
JOINS_UNIT_OF = {
    "cpu_e2e/test_dflash_layer_tap.py": "cpu_e2e/test_dflash_kv.py",
    # reads the hybrid MoE pair that unit generates
    "cpu_e2e/test_dflash_fp8_weight_target.py": "cpu_e2e/test_dflash_families.py-family=qwen3_5_moe",
}
MEASURED_KEY = "measured_sections"


def relative_path(item: pytest.Item) -> str:
    """The item's file relative to tests/ (absolute if outside)."""
    try:
        return Path(item.path).resolve().relative_to(TESTS).as_posix()
    except ValueError:
        return Path(item.path).as_posix()


def unit_of(item: pytest.Item) -> str:
    rel = relative_path(item)
    top = rel.split("/", 1)[0]
    if top in WHOLE_DIRECTORIES:
        return top
    callspec = getattr(item, "callspec", None)
    if rel in JOINS_UNIT_OF:
        return JOINS_UNIT_OF[rel]
    if rel in ONE_UNIT_PER_TEST:
        return f"{Path(rel).stem}-{callspec.id if callspec else item.name}"
    param = ONE_UNIT_PER_PARAM.get(rel)
    if param and callspec is not None and param in callspec.params:
        # Not "[...]": xdist takes a node id that ends in "]" for one without a group.
        return f"{rel}-{param}={callspec.params[param]}"
    return rel


def _rank(item: pytest.Item) -> int:
    rel = relative_path(item)
    for i, prefix in enumerate(UNIT_ORDER):
        if rel == prefix or rel.startswith(prefix.rstrip("/") + "/"):
            return i
    return len(UNIT_ORDER)


def bind_engines_to_this_workers_core() -> None:
    """Called by pytest_configure below: in an xdist worker, before any engine starts."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not worker.startswith("gw") or count < 2 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    index = int(worker[2:])
    if count <= len(cores):
        share = len(cores) // count
        mine = cores[index * share : (index + 1) * share]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, mine))
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"


def distributed(config: pytest.Config) -> bool:
    """Whether this process collects for xdist's loadgroup scheduling: xdist
    workers collect (the controller does not), with --dist loadgroup turned
    into option.loadgroup there."""
    return bool(getattr(config.option, "loadgroup", False))


def group_and_order(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Call from a tryfirst pytest_collection_modifyitems: xdist's own hook
    reads the xdist_group marks into the node ids it schedules by."""
    if not distributed(config):
        return
    # A stable sort: file order and the order within a unit stay as collected.
    items.sort(key=_rank)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(name=unit_of(item)))


def check_groups_took_effect(config: pytest.Config, items: list[pytest.Item]) -> None:
    """After xdist's own collection hook (GroupCheck). xdist schedules a
    group by a suffix it adds to the node id; a pytest that ignores that
    suffix (pytest 9 with xdist 3.8) would run a group's tests on several
    workers (a session server per worker) without any error: stop instead."""
    if not distributed(config):
        return
    ungrouped = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if ungrouped:
        raise pytest.UsageError(
            f"pytest {pytest.__version__} ignores pytest-xdist's test groups (e.g. {ungrouped[0]}); "
            "install the versions tests/requirements.txt pins, or run with -n 0"
        )


class MeasuredRelay:
    """Measured figures: worker -> controller (registered only under xdist)."""

    def __init__(self, stash_key):
        self.stash_key = stash_key

    @pytest.hookimpl(trylast=True)  # after the session fixtures wrote their lines
    def pytest_sessionfinish(self, session):
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:
            workeroutput[MEASURED_KEY] = session.config.stash.get(self.stash_key, {})

    def pytest_testnodedown(self, node, error):
        sections = getattr(node, "workeroutput", {}).get(MEASURED_KEY, {})
        mine = node.config.stash.setdefault(self.stash_key, {})
        for title, lines in sections.items():
            mine.setdefault(title, []).extend(lines)


class GroupCheck:
    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        check_groups_took_effect(config, items)


def register_measured_relay(config: pytest.Config, stash_key) -> None:
    """Figures stashed under ``stash_key`` on the workers reach the controller."""
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(MeasuredRelay(stash_key), "measured-relay")


# As a pytest plugin (tests/conftest.py lists it): the worker units.


def pytest_configure(config: pytest.Config) -> None:
    bind_engines_to_this_workers_core()
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(GroupCheck(), "xdist-group-check")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    group_and_order(config, items)


def threads_bind_for_ranks(ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for an engine of ``ranks`` CPU workers
    (tensor parallelism): one core list per rank, "|"-separated. vLLM's
    "auto" binding refuses more ranks than NUMA nodes, so the cores are named:
    this xdist worker's cores (or all allowed ones) split into ``ranks``
    parts; with fewer cores than ranks, ranks share them."""
    mine = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if mine and mine not in ("auto", "nobind") and "|" not in mine:
        cores = [int(c) for c in mine.split(",") if c.strip().isdigit()]
    else:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    if len(cores) >= ranks:
        share = len(cores) // ranks
        parts = [cores[i * share : (i + 1) * share] for i in range(ranks)]
    else:
        parts = [cores] * ranks
    return "|".join(",".join(map(str, p)) for p in parts)
