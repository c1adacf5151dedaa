"""The README stays true: its patch list is generated from patches/, its version
example is the current release, its `vllm serve` commands parse."""

from __future__ import annotations

import shlex
import sys

import pytest

from forkrepo import REPO

sys.path.insert(0, str(REPO / "tools"))

import fork  # noqa: E402

from forkbuild import config, patching  # noqa: E402
from readme_blocks import bash_commands  # noqa: E402


def test_readme_patch_table_matches_the_series():
    readme = (REPO / "README.md").read_text()
    table = fork.patch_table(patching.read_series(config.load(REPO).patches_dir))
    assert fork.readme_with_table(readme, table) == readme, (
        "README.md's patch table is stale: run `python tools/fork.py patch-table --update-readme`"
    )


def test_readme_shows_the_current_release_as_the_version():
    release = config.load(REPO).release
    readme = (REPO / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("vllm --version"))
    assert f"0.21.0+cpu.dflashfp8.{release} / 0.21.0+dflashfp8.{release}" in line, (
        f"README.md's `vllm --version` example is not release {release}: {line}")


@pytest.mark.installed_fork
def test_readme_vllm_serve_commands_parse_with_vllms_own_parser():
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.fork.tiny_pairs import DFLASH_BLOCK_SIZE
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    serve = [c for c in bash_commands() if " vllm serve " in f" {c} "]
    assert len(serve) >= 2, serve
    for command in serve:
        words = shlex.split(command)
        argv = words[words.index("serve") + 1:]
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        validate_parsed_serve_args(args)
        spec = args.speculative_config
        assert spec["method"] == "dflash" and args.kv_cache_dtype == "fp8", command
        if spec["model"] == "pair/draft":  # the generated pair of `vllm.fork.tiny_pairs`
            assert spec["num_speculative_tokens"] <= DFLASH_BLOCK_SIZE - 1, command
