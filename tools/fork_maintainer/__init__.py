"""Maintainer tooling for the patch series (`python tools/fork.py ...`).

Apart from the build backend (forkbuild/), which needs none of this: the
work tree round trip, the report against other vLLM releases, the release
lock, the README's patch table and the wheel comparison.
"""
