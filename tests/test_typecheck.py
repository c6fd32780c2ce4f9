"""design.md §3.4's type check: mypy over the whole `worldserve` package, configured in pyproject.toml's
[tool.mypy] (torch, transformers and diffusers are not followed: their names are Any). A typing hole is a bug
waiting for its input (a None read as a value, bytes joined to text, an image part without its pixels: the
check found each kind), so the suite fails on any error. The bench/ scripts beside the package are not checked.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_package_has_no_mypy_errors():
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "--hide-error-context"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, f"mypy found errors (rc {run.returncode}):\n{run.stdout}{run.stderr}"
