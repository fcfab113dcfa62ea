"""The scripts of benchmarks/: one package grouped by what each script measures, every entry point named for what
it is (bench_*, check_*, plot_*), every module importable on a CPU, no sys.path edits, no private names taken
from other modules."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
GROUPS = ("ops", "generate", "train", "quality")
OTHER = ("results", "data")  # result files; the text-corpus tool's folder (its own layout)
ENTRY = ("bench_", "check_", "plot_")
# private names of another module that a script still uses (each with its reason); this list may only shrink
PRIVATE_USES = {("benchmarks/quality/bench_synthetic.py", "longctx_patch.evals.synthetic.train", "_job")}


def script_files() -> list[Path]:
    return sorted(p for p in BENCH.rglob("*.py") if "results" not in p.relative_to(BENCH).parts)


def entry_scripts() -> list[Path]:
    return [p for p in script_files() if p.parent.name in GROUPS and p.name != "__init__.py"]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_scripts_are_grouped_by_what_they_measure():
    loose = [p.name for p in BENCH.glob("*.py") if p.name not in ("__init__.py", "shared.py", "index.py")]
    assert not loose, f"scripts directly in benchmarks/ (put them in one of {GROUPS}): {loose}"
    for group in GROUPS:
        assert (BENCH / group / "__init__.py").is_file(), group
    folders = {p.relative_to(BENCH).parts[0] for p in BENCH.rglob("*")
               if len(p.relative_to(BENCH).parts) > 1 and not p.relative_to(BENCH).parts[0].startswith("__")}
    assert folders <= set(GROUPS + OTHER), f"folders of benchmarks/ other than {GROUPS + OTHER}: {folders}"
    misnamed = [str(p.relative_to(BENCH)) for p in entry_scripts() if not p.name.startswith(ENTRY)]
    assert not misnamed, f"entry scripts are named {'/'.join(e + '*' for e in ENTRY)}: {misnamed}"


def test_every_script_is_listed_in_the_readme():
    """benchmarks/README.md names every entry script (as a module or a path) and every shell recipe, and nothing
    that is not there."""
    readme = (BENCH / "README.md").read_text()
    shells = sorted(p for p in BENCH.rglob("*.sh") if p.parent.name in GROUPS)
    named = {module_name(p) for p in entry_scripts()} | {p.relative_to(REPO).as_posix() for p in shells}
    named |= {module_name(p) for p in (BENCH / "data").glob("build_*.py")}  # the text-corpus tool's entry point
    unlisted = sorted(n for n in named if f"`{n}`" not in readme)
    assert not unlisted, f"scripts missing from benchmarks/README.md: {unlisted}"
    listed = set(re.findall(r"`(benchmarks\.\w+\.\w+|benchmarks/\w+/\w+\.sh)`", readme))
    stale = sorted(listed - named)
    assert not stale, f"benchmarks/README.md lists scripts that are not in the tree: {stale}"


@pytest.mark.parametrize("path", entry_scripts(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_script_says_what_it_measures(path):
    """The module docstring (which each script's --help prints) opens with what it measures or checks."""
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree)
    assert doc and len(doc.splitlines()[0].split()) >= 5, f"{path.name}: a docstring saying what it measures"
    for node in ast.walk(tree):  # a script with options prints that line first in its --help
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "ArgumentParser":
            assert any(k.arg == "description" for k in node.keywords), f"{path.name}: ArgumentParser(description=...)"


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
                pytest.fail(f"{rel}:{node.lineno} edits sys.path; import through the benchmarks package instead")
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            for a in node.names:
                if a.name.startswith("_"):
                    found.add((rel, node.module, a.name))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                found.add((rel, modules[node.value.id], node.attr))
    assert found <= PRIVATE_USES, f"private names of other modules: {sorted(found - PRIVATE_USES)}"


