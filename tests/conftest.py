"""Suite-wide pytest configuration: the plugins and the suite-wide markers.

Each concept of the suite is a plugin of its own in tests/support:
no_avx512_pass (the run as on a CPU without AVX-512), necessity_plugin (the
tests that guard each patch), parallel_workers (the xdist units and their
cores), measured_figures (figures in the terminal summary) and
tiny_pair_fixtures (the generated model pairs).
"""

import sys

import pytest

# In dependency order (a plugin is registered before the plugins that import
# it), no_avx512_pass before anything that imports torch: with
# VLLM_FORK_TEST_NO_AVX512=1 it changes torch's CPU probes when imported.
pytest_plugins = ["parallel_workers", "no_avx512_pass", "necessity_plugin", "measured_figures", "tiny_pair_fixtures"]


def pytest_configure(config):
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


@pytest.fixture(autouse=True)
def vllm_envs_read_afresh():
    """Every test reads vLLM's environment variables as they are now.

    An engine core that ran in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
    freezes ``vllm.envs`` at the values it started with, so a later test's
    ``monkeypatch.setenv`` would change nothing and its verdict would depend
    on which tests its worker happened to run before it."""
    envs = sys.modules.get("vllm.envs")
    if envs is not None:
        envs.disable_envs_cache()
    yield
