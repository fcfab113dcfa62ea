"""The import graph of the whole tree (longctx_patch/ with its train/, evals/ and cli/, and the benchmark scripts of
benchmarks/ or evals/) keeps the layering of docs/ARCHITECTURE.md.

Every module is parsed with `ast`; every import counts, at any depth (module level, inside functions, methods,
try/except), relative ones resolved against the importing module. `from P import x` is an arrow to the module
`P.x` when there is one, else to `P`; importing `a.b.c` also runs the packages `a.b` (Python imports the parents
first), which counts as an arrow too unless that package encloses the importer.

(a) no import cycle among the tree's modules (cli/ and the scripts included): a lazy (function-level) import is
    still an arrow. The only arrows left out are imports under `if TYPE_CHECKING:` (never executed); there is no
    allowed exception (`__version__` lives in the leaf module `_version.py`, which the root and checkpoint.py import).
    Nor between folders: with each folder's modules taken as one (a module directly in longctx_patch/ as its own),
    the arrows still make no cycle, so that e.g. train/ and evals/ or two kernel op folders import each other one
    way only.
(b) no upward arrow: each module belongs to a layer (LAYERS) and imports only its own layer or lower ones.
(c) no private name (`_x`) imported from another module, except between modules of one package folder of the
    project (kernels/, methods/, evals/, train/, cli/ ... with their subfolders). A module directly in
    longctx_patch/ (patcher, cache, models ...) keeps its private names to itself: e.g. the patcher's state is
    reached through its public functions only. The scripts (benchmarks/) are left to their own layout test, which
    lists the private names they still use.
"""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOT = "longctx_patch"
# the scripts' folder: benchmarks/ (evals/ before it took that name); whichever the tree has
SCRIPTS = tuple(name for name in ("benchmarks", "evals") if (REPO / name / "__init__.py").is_file())
PACKAGES = (ROOT, *SCRIPTS)

# (module prefix, layer): a module is in the layer of its longest matching prefix; arrows may not go up
LAYERS = (
    (f"{ROOT}.kernels", 0),  # plain tensors in and out
    (f"{ROOT}.errors", 0),
    (f"{ROOT}._version", 0),  # __version__ (a leaf: the root and the saved format read it)
    (f"{ROOT}.architectures", 1),  # shared by the methods and the API: model families, the checkpoint format,
    (f"{ROOT}.checkpoint", 1),  # packaged method weights, the tensor-parallel split of method tensors
    (f"{ROOT}.saved_files", 1),  # a saved folder checked against its record (the loader and the patcher)
    (f"{ROOT}.tensor_parallel", 1),
    (f"{ROOT}.assets", 1),
    (f"{ROOT}.texts", 1),  # which files of a --text folder are read (train and evals)
    (f"{ROOT}.timing", 1),  # StepTimer (train and evals)
    (f"{ROOT}.progress", 1),  # progress lines or bars on stderr (generate and evals)
    (f"{ROOT}.provenance", 1),  # git_commit (train, evals and the scripts)
    (f"{ROOT}.memory", 1),  # available_memory (the methods' state check, train's plan)
    (f"{ROOT}.patch_state", 1),  # the patch kept on the model, read by the methods, the cache and the API
    (f"{ROOT}.methods", 2),
    (ROOT, 3),  # the API: the package root, patcher, cache, models, generation, convert
    (f"{ROOT}.train", 4),
    (f"{ROOT}.evals", 4),
    (f"{ROOT}.cli", 5),  # the click front end (the `longctx` command)
    ("benchmarks", 6),  # scripts: anything below them
    ("evals", 6),
)
LAYER_NAMES = {0: "kernels", 1: "shared", 2: "methods", 3: "API", 4: "train/evals", 5: "cli", 6: "scripts"}


@dataclass(frozen=True)
class Arrow:
    src: str
    dst: str
    name: str | None  # the name taken from dst (`from dst import name`); None for a module import
    line: int
    type_only: bool = False  # under `if TYPE_CHECKING:`
    implicit: bool = False  # a parent package Python runs before the imported module


def find_modules(repo: Path = REPO, packages=PACKAGES) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in sorted((repo / pkg).rglob("*.py")):
            parts = path.relative_to(repo).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """(node, under TYPE_CHECKING) of every import statement, at any depth."""
    stack = [(tree, False)]
    while stack:
        node, type_only = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, type_only
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend((n, True) for n in node.body)
            stack.extend((n, type_only) for n in node.orelse)
            continue
        stack.extend((n, type_only) for n in ast.iter_child_nodes(node))


