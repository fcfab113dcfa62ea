"""The scripts of evals/: one package laid out by kind, every module importable on a CPU, no sys.path edits, no
private names taken from other modules, and the helpers evals/shared.py copies from the package equal to them."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EVALS = REPO / "evals"
KINDS = ("bench", "studies", "device", "plots")
# private names of another module that a script still uses (each with its reason); this list may only shrink
PRIVATE_USES = {("evals/bench/bench_synthetic.py", "longctx_patch.evals.synthetic.train", "_job")}


def script_files() -> list[Path]:
    return sorted(p for p in EVALS.rglob("*.py") if "results" not in p.relative_to(EVALS).parts)


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_scripts_are_laid_out_by_kind():
    loose = [p.name for p in EVALS.glob("*.py") if p.name not in ("__init__.py", "shared.py", "index.py")]
    assert not loose, f"scripts directly in evals/ (put them in one of {KINDS}): {loose}"
    for kind in KINDS:
        assert (EVALS / kind / "__init__.py").is_file(), kind
    assert {p.parent.name for p in script_files() if p.parent != EVALS} <= set(KINDS)
    assert all(p.parent.name == "bench" for p in script_files() if p.name.startswith("bench_"))
    assert all(p.name.startswith("plot_") for p in (EVALS / "plots").glob("*.py") if p.name != "__init__.py")
    assert all(p.parent.name == "plots" for p in script_files() if p.name.startswith("plot_"))


@pytest.mark.parametrize("path", script_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_script_imports_on_the_cpu(path):
    importlib.import_module(module_name(path))


def imported_modules(tree: ast.Module) -> dict[str, str]:
    """alias -> module for `import a.b as x` and `from a import b` (when b is a module) in the file."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                try:
                    importlib.import_module(full)
                except ImportError:
                    continue
                out[a.asname or a.name] = full
    return out


@pytest.mark.parametrize("path", script_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_sys_path_edits_and_no_private_imports(path):
    rel = str(path.relative_to(REPO))
    tree = ast.parse(path.read_text())
    modules = imported_modules(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            if getattr(node.value.value, "id", None) == "sys" and node.value.attr == "path":
                pytest.fail(f"{rel}:{node.lineno} edits sys.path; import through the evals package instead")
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            for a in node.names:
                if a.name.startswith("_"):
                    found.add((rel, node.module, a.name))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                found.add((rel, modules[node.value.id], node.attr))
    assert found <= PRIVATE_USES, f"private names of other modules: {sorted(found - PRIVATE_USES)}"


