"""Session fixtures for the generated tiny target + DFlash drafter pairs
(vllm.fork.tiny_pairs), shared by every test directory; a pair is generated
only when a test asks for it."""

from __future__ import annotations

import pytest


def _make_pair(name: str, acceptance: str, **kw):
    # Imported here, not at the top: this plugin loads for every directory,
    # and tests/packaging must run without torch installed.
    import pair_cache

    return pair_cache.make_pair(name, acceptance, **kw)


@pytest.fixture(scope="session")
def partial_pair():
    return _make_pair("partial", "partial")


@pytest.fixture(scope="session")
def random_pair():
    return _make_pair("none", "none")


@pytest.fixture(scope="session")
def full_pair():
    return _make_pair("full", "full")


@pytest.fixture(scope="session")
def trained_pair():
    """A drafter trained against its target (10-30 s on 2 idle cores)."""
    return _make_pair("trained", "trained")


@pytest.fixture(scope="session")
def text_pair():
    """The README's pair: a target trained on The Zen of Python and a drafter
    trained against it (about 80 s of training on 2 idle cores)."""
    return _make_pair("text", "text")


@pytest.fixture(scope="session")
def kv_scales_pair():
    return _make_pair("kvscales", "partial", draft_kv_scales=(0.5, 0.25))


@pytest.fixture(scope="module")
def family_pair(family):
    """The pair of vllm.fork.tiny_families for the module's ``family``
    fixture (a target family and a drafter trained against it)."""
    import pair_cache

    return pair_cache.make_family_pair(family)