def module_arrows(module: str, source: str, modules, is_package: bool) -> list[Arrow]:
    """The arrows from `module` (its source given) to modules of `modules`."""
    tree = ast.parse(source)
    here = module.split(".") if is_package else module.split(".")[:-1]  # the package relative imports start from
    out: list[Arrow] = []

    def add(dst: str, name, node, type_only) -> None:
        out.append(Arrow(module, dst, name, node.lineno, type_only))
        parts = dst.split(".")
        for n in range(1, len(parts)):
            parent = ".".join(parts[:n])
            encloses = module == parent or module.startswith(parent + ".")
            if parent in modules and not encloses:
                out.append(Arrow(module, parent, None, node.lineno, type_only, implicit=True))

    for node, type_only in _imports(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                for n in range(len(parts), 0, -1):  # the deepest module of the dotted name that is ours
                    if ".".join(parts[:n]) in modules:
                        add(".".join(parts[:n]), None, node, type_only)
                        break
            continue
        if node.level:
            if node.level - 1 > len(here) - 1:
                raise ValueError(f"{module}:{node.lineno}: relative import beyond the top package")
            base = here[: len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
        else:
            base = node.module.split(".")
        base_name = ".".join(base)
        for alias in node.names:
            sub = f"{base_name}.{alias.name}"
            if sub in modules:
                add(sub, None, node, type_only)
            elif base_name in modules:
                add(base_name, alias.name, node, type_only)
    return out


def all_arrows(modules: dict[str, Path]) -> list[Arrow]:
    out = []
    for mod, path in modules.items():
        out += module_arrows(mod, path.read_text(encoding="utf-8"), modules, path.name == "__init__.py")
    return out


def layer(module: str) -> int | None:
    best = None
    for prefix, rank in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, rank)
    return None if best is None else best[1]


def private_unit(module: str, modules) -> str:
    """Modules that may import each other's private names share this: a package folder directly under a project
    package (with its subfolders), or for a module directly in longctx_patch/, the module alone."""
    parts = module.split(".")
    if parts[0] != ROOT:
        return parts[0]
    if len(parts) >= 3 or (len(parts) == 2 and modules[module].name == "__init__.py"):
        return ".".join(parts[:2])
    return module


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def cycle_arrows(arrows: list[Arrow]) -> dict[str, dict[str, Arrow]]:
    """The arrows between two modules of the tree (all_arrows only makes those), type-only ones left out, by source
    and destination."""
    graph: dict[str, dict[str, Arrow]] = {}
    for a in arrows:
        if a.type_only:
            continue
        if a.src != a.dst:
            graph.setdefault(a.src, {}).setdefault(a.dst, a)
    return graph


def folder(module: str, modules) -> str:
    """The folder of a module for the folder-level check: the package folder holding it (a package's `__init__`: its
    own folder); a module directly in longctx_patch/ stands for itself (the API's modules import down and up the
    folders below them one way each)."""
    parts = module.split(".")
    if modules[module].name == "__init__.py":
        return module
    if parts[0] == ROOT and len(parts) == 2:
        return module
    return ".".join(parts[:-1])


def folder_arrows(arrows: list[Arrow], modules) -> dict[str, dict[str, Arrow]]:
    """cycle_arrows between folders: an arrow of each (source folder, destination folder) pair, its ends the folders."""
    graph: dict[str, dict[str, Arrow]] = {}
    for src, dsts in cycle_arrows(arrows).items():
        for dst, a in dsts.items():
            s, d = folder(src, modules), folder(dst, modules)
            if s != d:
                graph.setdefault(s, {}).setdefault(d, dataclasses.replace(a, src=s, dst=d))
    return graph


def find_cycles(graph: dict[str, dict[str, Arrow]]) -> list[list[Arrow]]:
    """One cycle (as its arrows) through each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comps: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    cycles = []
    for comp in comps:
        members, start = set(comp), comp[0]
        # breadth-first from start back to start inside the component: a shortest cycle through it
        prev: dict[str, Arrow] = {}
        frontier, found = [start], None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w, a in sorted(graph.get(v, {}).items()):
                    if w not in members:
                        continue
                    if w == start:
                        found = a
                        break
                    if w not in prev:
                        prev[w] = a
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path, a = [], found
        while True:
            path.append(a)
            if a.src == start:
                break
            a = prev[a.src]
        cycles.append(path[::-1])
    return cycles


def _where(a: Arrow) -> str:
    what = f"{a.name} from {a.dst}" if a.name else a.dst
    return f"{a.src}:{a.line} imports {what}{' (its package runs first)' if a.implicit else ''}"


def upward(arrows: list[Arrow]) -> list[str]:
    bad = []
    for a in arrows:
        s, d = layer(a.src), layer(a.dst)
        if s is not None and d is not None and d > s:
            bad.append(f"{_where(a)}: {LAYER_NAMES[s]} -> {LAYER_NAMES[d]}")
    return sorted(set(bad))


def private_imports(arrows: list[Arrow], modules) -> list[str]:
    bad = []
    for a in arrows:
        if a.implicit or a.src.split(".")[0] in SCRIPTS:
            continue
        name = a.name if a.name is not None else a.dst.rsplit(".", 1)[-1]
        if _is_private(name) and private_unit(a.src, modules) != private_unit(a.dst, modules):
            bad.append(_where(a))
    return sorted(set(bad))


@pytest.fixture(scope="module")
def graph():
    modules = find_modules()
    return modules, all_arrows(modules)


def test_no_import_cycle(graph):
    _, arrows = graph
    cycles = find_cycles(cycle_arrows(arrows))
    assert not cycles, "import cycles:\n" + "\n".join("  " + "; ".join(_where(a) for a in c) for c in cycles)


def test_no_import_cycle_between_folders(graph):
    modules, arrows = graph
    cycles = find_cycles(folder_arrows(arrows, modules))
    assert not cycles, "folders importing each other:\n" + "\n".join(
        "  " + "; ".join(f"{a.src} -> {a.dst} ({a.line}: {a.name or 'module'})" for a in c) for c in cycles)


def test_no_upward_import(graph):
    _, arrows = graph
    bad = upward(arrows)
    assert not bad, "upward imports:\n" + "\n".join("  " + b for b in bad)


def test_no_private_name_across_packages(graph):
    modules, arrows = graph
    bad = private_imports(arrows, modules)
    assert not bad, "private names imported from another package folder:\n" + "\n".join("  " + b for b in bad)


def test_every_module_has_a_layer(graph):
    modules, _ = graph
    assert [m for m in modules if layer(m) is None] == []
    # and the walk saw the whole tree
    assert {"longctx_patch.patcher", "longctx_patch.kernels.softmax.ops", "longctx_patch.checkpoint",
            "longctx_patch.train.runner", "longctx_patch.evals.common", "longctx_patch.cli.main",
            "longctx_patch.cli.eval_cmd"} <= set(modules)
    assert SCRIPTS and any(m.startswith(SCRIPTS[0] + ".") for m in modules)


# ---------------------------------------------------------------------------------------- the checker itself
def _fake(tmp_path: Path, files: dict[str, str], packages=(ROOT,)) -> tuple[dict[str, Path], list[Arrow]]:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    modules = find_modules(tmp_path, packages)
    return modules, all_arrows(modules)


def test_checker_finds_cycles_outside_the_package(tmp_path):
    """A cycle between two CLI modules, and one between train/ and evals/ through a lazy import, are cycles too;
    an arrow from a script down to the package is no cycle."""
    modules, arrows = _fake(tmp_path, {
        "longctx_patch/__init__.py": "",
        "longctx_patch/train/__init__.py": "",
        "longctx_patch/train/runner.py": "from ..evals.speed import StepTimer\nx = 1\n",
        "longctx_patch/evals/__init__.py": "",
        "longctx_patch/evals/common.py": "def git_commit(): pass\n",
        "longctx_patch/evals/speed.py": "def f():\n    from ..train.runner import x\n",
        "longctx_patch/cli/__init__.py": "",
        "longctx_patch/cli/eval_cmd.py": "from . import eval_ruler_cmd\n",
        "longctx_patch/cli/eval_ruler_cmd.py": "from .eval_cmd import _load\n",
        "benchmarks/__init__.py": "",
        "benchmarks/ops/__init__.py": "",
        "benchmarks/ops/bench_x.py": "from longctx_patch.evals.common import git_commit\nimport longctx_patch.cli.eval_cmd\n",
    }, packages=(ROOT, "benchmarks"))
    cycles = find_cycles(cycle_arrows(arrows))
    assert sorted(sorted({a.src for a in c}) for c in cycles) == [
        ["longctx_patch.cli.eval_cmd", "longctx_patch.cli.eval_ruler_cmd"],
        ["longctx_patch.evals.speed", "longctx_patch.train.runner"],
    ]
    assert upward(arrows) == []


def test_checker_finds_folders_importing_each_other(tmp_path):
    """train/ and evals/ importing each other through different modules make no module cycle, but a folder cycle."""
    modules, arrows = _fake(tmp_path, {
        "longctx_patch/__init__.py": "",
        "longctx_patch/train/__init__.py": "",
        "longctx_patch/train/runner.py": "from ..evals.common import git_commit\n",
        "longctx_patch/train/timing.py": "class StepTimer: pass\n",
        "longctx_patch/evals/__init__.py": "",
        "longctx_patch/evals/common.py": "def git_commit(): pass\n",
        "longctx_patch/evals/speed_model.py": "def f():\n    from ..train.timing import StepTimer\n",
    })
    assert find_cycles(cycle_arrows(arrows)) == []
    cycles = find_cycles(folder_arrows(arrows, modules))
    assert [sorted({a.src for a in c}) for c in cycles] == [["longctx_patch.evals", "longctx_patch.train"]]


def test_checker_resolves_lazy_relative_imports_and_finds_their_cycle(tmp_path):
    modules, arrows = _fake(tmp_path, {
        "longctx_patch/__init__.py": "from ._version import __version__\nfrom .patcher import patch\n",
        "longctx_patch/_version.py": "__version__ = '0'\n",
        "longctx_patch/patcher.py": "from ._version import __version__\nfrom .methods.base import Base\n"
                                    "def patch(): pass\n",
        "longctx_patch/methods/__init__.py": "",
        "longctx_patch/methods/base.py": "class Base:\n    def f(self):\n        try:\n"
                                         "            from ..patcher import patch\n        except ImportError:\n"
                                         "            pass\n",
        "longctx_patch/methods/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                          "    from ..patcher import patch\n",
    })
    assert Arrow("longctx_patch.methods.base", "longctx_patch.patcher", "patch", 4) in arrows
    assert Arrow("longctx_patch.patcher", "longctx_patch.methods", None, 2, implicit=True) in arrows
    assert Arrow("longctx_patch.methods.typed", "longctx_patch.patcher", "patch", 3, type_only=True) in arrows
    cycles = find_cycles(cycle_arrows(arrows))
    assert [sorted({a.src for a in c}) for c in cycles] == [["longctx_patch.methods.base", "longctx_patch.patcher"]]
    # __version__ from the leaf module makes no cycle; both methods modules import upward
    assert upward(arrows) == [
        "longctx_patch.methods.base:4 imports patch from longctx_patch.patcher: methods -> API",
        "longctx_patch.methods.typed:3 imports patch from longctx_patch.patcher: methods -> API",
    ]


def test_checker_counts_version_from_the_root_as_a_cycle(tmp_path):
    """No import is exempt: `from . import __version__` in a module the root imports is a cycle (the one the package
    had before `_version.py`)."""
    modules, arrows = _fake(tmp_path, {
        "longctx_patch/__init__.py": "__version__ = '0'\nfrom .checkpoint import write\n",
        "longctx_patch/checkpoint.py": "from . import __version__\ndef write(): pass\n",
    })
    cycles = find_cycles(cycle_arrows(arrows))
    assert [sorted({a.src for a in c}) for c in cycles] == [["longctx_patch", "longctx_patch.checkpoint"]]


def test_checker_finds_private_names_across_package_folders(tmp_path):
    modules, arrows = _fake(tmp_path, {
        "longctx_patch/__init__.py": "",
        "longctx_patch/patcher.py": "_state = 1\n",
        "longctx_patch/cache.py": "def f():\n    from .patcher import _state\n",
        "longctx_patch/kernels/a.py": "from .lola.b import _dot\n",
        "longctx_patch/kernels/lola/__init__.py": "",
        "longctx_patch/kernels/lola/b.py": "_dot = 1\n",
        "longctx_patch/evals/__init__.py": "from ..kernels.lola.b import _dot\nfrom ..kernels.lola import b\n",
    })
    assert private_imports(arrows, modules) == [
        "longctx_patch.cache:2 imports _state from longctx_patch.patcher",
        "longctx_patch.evals:1 imports _dot from longctx_patch.kernels.lola.b",
    ]
