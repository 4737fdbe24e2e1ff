"""The layers run one way: core <- cost_models <- passes <- api / cli; runtime on core only.

``violations(root)`` reads every module of the package (``ast``, nothing is imported) and
lists each import against the order of docs/architecture.md:

    core         imports nothing else of the project
    cost_models  imports core
    passes       imports core; the pricing module (passes/pricing.py) also cost_models
    runtime      imports core
    api / cli    (autopar/*.py) anything

and each import of a project module inside a function, unless a comment on its line says
why it cannot stand at the top. The checker is tested on a small tree with a back edge, so
that a checker that finds nothing cannot pass for a clean tree.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# top-level folder -> the package it installs as (pyproject.toml's package-dir)
PACKAGES = {
    "autopar": "autopar",
    "passes": "autopar.passes",
    "cost_models": "autopar.cost_models",
    "runtime": "autopar.runtime",
}
ALLOWED = {
    "core": {"core"},
    "cost_models": {"core", "cost_models"},
    "passes": {"core", "passes"},
    "runtime": {"core", "runtime"},
    "api": {"core", "cost_models", "passes", "runtime", "api"},
}
COST_MODEL_USERS = {"autopar.passes.pricing"}


def layer(module: str) -> str | None:
    """The layer of a dotted module name; None outside the project."""
    if module != "autopar" and not module.startswith("autopar."):
        return None
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("core", "cost_models", "passes", "runtime"):
        return parts[1]
    return "api"


def _modules(root: Path):
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            yield path, name, path.name == "__init__.py"


def _commented_lines(source: str) -> set[int]:
    """Lines with a comment that is not only a ``noqa``."""
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and not tok.string.lstrip("# ").startswith("noqa"):
            lines.add(tok.start[0])
    return lines


def _targets(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted modules an import statement reaches."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level == 0:
        return [node.module or ""]
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return [".".join(base + ([node.module] if node.module else []))]


def violations(root: Path = ROOT) -> list[str]:
    found = []
    for path, module, is_package in _modules(root):
        source = path.read_text()
        tree = ast.parse(source)
        commented = _commented_lines(source)
        own = layer(module)
        in_function: set[int] = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(fn):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        in_function.add(id(inner))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            where = f"{path.relative_to(root)}:{node.lineno}"
            for target in _targets(node, module, is_package):
                other = layer(target)
                if other is None:
                    continue
                allowed = ALLOWED[own] | ({"cost_models"} if module in COST_MODEL_USERS else set())
                if other not in allowed:
                    found.append(f"{where}: {own} module {module} imports {other} ({target})")
                if id(node) in in_function and node.lineno not in commented:
                    found.append(
                        f"{where}: {module} imports {target} inside a function; move it to "
                        "the top, or say on that line why it cannot be there"
                    )
    return found


def test_the_package_imports_one_way():
    assert violations() == []


def test_every_module_is_seen():
    modules = {name for _, name, _ in _modules(ROOT)}
    assert {
        "autopar.core.plan",
        "autopar.cost_models.comm",
        "autopar.passes.solve",
        "autopar.passes.solve.driver",
        "autopar.passes.pricing",
        "autopar.runtime.parallel_module",
        "autopar.api",
    } <= modules


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in PACKAGES:
        (tmp_path / folder).mkdir(exist_ok=True)
    return tmp_path


def test_a_back_edge_is_found(tmp_path):
    root = _tree(
        tmp_path,
        {
            "autopar/core/__init__.py": "",
            "autopar/core/plan.py": "from autopar.passes.strategies import Strategy\n",
            "runtime/module.py": "from autopar.passes import codegen\n",
            "cost_models/comm.py": "from ..passes import solve\n",
            "passes/fold.py": "from autopar.cost_models import comm\n",
            "passes/pricing.py": "from autopar.cost_models import comm\nfrom . import fold\n",
        },
    )
    found = violations(root)
    assert len(found) == 4, found
    assert any("core module autopar.core.plan imports passes" in v for v in found)
    assert any("runtime module autopar.runtime.module imports passes" in v for v in found)
    assert any("cost_models module autopar.cost_models.comm imports passes" in v for v in found)
    assert any("passes module autopar.passes.fold imports cost_models" in v for v in found)


def test_an_import_inside_a_function_needs_its_reason(tmp_path):
    root = _tree(
        tmp_path,
        {
            "passes/a.py": "def f():\n    from . import b\n",
            "passes/b.py": "def g():\n    from . import a  # heavy: only the CLI needs it\n",
            "passes/c.py": "def h():\n    from . import a  # noqa: F401\n    import os\n",
        },
    )
    found = violations(root)
    assert len(found) == 2, found
    assert all("inside a function" in v for v in found)
    assert {v.split(":")[0] for v in found} == {"passes/a.py", "passes/c.py"}
