"""A throw-away copy of the fork's build, pointed at small synthetic base wheels.

Each test gets a repository with this checkout's build code (forkbuild/,
tools/, pyproject.toml) and the same pinned filenames, but bases
made here in a few kilobytes, so no test downloads the real 100-250 MB wheels.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from forkbuild import config as fork_config

BASE_FILES = {
    "vllm/__init__.py": b'"""vLLM."""\nfrom ._version import __version__\n',
    "vllm/_version.py": b"__version__ = version = '0.21.0'\n",
    "vllm/model_executor/models/qwen3_dflash.py": b"".join(b"line %d\n" % i for i in range(1, 41)),
    "vllm/v1/spec_decode/llm_base_proposer.py": b"import numpy as np\n\narange = np.arange(8)\n",
    "vllm/_C.abi3.so": bytes(range(256)) * 64,
}


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def make_base_wheel(path: Path, target: fork_config.Target, files: dict[str, bytes] | None = None) -> Path:
    files = dict(BASE_FILES if files is None else files)
    dist_info = f"{target.dist.replace('-', '_')}-{target.version}.dist-info"
    requires = "".join(
        f'Requires-Dist: {old}; platform_machine == "x86_64"\n' for old, _ in target.requires_dist_rewrite
    )
    files[f"{dist_info}/METADATA"] = (
        f"Metadata-Version: 2.4\nName: {target.dist}\nVersion: {target.version}\n"
        "Summary: A third party's rebuild\nAuthor-email: Someone Else <someone@example.com>\n"
        "Project-URL: Bug Tracker, https://example.com/rebuild/issues\n"
        f"Requires-Python: >=3.9\nRequires-Dist: numpy\n{requires}\nThe description.\n"
    ).encode()
    files[f"{dist_info}/WHEEL"] = b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp312-cp312-linux_x86_64\n"
    files[f"{dist_info}/entry_points.txt"] = b"[console_scripts]\nvllm = vllm.entrypoints.cli.main:main\n"
    record = "".join(_record_line(n, d) for n, d in files.items()) + f"{dist_info}/RECORD,,\n"
    files[f"{dist_info}/RECORD"] = record.encode()
    wheel = path / target.filename if path.is_dir() else path
    wheel.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(zipfile.ZipInfo(name, (2026, 5, 15, 9, 8, 0)), data)
    return wheel


class ForkRepo:
    def __init__(self, root: Path, bases: Path):
        self.root = root
        self.bases = bases

    def config(self) -> fork_config.ForkConfig:
        return fork_config.load(self.root)

    def pin(self, target: str, wheel: Path) -> None:
        """Rewrite the pinned sha256 of `target` to that of `wheel`."""
        cfg = self.config()
        text = (self.root / "pyproject.toml").read_text()
        actual = hashlib.sha256(wheel.read_bytes()).hexdigest()
        (self.root / "pyproject.toml").write_text(text.replace(cfg.targets[target].sha256, actual))

    def write_patch(self, name: str, path: str, old: bytes, new: bytes, fields: str | None = None) -> None:
        """Make a real `git format-patch` file changing `path` from `old` to `new`."""
        work = self.root.parent / f"git-{name}"
        shutil.rmtree(work, ignore_errors=True)
        (work / path).parent.mkdir(parents=True)
        (work / path).write_bytes(old)
        run_tool(self, "--help")  # the tool must at least start in this repo
        env = {
            **os.environ,
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@example.invalid",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@example.invalid",
            "GIT_AUTHOR_DATE": "2026-12-02T00:00:00Z",
            "GIT_COMMITTER_DATE": "2026-12-02T00:00:00Z",
        }
        git = ["git", "-C", str(work)]
        subprocess.run(git + ["init", "-q"], check=True, env=env)
        subprocess.run(git + ["add", "-A"], check=True, env=env)
        subprocess.run(git + ["commit", "-qm", "base"], check=True, env=env)
        (work / path).write_bytes(new)
        fields = fields if fields is not None else "Origin: vendor\nForwarded: no\n"
        subject = name.split("-", 1)[1].replace("-", " ")
        subprocess.run(git + ["commit", "-qam", f"{subject}\n\nWhy it is needed.\n\n{fields}"], check=True, env=env)
        out = subprocess.run(
            git + ["format-patch", "--zero-commit", "--no-signature", "--full-index", "--stdout", "HEAD~1"],
            check=True,
            capture_output=True,
            env=env,
        ).stdout
        (self.root / "patches" / f"{name}.patch").write_bytes(out)
        series = self.root / "patches" / "series"
        series.write_text(series.read_text() + f"{name}.patch\n")


def run_tool(repo: ForkRepo, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(repo.root / "tools" / "fork.py"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


# A PEP 517 frontend's view of the repo: pyproject-hooks (what pip and build
# use) reads [build-system] and runs the hook in a fresh process.
_CALL_HOOK = """
import sys
try:
    import tomllib
except ImportError:
    import tomli as tomllib
from pyproject_hooks import BuildBackendHookCaller
system = tomllib.load(open("pyproject.toml", "rb"))["build-system"]
caller = BuildBackendHookCaller(".", system["build-backend"], backend_path=system.get("backend-path"))
print(getattr(caller, sys.argv[1])(sys.argv[2]))
"""


def run_backend(repo: ForkRepo, hook: str, out: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """Call a PEP 517 hook of the copied repo through pyproject-hooks, as a frontend does."""
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-c", _CALL_HOOK, hook, str(out)],
        cwd=repo.root,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
