"""Strict application of `git format-patch` files to in-memory file contents.

The base is pinned by sha256, so every patch must meet exactly the file it was
written against: the pre-image blob id on its `index` line is checked, hunks
apply at their stated line numbers with no fuzz and no search, and the result
must have the post-image blob id. Anything else is a drifted base and stops
the build.

A build that leaves patches out (to prove that tests need them) applies the
whole series as written, with every blob check, and carries the patches it
keeps onto a second copy of each file that lacks the left-out changes. Where a
kept patch lands is computed from where the left-out patches changed lines,
never searched for; a kept hunk that touches lines a left-out patch changed
depends on that patch, which its `Depends-On:` field must declare (the build
then leaves the dependent out too, and says so in the version).

Reports about another vLLM release (the maintainer's `check --against`)
apply patches by other rules; that code lives with the maintainer tool
(tools/fork_maintainer/other_release.py), not in the build.
"""

from __future__ import annotations

import dataclasses
import email.parser
import email.policy
import hashlib
import re
from pathlib import Path

DEP3_FIELDS = (
    "Origin",
    "Bug",
    "Forwarded",
    "Applied-Upstream",
    "Last-Update",
    "Author",
    "Reviewed-by",
    # Not DEP-3: the patches (by number) this one is written on top of and
    # cannot go without; a build that leaves one of them out leaves it out too.
    "Depends-On",
)

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(Exception):
    """A patch does not apply; the message names patch, file and hunk."""


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclasses.dataclass
class Hunk:
    header: str
    old_start: int
    old_lines: list[bytes]  # lines with their b"\n" (absent at a missing EOL)
    new_lines: list[bytes]
    added_runs: list[list[bytes]] = dataclasses.field(default_factory=list)
    # (tag, line) in diff order: b" " context, b"-" removed, b"+" added.
    ops: list[tuple[bytes, bytes]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class FileDiff:
    path: str
    old_blob: str
    new_blob: str
    hunks: list[Hunk]
    is_new: bool = False


@dataclasses.dataclass
class Patch:
    name: str
    raw: bytes
    subject: str
    description: str
    fields: dict[str, str]
    files: list[FileDiff]

    @property
    def number(self) -> str:
        return self.name.split("-", 1)[0]

    @property
    def depends_on(self) -> tuple[str, ...]:
        return tuple(self.fields.get("Depends-On", "").replace(",", " ").split())

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()


def parse_patch(name: str, raw: bytes) -> Patch:
    head, sep, diff = raw.partition(b"\ndiff --git ")
    if not sep:
        raise PatchError(f"{name}: no 'diff --git' section; is it a git format-patch file?")
    message = email.parser.BytesParser(policy=email.policy.compat32).parsebytes(head.split(b"\n---\n", 1)[0] + b"\n")
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", " ".join(str(message["Subject"] or "").split()))
    body = message.get_payload(decode=True) or b""
    description_lines, fields = [], {}
    for line in body.decode("utf-8").splitlines():
        key, colon, value = line.partition(":")
        if colon and key in DEP3_FIELDS:
            fields[key] = value.strip()
        else:
            description_lines.append(line)
    if not subject:
        raise PatchError(f"{name}: missing Subject header")
    if "Origin" not in fields:
        raise PatchError(f"{name}: missing DEP-3 'Origin:' field in the commit message")
    files = _parse_diff(name, b"diff --git " + diff)
    return Patch(name, raw, subject, "\n".join(description_lines).strip(), fields, files)


def _parse_diff(name: str, diff: bytes) -> list[FileDiff]:
    lines = diff.splitlines(keepends=True)
    files: list[FileDiff] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith(b"diff --git "):
            i += 1
            continue
        path = line.decode().split(" b/", 1)[1].strip()
        i += 1
        old_blob = new_blob = ""
        is_new = False
        while i < len(lines) and not lines[i].startswith((b"@@", b"diff --git ")):
            meta = lines[i].decode()
            if meta.startswith(("deleted file mode", "rename ", "copy ")):
                raise PatchError(f"{name}: {path}: patches may change and add files, not delete, rename or copy them")
            if meta.startswith("new file mode"):
                is_new = True
            if meta.startswith("GIT binary patch"):
                raise PatchError(f"{name}: {path}: binary patches are not supported")
            if meta.startswith("index "):
                old_blob, new_blob = meta.split()[1].split("..")
            i += 1
        hunks: list[Hunk] = []
        while i < len(lines) and lines[i].startswith(b"@@"):
            header = lines[i].decode().rstrip("\n")
            match = _HUNK_RE.match(header)
            if not match:
                raise PatchError(f"{name}: {path}: malformed hunk header {header!r}")
            old_count = int(match.group(2) or "1")
            new_count = int(match.group(4) or "1")
            old, new, runs, ops, previous = [], [], [], [], b""
            i += 1
            while i < len(lines) and (len(old) < old_count or len(new) < new_count):
                body, tag = lines[i][1:], lines[i][:1]
                i += 1
                if tag == b"\\":
                    continue
                if i < len(lines) and lines[i].startswith(b"\\"):
                    body = body.rstrip(b"\n")  # "\ No newline at end of file"
                if tag in (b" ", b"\n"):
                    old.append(body or b"\n")
                    new.append(body or b"\n")
                    ops.append((b" ", body or b"\n"))
                elif tag == b"-":
                    old.append(body)
                    ops.append((tag, body))
                elif tag == b"+":
                    new.append(body)
                    ops.append((tag, body))
                    if previous != b"+":
                        runs.append([])
                    runs[-1].append(body)
                else:
                    raise PatchError(f"{name}: {path}: {header}: unexpected line {lines[i - 1]!r}")
                previous = tag
            if i < len(lines) and lines[i].startswith(b"\\"):
                i += 1
            hunks.append(Hunk(header, int(match.group(1)), old, new, runs, ops))
        if not old_blob:
            raise PatchError(f"{name}: {path}: no 'index' line (export with --full-index)")
        files.append(FileDiff(path, old_blob, new_blob, hunks, is_new))
    return files


def blob_matches(expected: str, data: bytes) -> bool:
    return git_blob_id(data).startswith(expected)


def hunk_start(hunk: Hunk) -> int:
    """0-based index of the hunk's first old line (insertion point when it has none)."""
    return max(hunk.old_start - 1, 0) if hunk.old_lines else hunk.old_start


def _check_hunk(patch: Patch, fd: FileDiff, lines: list[bytes], hunk: Hunk, pos: int) -> None:
    if lines[pos : pos + len(hunk.old_lines)] != hunk.old_lines:
        raise PatchError(
            f"patch {patch.name} does not apply: file {fd.path}, hunk '{hunk.header}': "
            "the base's lines differ from the patch's context at that exact position"
        )


def splice(lines: list[bytes], fd: FileDiff, starts: list[int]) -> list[bytes]:
    out: list[bytes] = []
    cursor = 0
    for hunk, pos in zip(fd.hunks, starts):
        out.extend(lines[cursor:pos])
        out.extend(hunk.new_lines)
        cursor = pos + len(hunk.old_lines)
    out.extend(lines[cursor:])
    return out


def apply_file(patch: Patch, fd: FileDiff, current: bytes | None) -> bytes:
    """The strict application of one file's hunks, blob ids checked."""
    if fd.is_new:
        if current is not None:
            raise PatchError(f"patch {patch.name} adds {fd.path}, which already exists")
        current = b""
    elif current is None:
        raise PatchError(f"patch {patch.name}: file {fd.path} is not in the base")
    if not fd.is_new and not blob_matches(fd.old_blob, current):
        detail = ""
        lines = current.splitlines(keepends=True)
        try:
            for hunk in fd.hunks:
                _check_hunk(patch, fd, lines, hunk, hunk_start(hunk))
        except PatchError as exc:
            detail = f"; first failing hunk: {exc}"
        raise PatchError(
            f"patch {patch.name} does not apply: file {fd.path} has blob "
            f"{git_blob_id(current)[:12]}, the patch was written against "
            f"{fd.old_blob[:12]} (drifted base or patches out of order){detail}"
        )
    lines = current.splitlines(keepends=True)
    starts = [hunk_start(hunk) for hunk in fd.hunks]
    for hunk, pos in zip(fd.hunks, starts):
        _check_hunk(patch, fd, lines, hunk, pos)
    result = b"".join(splice(lines, fd, starts))
    if not blob_matches(fd.new_blob, result):
        raise PatchError(
            f"patch {patch.name}: file {fd.path}: result has blob "
            f"{git_blob_id(result)[:12]}, expected {fd.new_blob[:12]} (corrupt patch file)"
        )
    return result


def apply_patch(patch: Patch, files: dict[str, bytes]) -> dict[str, bytes]:
    """The files `patch` changes or adds, strictly applied to `files`
    (package-relative paths to bytes)."""
    return {fd.path: apply_file(patch, fd, files.get(fd.path)) for fd in patch.files}


@dataclasses.dataclass
class _TwoCopies:
    """One file as the whole series leaves it so far (`full`) and as the
    build that leaves patches out does (`kept`, None while absent there);
    `where[i]` is the index in `kept` of line i of `full`, None for a line
    only left-out patches put there."""

    full: list[bytes] | None
    kept: list[bytes] | None
    where: list[int | None]

    @classmethod
    def of(cls, data: bytes | None) -> _TwoCopies:
        lines = None if data is None else data.splitlines(keepends=True)
        return cls(lines, None if lines is None else list(lines), list(range(len(lines or []))))


def _carry(patch: Patch, fd: FileDiff, copies: _TwoCopies, keep: bool, left_out: list[str]) -> None:
    full_before = b"".join(copies.full) if copies.full is not None else None
    full_after = apply_file(patch, fd, full_before).splitlines(keepends=True)
    starts = [hunk_start(hunk) for hunk in fd.hunks]
    kept_starts: list[int] = []
    if keep:
        if copies.kept is None:
            if not fd.is_new:
                raise _dependency(patch, fd, fd.hunks[0], left_out, "adds")
            copies.kept = []
        for hunk, pos in zip(fd.hunks, starts):
            mapped = copies.where[pos : pos + len(hunk.old_lines)]
            if hunk.old_lines:
                first = mapped[0]
                if None in mapped or mapped != list(range(first, first + len(mapped))):
                    raise _dependency(patch, fd, hunk, left_out, "changed")
            else:
                before = copies.where[pos - 1] if pos else -1
                if before is None:
                    raise _dependency(patch, fd, hunk, left_out, "added")
                first = before + 1
            _check_hunk(patch, fd, copies.kept, hunk, first)
            kept_starts.append(first)
    # The new line map: outside hunks, lines keep their place (shifted by
    # what kept hunks before them added or removed); inside a hunk, a kept
    # patch's new lines are in `kept` too, a left-out patch's context lines
    # keep their old place and its added lines are in `full` only.
    where: list[int | None] = []
    cursor = 0
    shift = 0
    for index, (hunk, pos) in enumerate(zip(fd.hunks, starts)):
        where.extend(w if w is None else w + shift for w in copies.where[cursor:pos])
        if keep:
            new_first = kept_starts[index] + shift
            where.extend(range(new_first, new_first + len(hunk.new_lines)))
            shift += len(hunk.new_lines) - len(hunk.old_lines)
        else:
            old = pos
            for tag, _ in hunk.ops:
                if tag == b" ":
                    where.append(copies.where[old])
                    old += 1
                elif tag == b"-":
                    old += 1
                else:
                    where.append(None)
        cursor = pos + len(hunk.old_lines)
    where.extend(w if w is None else w + shift for w in copies.where[cursor:])
    if keep:
        copies.kept = splice(copies.kept, fd, kept_starts)
    copies.full, copies.where = full_after, where


def _dependency(patch: Patch, fd: FileDiff, hunk: Hunk, left_out: list[str], verb: str) -> PatchError:
    return PatchError(
        f"patch {patch.name}: file {fd.path}, hunk '{hunk.header}' touches lines that "
        f"{', '.join(left_out)} {verb}, which this build leaves out; if the patch needs "
        f"{'them' if len(left_out) > 1 else 'it'}, declare that with a 'Depends-On: "
        f"{' '.join(left_out)}' line in its commit message (a build without "
        f"{left_out[0]} then leaves it out too)"
    )


def left_out_patches(patches: list[Patch], skipped: tuple[str, ...]) -> tuple[str, ...]:
    """`skipped` and every patch whose Depends-On names one of them, transitively."""
    numbers = {p.number for p in patches}
    unknown = sorted(set(skipped) - numbers)
    if unknown:
        raise PatchError(f"cannot leave out unknown patches {unknown}; the series has {sorted(numbers)}")
    out = set(skipped)
    for patch in patches:  # in series order, so dependencies come first
        if out & set(patch.depends_on):
            out.add(patch.number)
    return tuple(sorted(out))


def apply_series(patches: list[Patch], files: dict[str, bytes], left_out: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every file the kept patches change or add, as they leave it.

    `files` holds the base's files; `left_out` must already include the
    dependents (see left_out_patches). With nothing left out this is plain
    strict application in order.
    """
    copies: dict[str, _TwoCopies] = {}
    applied: list[str] = []
    for patch in patches:
        keep = patch.number not in left_out
        for fd in patch.files:
            if fd.path not in copies:
                copies[fd.path] = _TwoCopies.of(files.get(fd.path))
            earlier = [n for n in left_out if n in applied]
            _carry(patch, fd, copies[fd.path], keep, earlier)
        applied.append(patch.number)
    return {path: b"".join(c.kept) for path, c in copies.items() if c.kept is not None}


def read_series(patches_dir: Path) -> list[Patch]:
    series_file = patches_dir / "series"
    if not series_file.is_file():
        raise PatchError(f"{series_file} is missing: it lists the patch files in order")
    names = [line.strip() for line in series_file.read_text().splitlines() if line.strip() and not line.startswith("#")]
    listed = set(names)
    unlisted = sorted(p.name for p in patches_dir.glob("*.patch") if p.name not in listed)
    if unlisted:
        raise PatchError(f"{series_file}: patch files not listed in the series: {unlisted}")
    patches = []
    for name in names:
        path = patches_dir / name
        if not path.is_file():
            raise PatchError(f"{series_file} lists {name}, which does not exist")
        patches.append(parse_patch(name, path.read_bytes()))
    numbers = [p.number for p in patches]
    if len(set(numbers)) != len(numbers):
        raise PatchError(f"{series_file}: patch numbers repeat: {numbers}")
    return patches
