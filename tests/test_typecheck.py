"""design.md §3.4's type check: mypy over the packages whose contracts cross threads, processes and the wire
(engine/, api/, sampling/, parallel/), configured in pyproject.toml's [tool.mypy]. A typing hole there is a
bug waiting for its input (a None read as a value, bytes joined to text: the check found both kinds), so the
suite fails on any error. Imports outside those packages are followed for their types but not reported.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_typed_packages_have_no_mypy_errors():
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "--hide-error-context"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, f"mypy found errors (rc {run.returncode}):\n{run.stdout}{run.stderr}"
