"""Figures the suites measured, shown in the terminal summary (a pytest plugin).

Counts compared/exact/parted, acceptance lengths, KV blocks, start times:
a test asks the session fixture ``measured_section(title)`` for a list and
appends lines; they are printed at the end, so CI logs carry them, from
every xdist worker (parallel_workers relays them to the controller).
"""

from __future__ import annotations

import parallel_workers
import pytest

MEASURED = pytest.StashKey[dict]()


@pytest.fixture(scope="session")
def measured_section(request):
    """measured_section(title) -> a list; its lines end up in the terminal summary."""
    sections = request.config.stash.setdefault(MEASURED, {})
    return lambda title: sections.setdefault(title, [])


def pytest_configure(config):
    parallel_workers.register_measured_relay(config, MEASURED)


def pytest_terminal_summary(terminalreporter, config):
    for title, lines in config.stash.get(MEASURED, {}).items():
        if lines:
            terminalreporter.write_sep("-", title)
            for line in lines:
                terminalreporter.write_line(line)
