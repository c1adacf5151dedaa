"""Strict application of `git format-patch` files to in-memory file contents.

The base is pinned by sha256, so every patch must meet exactly the file it was
written against: the pre-image blob id on its `index` line is checked, hunks
apply at their stated line numbers with no fuzz, and the result must have the
post-image blob id. Anything else is a drifted base and stops the build.
A lenient mode (context search with offsets, no blob check) exists only for
reporting against other vLLM releases and for builds that leave patches out.
"""

from __future__ import annotations

import dataclasses
import email.parser
import email.policy
import hashlib
import re
from pathlib import Path

from forkbuild import samecode

DEP3_FIELDS = (
    "Origin",
    "Bug",
    "Forwarded",
    "Applied-Upstream",
    "Last-Update",
    "Author",
    "Reviewed-by",
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


@dataclasses.dataclass
class FileDiff:
    path: str
    old_blob: str
    new_blob: str
    hunks: list[Hunk]


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
    def sha256(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()


def parse_patch(name: str, raw: bytes) -> Patch:
    head, sep, diff = raw.partition(b"\ndiff --git ")
    if not sep:
        raise PatchError(f"{name}: no 'diff --git' section; is it a git format-patch file?")
    message = email.parser.BytesParser(policy=email.policy.compat32).parsebytes(
        head.split(b"\n---\n", 1)[0] + b"\n"
    )
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
        while i < len(lines) and not lines[i].startswith((b"@@", b"diff --git ")):
            meta = lines[i].decode()
            if meta.startswith(("new file mode", "deleted file mode", "rename ", "copy ")):
                raise PatchError(
                    f"{name}: {path}: patches may only modify existing base files; "
                    "new files belong in the repository's vllm/ overlay"
                )
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
            old, new, runs, previous = [], [], [], b""
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
                elif tag == b"-":
                    old.append(body)
                elif tag == b"+":
                    new.append(body)
                    if previous != b"+":
                        runs.append([])
                    runs[-1].append(body)
                else:
                    raise PatchError(f"{name}: {path}: {header}: unexpected line {lines[i - 1]!r}")
                previous = tag
            if i < len(lines) and lines[i].startswith(b"\\"):
                i += 1
            hunks.append(Hunk(header, int(match.group(1)), old, new, runs))
        if not old_blob:
            raise PatchError(f"{name}: {path}: no 'index' line (export with --full-index)")
        files.append(FileDiff(path, old_blob, new_blob, hunks))
    return files


def _blob_matches(expected: str, data: bytes) -> bool:
    return git_blob_id(data).startswith(expected)


def _apply_hunks(patch: Patch, fd: FileDiff, data: bytes, strict: bool) -> bytes:
    lines = data.splitlines(keepends=True)
    out: list[bytes] = []
    cursor = 0
    for hunk in fd.hunks:
        start = max(hunk.old_start - 1, 0) if hunk.old_lines else hunk.old_start
        candidates = [start] if strict else _search_order(start, cursor, len(lines))
        for pos in candidates:
            if lines[pos : pos + len(hunk.old_lines)] == hunk.old_lines:
                break
        else:
            raise PatchError(
                f"patch {patch.name} does not apply: file {fd.path}, hunk '{hunk.header}': "
                "the base's lines differ from the patch's context"
                + ("" if not strict else " at that exact position")
            )
        out.extend(lines[cursor:pos])
        out.extend(hunk.new_lines)
        cursor = pos + len(hunk.old_lines)
    out.extend(lines[cursor:])
    return b"".join(out)


def _search_order(start: int, lower: int, size: int) -> list[int]:
    order = [start] + [p for d in range(1, size + 1) for p in (start - d, start + d)]
    return [p for p in order if lower <= p <= size]


def apply_patch(patch: Patch, files: dict[str, bytes], strict: bool = True) -> dict[str, bytes]:
    """Return the changed files; `files` maps package-relative paths to bytes."""
    changed: dict[str, bytes] = {}
    for fd in patch.files:
        if fd.path not in files:
            raise PatchError(f"patch {patch.name}: file {fd.path} is not in the base")
        current = files[fd.path]
        if strict and not _blob_matches(fd.old_blob, current):
            detail = ""
            try:
                _apply_hunks(patch, fd, current, strict=True)
            except PatchError as exc:
                detail = f"; first failing hunk: {exc}"
            raise PatchError(
                f"patch {patch.name} does not apply: file {fd.path} has blob "
                f"{git_blob_id(current)[:12]}, the patch was written against "
                f"{fd.old_blob[:12]} (drifted base or patches out of order){detail}"
            )
        result = _apply_hunks(patch, fd, current, strict)
        if strict and not _blob_matches(fd.new_blob, result):
            raise PatchError(
                f"patch {patch.name}: file {fd.path}: result has blob "
                f"{git_blob_id(result)[:12]}, expected {fd.new_blob[:12]} (corrupt patch file)"
            )
        changed[fd.path] = result
    return changed


def is_already_applied(patch: Patch, files: dict[str, bytes], base: dict[str, bytes] | None = None) -> bool:
    """True when every hunk's change is already in `files`.

    A hunk counts as present when it reverse-applies (context included), or,
    since upstream often lands the same change amid other edits, when each run
    of its added lines appears verbatim (ignoring trailing whitespace). A
    Python file whose hunks are not found so also counts as changed upstream
    when the statements the patch changes in it are there (see
    forkbuild.samecode): that needs `base`, the files the patch applies to.
    """
    after = None
    for fd in patch.files:
        if fd.path not in files:
            return False
        if _hunks_present(patch, fd, files[fd.path]):
            continue
        if base is None or fd.path not in base or not fd.path.endswith(".py"):
            return False
        if after is None:
            try:
                after = apply_patch(patch, base)
            except PatchError:
                return False
        if not samecode.python_change_present(base[fd.path], after[fd.path], files[fd.path]):
            return False
    return True


def _hunks_present(patch: Patch, fd: FileDiff, content: bytes) -> bool:
    stripped = [line.rstrip() for line in content.splitlines()]
    for hunk in fd.hunks:
        reverse = Hunk(hunk.header, hunk.old_start, hunk.new_lines, hunk.old_lines)
        single = dataclasses.replace(fd, hunks=[reverse])
        try:
            _apply_hunks(patch, single, content, strict=False)
            continue
        except PatchError:
            pass
        if not hunk.added_runs or not all(
            _contains_run(stripped, [line.rstrip() for line in run]) for run in hunk.added_runs
        ):
            return False
    return True


def _contains_run(lines: list[bytes], run: list[bytes]) -> bool:
    return any(lines[i : i + len(run)] == run for i in range(len(lines) - len(run) + 1))


def read_series(patches_dir: Path) -> list[Patch]:
    series_file = patches_dir / "series"
    if not series_file.is_file():
        raise PatchError(f"{series_file} is missing: it lists the patch files in order")
    names = [
        line.strip()
        for line in series_file.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
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
