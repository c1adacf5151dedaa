"""Where each patch stands against another vLLM release: applies, already in upstream, or conflicts.

Applying uses the build's applier (forkbuild.patching): strictly to the very
file a patch was written against, and to another release's file only where
each hunk's whole context stands at exactly one place ("applies with
offsets"); nothing is fuzzed or guessed. Whether a change is
already upstream is a search, not an application: its hunks reverse-apply
somewhere in the file, each run of its added lines is there verbatim, or,
for Python, the statements it changes are there (see samecode).
"""

from __future__ import annotations

import dataclasses

from forkbuild import patching

from . import other_release, samecode


def _hunks_present(fd: patching.FileDiff, content: bytes) -> bool:
    lines = content.splitlines(keepends=True)
    stripped = [line.rstrip() for line in content.splitlines()]
    for hunk in fd.hunks:
        # The hunk's post-image (context and added lines) is there.
        if not hunk.new_lines or other_release.places_of(hunk.new_lines, lines):
            continue
        if not hunk.added_runs or not all(
            other_release.places_of([line.rstrip() for line in run], stripped) for run in hunk.added_runs
        ):
            return False
    return True


def is_already_applied(patch: patching.Patch, files: dict[str, bytes], base: dict[str, bytes] | None = None) -> bool:
    """True when every hunk's change is already in `files`.

    A hunk counts as present when its post-image is there (context
    included), or, since upstream often lands the same change amid other
    edits, when each run of its added lines appears verbatim (ignoring
    trailing whitespace). A Python file whose hunks are not found so also
    counts as changed upstream when the statements the patch changes in it
    are there: that needs `base`, the files the patch applies to.
    """
    after = None
    for fd in patch.files:
        if fd.path not in files:
            return False
        if _hunks_present(fd, files[fd.path]):
            continue
        if base is None or fd.path not in base or not fd.path.endswith(".py"):
            return False
        if after is None:
            try:
                after = {**base, **patching.apply_patch(patch, base)}
            except patching.PatchError:
                return False
        if not samecode.python_change_present(base[fd.path], after[fd.path], files[fd.path]):
            return False
    return True


@dataclasses.dataclass(frozen=True)
class PatchStatus:
    name: str
    status: str

    @property
    def conflicts(self) -> bool:
        return self.status.startswith("conflicts")


def check_series(
    patches: list[patching.Patch], files: dict[str, bytes], base: dict[str, bytes] | None = None
) -> list[PatchStatus]:
    """Status of each patch against `files`, applying the ones that apply.

    `base` (the pinned base's files) lets a restyled upstream version of a
    patch's Python change count as already in upstream.
    """
    report = []
    files = dict(files)
    base = dict(base) if base is not None else None
    for patch in patches:
        if is_already_applied(patch, files, base):
            report.append(PatchStatus(patch.name, "already in upstream"))
        else:
            try:
                changed, moved = other_release.apply_patch_to_other_release(patch, files)
                files.update(changed)
                report.append(PatchStatus(patch.name, "applies with offsets" if moved else "applies"))
            except patching.PatchError as exc:
                report.append(PatchStatus(patch.name, f"conflicts: {exc}"))
        if base is not None:
            try:
                base.update(patching.apply_patch(patch, base))
            except patching.PatchError:
                base = None
    return report
