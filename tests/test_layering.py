"""The package boundaries of design.md §3.2, checked by parsing imports (no import is executed).

- api/ never imports torch (HTTP only) and reaches the engine through engine.client / engine.outputs.
- engine/ imports nothing from runner/ or models/ (CPU-side request lifecycle).
- media/ never touches torch.cuda; models/ reaches parallel/ only through models/layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "worldserve"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _files(sub: str):
    return sorted((PKG / sub).rglob("*.py"))


RULES = [
    ("api", ("torch",), "api/ is HTTP only: no torch"),
    ("engine", ("torch", "worldserve.runner", "worldserve.models"), "engine/ is CPU-side logic"),
    ("media", ("torch.cuda",), "media/ runs in a CPU pool"),
    ("sampling", ("worldserve.models", "worldserve.runner", "worldserve.api"), "sampling/ is pure maths"),
]


@pytest.mark.parametrize(("folder", "banned", "why"), RULES)
def test_import_boundaries(folder, banned, why):
    offenders = []
    for path in _files(folder):
        for name in _imports(path):
            if any(name == b or name.startswith(b + ".") for b in banned):
                offenders.append(f"{path.relative_to(PKG)} imports {name}")
    assert not offenders, f"{why}: " + "; ".join(offenders)


def test_api_reaches_the_engine_only_through_its_client():
    allowed = ("worldserve.engine.client", "worldserve.engine.outputs")
    offenders = [
        f"{path.relative_to(PKG)} imports {name}"
        for path in _files("api")
        for name in _imports(path)
        if name.startswith("worldserve.engine") and not name.startswith(allowed)
    ]
    assert not offenders, "; ".join(offenders)


def test_media_never_touches_torch_cuda():
    """Neither an import of torch.cuda nor a use of it (`torch.cuda.x` after `import torch`)."""
    offenders = []
    for path in _files("media"):
        tree = ast.parse(path.read_text())
        names = _imports(path)
        offenders += [f"{path.relative_to(PKG)} imports {n}" for n in names if n.startswith("torch.cuda")]
        offenders += [
            f"{path.relative_to(PKG)}:{node.lineno} uses torch.cuda"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr == "cuda"
            and isinstance(node.value, ast.Name) and node.value.id == "torch"
        ]  # fmt: skip
    assert not offenders, "; ".join(offenders)


def test_models_reach_parallel_only_through_layers():
    offenders = []
    for path in _files("models"):
        if "layers" in path.parts:
            continue
        for name in _imports(path):
            if name.startswith("worldserve.parallel.comm"):
                offenders.append(f"{path.relative_to(PKG)} imports {name}")
    assert not offenders, "; ".join(offenders)


def test_only_comm_calls_torch_distributed():
    """Collectives and process groups go through parallel/comm.py (design.md §3.5)."""
    offenders = [
        f"{path.relative_to(PKG)} imports {name}"
        for path in PKG.rglob("*.py")
        if path.relative_to(PKG).as_posix() != "parallel/comm.py"
        for name in _imports(path)
        if name == "torch.distributed" or name.startswith("torch.distributed.")
    ]
    assert not offenders, "; ".join(offenders)


def test_every_module_has_a_docstring():
    missing = [
        str(p.relative_to(PKG))
        for p in PKG.rglob("*.py")
        if ast.get_docstring(ast.parse(p.read_text())) is None
    ]
    assert not missing, "modules without a docstring: " + ", ".join(missing)
