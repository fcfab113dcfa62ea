"""The lab flips no switch inside the product: no module of longctx_patch/ or benchmarks/ assigns, or changes in place,
a global of another module of the package (`prefill.PARALLEL_PREFILL = False`, `TUNE["x"] = 8`, `TILES.update(...)`,
`setattr(module, ...)`). How a kernel runs is an option passed down (kernels/lola/tuning.LolaTuning, `tuning=`; the
OVQ kernels' `OvqKernelOptions`, `options=`; muse's `MuseTiles`, `tiles=`, and `block_peaks_triton(tiles=...)`;
`DecodeGraphs.simulate`), and a module keeps its own state to itself (kernels/graphs.simulated_capture)."""

from __future__ import annotations

import ast
from pathlib import Path

from test_import_graph import REPO, ROOT, SCRIPTS, find_modules

MUTATORS = {"update", "pop", "popitem", "clear", "setdefault", "__setitem__", "__delitem__"}
# what is left, by file and expression; this list may only shrink
LEFT: set[tuple[str, str]] = set()


def _module_aliases(module: str, path: Path, tree: ast.AST, modules) -> tuple[dict[str, str], set[str]]:
    """(local name -> package module it is bound to, local names imported from another module of the package)."""
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    aliases, imported = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - (node.level - 1)] if node.level else []
            base_name = ".".join(base + (node.module.split(".") if node.module else []))
            for a in node.names:
                sub = f"{base_name}.{a.name}"
                if sub in modules:
                    aliases[a.asname or a.name] = sub
                elif base_name in modules and base_name != module:
                    imported.add(a.asname or a.name)
    return aliases, imported


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def switches(module: str, path: Path, modules) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases, imported = _module_aliases(module, path, tree, modules)
    out = []

    def foreign(target: ast.expr) -> bool:
        """`alias.NAME = `, `alias.NAME[k] = `, `NAME[k] = ` / `NAME.x = ` for a name imported from the package."""
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
            return target.value.id in aliases
        if isinstance(target, (ast.Subscript, ast.Attribute)):
            root = _root_name(target)
            inner = target.value
            return root in imported or (root in aliases and isinstance(inner, ast.Attribute))
        return False

    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = [t for t in node.targets for t in (t.elts if isinstance(t, ast.Tuple) else [t])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for t in targets:
            if foreign(t):
                out.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(t)} assigned")
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id == "setattr" and node.args and _root_name(node.args[0]) in aliases:
                out.append(f"{path.relative_to(REPO)}:{node.lineno}: setattr({ast.unparse(node.args[0])}, ...)")
            if isinstance(f, ast.Attribute) and f.attr in MUTATORS:
                obj = f.value
                root = _root_name(obj)
                if (isinstance(obj, ast.Name) and root in imported and obj.id.isupper()) or (
                        isinstance(obj, ast.Attribute) and root in aliases and obj.attr.isupper()):
                    out.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(f)}(...)")
    return out


def test_no_module_changes_another_modules_globals():
    modules = find_modules(REPO, (ROOT, *SCRIPTS))
    found = [s for m, p in modules.items() for s in switches(m, p, modules)]
    key = lambda s: (s.split(":", 1)[0], s.split(": ", 1)[1])  # noqa: E731
    bad = [s for s in found if key(s) not in LEFT]
    assert bad == [], "globals of another module changed (pass an option instead):\n" + "\n".join(bad)
    assert LEFT <= {key(s) for s in found}, "fixed: drop from LEFT"


def test_the_checker_finds_each_form(tmp_path):
    files = {
        "longctx_patch/__init__.py": "",
        "longctx_patch/kernels/__init__.py": "",
        "longctx_patch/kernels/knobs.py": "TUNE = {}\nFLAG = True\n",
        "longctx_patch/user.py": "from .kernels import knobs\nknobs.FLAG = False\n",
        "benchmarks/__init__.py": "",
        "benchmarks/b.py": ("import longctx_patch.kernels.knobs as kn\nfrom longctx_patch.kernels.knobs import TUNE\n"
                            "def f():\n    kn.TUNE['x'] = 1\n    TUNE.update(x=2)\n    TUNE['y'] = 3\n"
                            "    setattr(kn, 'FLAG', 0)\n    local = {}\n    local['z'] = 4\n"),
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    modules = find_modules(tmp_path, (ROOT, "benchmarks"))
    import test_no_switches as me

    was = me.REPO
    me.REPO = tmp_path
    try:
        found = [s for m, p in modules.items() for s in switches(m, p, modules)]
    finally:
        me.REPO = was
    assert sorted(s.split(": ", 1)[1] for s in found) == sorted([
        "knobs.FLAG assigned", "kn.TUNE['x'] assigned", "TUNE.update(...)", "TUNE['y'] assigned",
        "setattr(kn, ...)"]), found
