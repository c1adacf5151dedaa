"""Is a change to a Python file in another version of it, however restyled?

A backport is written anew, so upstream's code for the same fix usually
differs in comments, line breaks, redundant parentheses or the names of
comprehension variables, and sits amid other edits. Comparing statements
instead of lines sees through that: each file is reduced to a multiset of
statements, where a statement is its syntax tree (comments and layout gone,
names bound by comprehensions and lambdas numbered in order of binding;
compound statements contribute their header only) keyed by where it is: the
chain of enclosing blocks, functions and classes by name, ``if``/``for``/
``with``... by their headers.

The change ``old -> new`` is in ``upstream`` when every statement it adds is
there at least as often as in ``new``, and every statement it removes is
there no more often than in ``new``.
"""

from __future__ import annotations

import ast
import copy
from collections import Counter

__all__ = ["python_change_present"]

_BLOCK_FIELDS = ("body", "orelse", "finalbody", "handlers", "cases")
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


class _NumberBoundNames(ast.NodeTransformer):
    """Rename names bound by comprehensions and lambdas to their binding order."""

    def __init__(self) -> None:
        self.count = 0
        self.names: list[dict[str, str]] = []

    def _bind(self, node: ast.AST, bound: list[str]) -> ast.AST:
        mapping = {}
        for name in bound:
            if name not in mapping:
                mapping[name] = f"_bound{self.count}"
                self.count += 1
        self.names.append(mapping)
        self.generic_visit(node)
        self.names.pop()
        return node

    def _comprehension(self, node):
        bound = [n.id for gen in node.generators for n in ast.walk(gen.target) if isinstance(n, ast.Name)]
        return self._bind(node, bound)

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comprehension

    def visit_Lambda(self, node):
        args = node.args
        every = args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]
        return self._bind(node, [a.arg for a in every if a is not None])

    def visit_Name(self, node):
        for mapping in reversed(self.names):
            if node.id in mapping:
                return ast.copy_location(ast.Name(mapping[node.id], node.ctx), node)
        return node

    def visit_arg(self, node):
        for mapping in reversed(self.names):
            if node.arg in mapping:
                node.arg = mapping[node.arg]
                break
        return node


def _header(node: ast.AST) -> str:
    """The statement without the blocks it contains, normalised."""
    head = copy.copy(node)
    for field in _BLOCK_FIELDS:
        if isinstance(getattr(head, field, None), list):
            setattr(head, field, [])
    head = _NumberBoundNames().visit(copy.deepcopy(head))
    return ast.dump(head, include_attributes=False)


def _statements(source: bytes) -> Counter | None:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    counts: Counter = Counter()

    def visit(node: ast.AST, label: str, path: tuple) -> None:
        for field in _BLOCK_FIELDS:
            children = getattr(node, field, None)
            if not isinstance(children, list):
                continue
            where = path + ((label, field),)
            for child in children:
                header = _header(child)
                counts[(where, header)] += 1
                scope = isinstance(child, _SCOPES)
                visit(child, f"{type(child).__name__} {child.name}" if scope else header, where)

    visit(tree, "module", ())
    return counts


def python_change_present(old: bytes, new: bytes, upstream: bytes) -> bool | None:
    """Whether the statements ``old -> new`` changes are in ``upstream``.

    None when that cannot be told: a file does not parse, or the change
    leaves the statements alone (comments, layout).
    """
    before, after, there = _statements(old), _statements(new), _statements(upstream)
    if before is None or after is None or there is None:
        return None
    added, removed = after - before, before - after
    if not added and not removed:
        return None
    return all(there[s] >= after[s] for s in added) and all(there[s] <= after[s] for s in removed)
