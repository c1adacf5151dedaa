"""Which tests guard which patch, read from the test files' source.

A guard is a test marked ``needs_patch("NNNN", ...)``: on the function, its
class, the module's ``pytestmark``, or a ``pytest.param`` of it. The index is
read with ``ast``, not by collecting the suite: a necessity proof of one
patch (one CI job each) learns its guards' files without importing every
test module, and the plugins that choose which proofs join a pass (the
extended job, the pass as on a CPU without AVX-512) read it the same way
whatever the run collected. A guard's numbers must therefore be string
literals; the suite checks that the index agrees with the marks pytest
collects (tests/necessity/test_patch_guard_index.py).

``needs_patch(..., no_avx512_pass=True)``: the patch's necessity proof also
runs as on a CPU without AVX-512/AMX (the guard takes the fp8 KV path that
such CPUs run through the torch code).
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

from repo_paths import TESTS


@dataclass(frozen=True)
class GuardFile:
    path: Path
    numbers: frozenset[str]  # every needs_patch(...) in the file
    extended: frozenset[str]  # the numbers of its guards marked `extended`
    no_avx512_pass: frozenset[str]  # the numbers of needs_patch(..., no_avx512_pass=True)


def _mark_name(node: ast.AST) -> str | None:
    target = node.func if isinstance(node, ast.Call) else node
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute) and target.value.attr == "mark":
        return target.attr
    return None


def _needs_patch_calls(node: ast.AST, aliases: dict[str, ast.AST]) -> list[ast.Call]:
    """needs_patch(...) calls within ``node``, module-level names resolved
    (``GUARD = pytest.mark.needs_patch(...)`` used as ``@GUARD``)."""
    calls = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and _mark_name(sub) == "needs_patch":
            calls.append(sub)
        elif isinstance(sub, ast.Name) and sub.id in aliases:
            calls += _needs_patch_calls(aliases[sub.id], {})
    return calls


def _has_mark(nodes: list[ast.AST], name: str, aliases: dict[str, ast.AST]) -> bool:
    for node in nodes:
        node = aliases.get(node.id, node) if isinstance(node, ast.Name) else node
        elts = node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node]
        if any(_mark_name(e) == name for e in elts):
            return True
    return False


def _numbers(call: ast.Call, where: str) -> list[str]:
    for arg in call.args:
        if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
            raise ValueError(f"{where}: needs_patch takes the patch numbers as string literals")
    return [arg.value for arg in call.args]


def read_guard_file(path: Path) -> GuardFile:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    aliases = {
        t.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    numbers, no_avx512 = set(), set()
    for call in _needs_patch_calls(tree, {}):
        found = _numbers(call, str(path))
        numbers.update(found)
        if any(
            kw.arg == "no_avx512_pass" and isinstance(kw.value, ast.Constant) and kw.value.value for kw in call.keywords
        ):
            no_avx512.update(found)

    module_marks = [aliases["pytestmark"]] if "pytestmark" in aliases else []
    extended: set[str] = set()

    def visit(body, inherited: list[ast.AST]):
        for node in body:
            if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                visit(node.body, inherited + node.decorator_list)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                marks = inherited + node.decorator_list
                if _has_mark(marks, "extended", aliases):
                    for call in (c for m in marks for c in _needs_patch_calls(m, aliases)):
                        extended.update(_numbers(call, f"{path}::{node.name}"))

    visit(tree.body, module_marks)
    return GuardFile(path, frozenset(numbers), frozenset(extended), frozenset(no_avx512))


@functools.cache
def guard_index(tests: Path = TESTS) -> tuple[GuardFile, ...]:
    """The guard files of the CPU suite. tests/gpu is left out: it builds
    some marks at run time, and its guards are proven on a GPU
    (``pytest tests/gpu --needs-patch N`` against a CUDA build without N)."""
    paths = sorted(p for p in tests.rglob("test_*.py") if not p.is_relative_to(tests / "gpu"))
    files = (read_guard_file(path) for path in paths)
    return tuple(f for f in files if f.numbers)


def guard_files(number: str) -> list[str]:
    """The files with a test marked needs_patch(number)."""
    return [str(f.path) for f in guard_index() if number in f.numbers]


def has_extended_guards(number: str) -> bool:
    return any(number in f.extended for f in guard_index())


def proven_without_avx512(number: str) -> bool:
    return any(number in f.no_avx512_pass for f in guard_index())
