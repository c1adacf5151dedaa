"""Suite-wide pytest configuration."""

import os
import sys
from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parent / "support"
# Helper modules shared by several test directories and benchmarks/
# (dflash_e2e, vllm_server): importable by their plain names.
sys.path.insert(0, str(SUPPORT))

# VLLM_FORK_TEST_NO_AVX512=1: run as if the CPU had neither AVX-512 nor AMX
# (vLLM loads _C_AVX2, fp8 KV caches take the torch path). Applied here for
# this process and, through PYTHONPATH, by sitecustomize for every child.
NO_AVX512_ENV = "VLLM_FORK_TEST_NO_AVX512"
if os.environ.get(NO_AVX512_ENV) == "1":
    _override = str(SUPPORT / "no_avx512")
    if _override not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_override, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, _override)
    import no_avx512_probes

    no_avx512_probes.apply()

import parallel_workers  # noqa: E402
import patch_guards  # noqa: E402

parallel_workers.bind_engines_to_this_workers_core()

# The tiny model pairs, as session fixtures for every directory.
pytest_plugins = ["tiny_pair_fixtures"]


# Figures the suites measured (counts compared/exact/parted, acceptance
# lengths, KV blocks), shown in the terminal summary so CI logs carry them.
_MEASURED = pytest.StashKey[dict]()


@pytest.fixture(scope="session")
def measured_section(request):
    """measured_section(title) -> a list; its lines end up in the terminal summary."""
    sections = request.config.stash.setdefault(_MEASURED, {})
    return lambda title: sections.setdefault(title, [])


def pytest_terminal_summary(terminalreporter, config):
    for title, lines in config.stash.get(_MEASURED, {}).items():
        if lines:
            terminalreporter.write_sep("-", title)
            for line in lines:
                terminalreporter.write_line(line)


def pytest_configure(config):
    # A test marked needs_patch("NNNN") guards patch NNNN of patches/series: a
    # build of the fork without that patch must make the test fail.
    config.addinivalue_line(
        "markers",
        "needs_patch(*numbers): the test guards these patches (4-digit numbers) "
        "and must fail on a build without any of them",
    )
    config.addinivalue_line(
        "markers",
        "extended: a check too long for every commit (its own server start); tools/run_tests.sh "
        "leaves it out unless -m names it (`-m extended`); CI runs it as a job of its own",
    )
    config.addinivalue_line(
        "markers",
        "installed_fork: checks the fork wheel installed in this environment "
        "(tools/run_tests.sh installs it; a torch-free packaging run deselects these)",
    )
    config.addinivalue_line(
        "markers",
        "auto_kv_only: an end-to-end check of the model-dtype KV cache only, left out of the "
        "no-AVX-512 pass (which is about the fp8 KV paths)",
    )
    config.addinivalue_line(
        "markers",
        "no_avx512_pass: also run as on a CPU without AVX-512/AMX (set by conftest; "
        "tools/run_tests.sh runs -m no_avx512_pass with VLLM_FORK_TEST_NO_AVX512=1)",
    )
    parallel_workers.register(config, _MEASURED)


def pytest_report_header(config):
    try:
        import torch
    except ImportError:  # tests/packaging runs without torch
        return "CPU as vLLM sees it: unknown (torch is not installed)"

    flags = {name: getattr(torch.cpu, f"_is_{name}_supported")() for name in ("avx2", "avx512", "amx_tile")}
    forced = " (forced: VLLM_FORK_TEST_NO_AVX512=1)" if os.environ.get(NO_AVX512_ENV) == "1" else ""
    fp8_path = "compiled kernels" if flags["avx512"] or flags["amx_tile"] else "torch (cpu_attn_torch_fp8)"
    cpu = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in flags.items())
    return f"CPU as vLLM sees it: {cpu}{forced}; fp8 KV cache path: {fp8_path}"


def pytest_addoption(parser):
    parser.addoption(
        "--needs-patch",
        metavar="NNNN",
        help="run only the tests marked needs_patch(..., NNNN, ...) (used by tests/necessity)",
    )
    parser.addoption(
        "--needs-patch-selected",
        metavar="FILE",
        help="with --needs-patch: write the selected node ids to FILE, one a line, before "
        "any test runs (tests/necessity reruns them one by one if the run crashes)",
    )


# VLLM_FORK_NECESSITY_WITH_EXTENDED=1: a necessity proof also runs the
# patch's guards marked `extended` (the extended CI job sets it).
NECESSITY_WITH_EXTENDED_ENV = "VLLM_FORK_NECESSITY_WITH_EXTENDED"

# What tools/run_tests.sh runs a second time on AVX-512/AMX CPUs, as a CPU
# without them (VLLM_FORK_TEST_NO_AVX512=1): `pytest -m no_avx512_pass`.
NO_AVX512_PASS_FILES = (
    "kernels/test_cpu_torch_fp8_kv.py",
    "kernels/test_cpu_noncausal_attention.py",
    "cpu_e2e/test_dflash_kv.py",
    "cpu_e2e/test_dflash_families.py",
)
# The necessity proofs of the patches whose guards take the fp8 KV path.
NO_AVX512_PASS_PATCHES = ("0001", "0002", "0003", "0005", "0012")


def _only_auto_kv(item) -> bool:
    """A check of a bf16/float32 KV cache only: it takes none of the fp8 paths
    the pass exists for (the AVX2 kernels of such caches run in the first pass
    of AVX2-only machines)."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("kv_dtype") == "auto":
        return True
    return item.get_closest_marker("auto_kv_only") is not None


def _in_no_avx512_pass(item) -> bool:
    rel = parallel_workers.relative_path(item)
    if rel in NO_AVX512_PASS_FILES:
        return not (rel.startswith("cpu_e2e/") and _only_auto_kv(item))
    callspec = getattr(item, "callspec", None)
    return (
        rel == "necessity/test_patches_are_needed.py" and callspec is not None and callspec.id in NO_AVX512_PASS_PATCHES
    )


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselect and before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _in_no_avx512_pass(item):
            item.add_marker("no_avx512_pass")
    patch_guards.record_guard_files(config, items)
    parallel_workers.group_and_order(config, items)
    number = config.getoption("--needs-patch")
    if not number:
        return
    # Guards marked `extended` (a start of their own too long for every
    # commit) join a necessity proof only in the extended CI job.
    with_extended = os.environ.get(NECESSITY_WITH_EXTENDED_ENV) == "1"
    keep, drop = [], []
    for item in items:
        numbers = {arg for mark in item.iter_markers("needs_patch") for arg in mark.args}
        extended = item.get_closest_marker("extended") is not None
        (keep if number in numbers and (with_extended or not extended) else drop).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_collection_finish(session):
    # After every deselection (-k, -m too), before any test runs.
    if not session.config.getoption("--needs-patch"):
        return
    for item in session.items:
        # JUnit names a case by a dotted classname; the node id lets
        # tests/necessity match outcomes to the selection exactly.
        item.user_properties.append(("nodeid", item.nodeid))
    record = session.config.getoption("--needs-patch-selected")
    if record:
        with open(record, "w", encoding="utf-8") as f:
            f.writelines(f"{item.nodeid}\n" for item in session.items)
