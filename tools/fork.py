#!/usr/bin/env python3
"""Maintainer tooling for the patch series: see tools/fork_maintainer/cli.py, or run with --help."""

import sys
from pathlib import Path

# The build's package (forkbuild/) sits at the repository root; this script's
# own directory, tools/, is on sys.path already.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fork_maintainer.cli import main

if __name__ == "__main__":
    main()
