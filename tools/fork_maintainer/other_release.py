"""Applying a patch to another vLLM release than the one it was written against.

For the maintainer's reports only (`check --against`); builds never take
this path. A file with the blob the patch was written against is applied
strictly, as a build does. In another file a hunk may stand elsewhere, but
only where its whole context stands at exactly one place: no fuzz, no
nearest-match guess.
"""

from __future__ import annotations

from forkbuild import patching


def places_of(run: list[bytes], lines: list[bytes]) -> list[int]:
    """Every index at which `run` stands in `lines`, line for line."""
    size = len(run)
    return [i for i in range(len(lines) - size + 1) if lines[i : i + size] == run]


def _unique_places(patch: patching.Patch, fd: patching.FileDiff, lines: list[bytes]) -> list[int]:
    """Where each hunk's old lines stand in `lines`, when each stands at exactly one place, in order."""
    starts: list[int] = []
    lowest = 0
    for hunk in fd.hunks:
        size = len(hunk.old_lines)
        places = places_of(hunk.old_lines, lines) if size else []
        if len(places) != 1 or places[0] < lowest:
            where = (
                "nowhere"
                if not places
                else f"at {len(places)} places"
                if len(places) > 1
                else "only before an earlier hunk"
            )
            raise patching.PatchError(
                f"patch {patch.name} does not apply: file {fd.path}, hunk '{hunk.header}': "
                f"its context stands {where} in this file"
            )
        starts.append(places[0])
        lowest = places[0] + size
    return starts


def apply_patch_to_other_release(patch: patching.Patch, files: dict[str, bytes]) -> tuple[dict[str, bytes], bool]:
    """`patch` applied to another release's `files`, for reports only; True when a hunk moved.

    A file with the blob the patch was written against is applied strictly. In
    another file a hunk may stand elsewhere, but only where its whole context
    stands at exactly one place (no fuzz, no nearest-match guess); builds never
    take this path.
    """
    out: dict[str, bytes] = {}
    moved = False
    for fd in patch.files:
        current = files.get(fd.path)
        if fd.is_new or current is None or patching.blob_matches(fd.old_blob, current):
            out[fd.path] = patching.apply_file(patch, fd, current)
            continue
        lines = current.splitlines(keepends=True)
        starts = _unique_places(patch, fd, lines)
        moved = moved or starts != [patching.hunk_start(hunk) for hunk in fd.hunks]
        out[fd.path] = b"".join(patching.splice(lines, fd, starts))
    return out, moved
