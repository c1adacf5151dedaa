"""unpacked_builds: a build unpacked next to another shares its unchanged files."""

from __future__ import annotations

import os
import zipfile

import unpacked_builds


def _wheel(path, files: dict[str, str]):
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return path


def test_shared_files_are_links_and_changed_files_are_new(tmp_path):
    full = _wheel(tmp_path / "full.whl", {"pkg/a.py": "A = 1\n", "pkg/b.py": "B = 1\n", "pkg/lib.so": "bin"})
    other = _wheel(tmp_path / "other.whl", {"pkg/a.py": "A = 1\n", "pkg/b.py": "B = 2\n", "pkg/lib.so": "bin"})
    tree = unpacked_builds.unpack_compiled(full, tmp_path / "full")
    got = unpacked_builds.unpack_next_to(other, full, tree, tmp_path / "other")

    for name in ("pkg/a.py", "pkg/lib.so"):
        assert os.path.samefile(got / name, tree / name)
    assert not os.path.samefile(got / "pkg/b.py", tree / "pkg/b.py")
    assert (got / "pkg/b.py").read_text() == "B = 2\n"
    assert (tree / "pkg/b.py").read_text() == "B = 1\n"  # the full tree is untouched
    compiled = {p.name.split(".")[0] for p in (got / "pkg" / "__pycache__").iterdir()}
    assert compiled == {"a", "b"}
    assert not os.path.samefile(
        next((got / "pkg" / "__pycache__").glob("b.*.pyc")), next((tree / "pkg" / "__pycache__").glob("b.*.pyc"))
    )


def test_a_non_python_file_beside_a_module_of_its_name_links_no_compiled_file(tmp_path):
    """A module's C source (``kernel.c`` beside ``kernel.py``) shares the
    module's stem: its compiled file is linked once, for the module."""
    files = {"pkg/kernel.py": "K = 1\n", "pkg/kernel.c": "int k;\n"}
    full = _wheel(tmp_path / "full.whl", files)
    other = _wheel(tmp_path / "other.whl", files)
    tree = unpacked_builds.unpack_compiled(full, tmp_path / "full")
    got = unpacked_builds.unpack_next_to(other, full, tree, tmp_path / "other")
    assert [p.name.split(".")[0] for p in (got / "pkg" / "__pycache__").iterdir()] == ["kernel"]
    assert (got / "pkg" / "kernel.c").read_text() == "int k;\n"
