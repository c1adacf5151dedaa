"""Not a setuptools script: the fork builds through its PEP 517 backend.

pyproject.toml names forkbuild.backend, which assembles the `vllm` wheel
from the pinned upstream wheel and the patch series; nothing is compiled.
This file only answers the habit of running `python setup.py ...`.
"""

import sys

if __name__ == "__main__":
    sys.exit(
        "this fork builds with a PEP 517 frontend: `pip install .`, `pip wheel .` or "
        "`python -m build` (VLLM_TARGET_DEVICE=cuda|cpu picks the target; see README.md)"
    )
