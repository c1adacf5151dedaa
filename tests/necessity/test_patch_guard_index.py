"""The guard index (tests/support/patch_guards.py) reads the marks pytest sees."""

from __future__ import annotations

import textwrap
from pathlib import Path

import patch_guards
import pytest
from repo_paths import TESTS


def _read(tmp_path: Path, source: str) -> patch_guards.GuardFile:
    path = tmp_path / "test_guards.py"
    path.write_text(textwrap.dedent(source))
    return patch_guards.read_guard_file(path)


def test_marks_of_module_class_function_param_and_alias_add_up(tmp_path):
    got = _read(
        tmp_path,
        """
        import pytest

        pytestmark = [pytest.mark.needs_patch("0007"), pytest.mark.slow]
        GUARD = pytest.mark.needs_patch("0009")
        CASES = [pytest.param(1, marks=pytest.mark.needs_patch("0011")), 2]

        def test_module_level():
            pass

        @pytest.mark.extended
        @pytest.mark.needs_patch("0001", "0002", no_avx512_pass=True)
        def test_own_marks():
            pass

        @pytest.mark.extended
        class TestGroup:
            @GUARD
            def test_in_class(self):
                pass

        @pytest.mark.parametrize("case", CASES)
        def test_params(case):
            pass
        """,
    )
    assert got.numbers == {"0001", "0002", "0007", "0009", "0011"}
    assert got.extended == {"0001", "0002", "0007", "0009"}
    assert got.no_avx512_pass == {"0001", "0002"}


def test_a_number_that_is_not_a_literal_is_refused(tmp_path):
    with pytest.raises(ValueError, match="string literals"):
        _read(
            tmp_path,
            """
            import pytest
            N = "0001"

            @pytest.mark.needs_patch(N)
            def test_x():
                pass
            """,
        )


def test_the_index_agrees_with_the_collected_marks(request):
    """Every guard this session selected is where the index says, and an
    extended one counts as extended (tests/gpu is proven on GPUs only)."""
    files = {Path(f.path).resolve(): f for f in patch_guards.guard_index()}
    checked = 0
    for item in request.session.items:
        marks = list(item.iter_markers("needs_patch"))
        path = Path(str(item.path)).resolve()
        if not marks or path.is_relative_to(TESTS / "gpu"):
            continue
        numbers = {n for m in marks for n in m.args}
        indexed = files.get(path)
        assert indexed is not None and numbers <= indexed.numbers, (item.nodeid, numbers, indexed)
        if item.get_closest_marker("extended") is not None:
            assert numbers <= indexed.extended, (item.nodeid, numbers, indexed.extended)
        if any(m.kwargs.get("no_avx512_pass") for m in marks):
            assert numbers <= indexed.no_avx512_pass, (item.nodeid, numbers, indexed.no_avx512_pass)
        checked += 1
    if not checked:
        pytest.skip("this session selected no guard (run it with the suite)")
