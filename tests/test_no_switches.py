"""The lab flips no switch inside the product: no module of longctx_patch/ or benchmarks/ assigns, or changes in place,
a global or an attribute of another module of the package, or of something imported from one
(`prefill.PARALLEL_PREFILL = False`, `TUNE["x"] = 8`, `TILES.update(...)`, `setattr(module, ...)`, `Class.x = ...`; a
module reached through `importlib.import_module` or `sys.modules` counts as imported), nor hands another module's
mutable table (a dict, list or set it builds at module level) on to code that could fill it (`fastest(...,
cells.FWD_TILES)`, `table = mod.TILES`, `(key, mod.TILES)`). Nor does it go through the environment: the kernels read
no `LONGCTX_*` variable (none of OVQ's `LONGCTX_OVQ_*` anywhere in the product) and a benchmark sets none (nor one whose
name it computes). How a kernel runs is an option passed down (kernels/lola/tuning.LolaTuning, `tuning=`; the OVQ
kernels' `OvqKernelOptions`, `options=`; muse's `MuseTiles`, `tiles=`, and `block_peaks_triton(tiles=...)`; the
sliding-window forward's `WindowTiles`, `tiles=`; `DecodeGraphs.simulate`), and a module keeps its own state to itself
(kernels/graphs.simulated_capture)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_import_graph import REPO, ROOT, SCRIPTS, find_modules

MUTATORS = {"update", "pop", "popitem", "clear", "setdefault", "__setitem__", "__delitem__"}
# calls that only read a table handed to them (`len(mod.TABLE)`, `sorted(...)`, `", ".join(...)`)
READERS = {"len", "sorted", "list", "tuple", "set", "frozenset", "dict", "iter", "any", "all", "sum", "min", "max",
           "enumerate", "zip", "reversed", "repr", "str", "print", "isinstance", "bool", "deepcopy", "copy", "dumps",
           "join", "format"}
# what is left, by file and expression; this list may only shrink
LEFT: set[tuple[str, str]] = set()
# environment variables, by file and name; these lists may only shrink
ENV_READS_LEFT: set[tuple[str, str]] = set()
ENV_WRITES_LEFT: set[tuple[str, str]] = set()


def _module_aliases(module: str, path: Path, tree: ast.AST, modules) -> tuple[dict[str, str], dict[str, tuple]]:
    """(local name -> package module it is bound to, local name -> (module, name) of what it names, imported from
    another module of the package). `m = importlib.import_module("longctx_patch.x")` and `m = sys.modules[...]`
    bind an alias too."""
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    aliases, imported = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = _dynamic_import(node.value)
            if name in modules:
                aliases[node.targets[0].id] = name
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
                    imported[a.asname or a.name] = (base_name, a.name)
    return aliases, imported


def _dynamic_import(value: ast.expr) -> str | None:
    """The module named by `importlib.import_module("x")` / `import_module("x")` / `sys.modules["x"]`, else None."""
    if isinstance(value, ast.Call) and value.args and isinstance(value.args[0], ast.Constant):
        f = value.func
        if (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
                isinstance(f, ast.Name) and f.id == "import_module"):
            return value.args[0].value
    if (isinstance(value, ast.Subscript) and isinstance(value.value, ast.Attribute) and value.value.attr == "modules"
            and isinstance(value.slice, ast.Constant)):
        return value.slice.value
    return None


MUTABLE_MAKERS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque"}


def mutable_globals(path: Path) -> set[str]:
    """The names a module binds at its top level to a dict, list or set it builds (a table others could fill)."""
    out = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) and node.value is not None else []
        value = getattr(node, "value", None)
        f = value.func if isinstance(value, ast.Call) else None
        made = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(f, ast.Name) and f.id in MUTABLE_MAKERS) or (isinstance(f, ast.Attribute) and f.attr in
                                                                     MUTABLE_MAKERS)
        if made:
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def switches(module: str, path: Path, modules, tables: dict[str, set[str]]) -> list[str]:
    """What `module` (at `path`) changes of other modules of the package. `tables`: module -> its mutable globals
    (`mutable_globals`), for the tables handed on."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases, imported = _module_aliases(module, path, tree, modules)
    out = []

    def foreign(target: ast.expr) -> bool:
        """`alias.NAME = `, `alias.NAME[k] = `, `NAME[k] = ` / `NAME.x = ` for a name imported from the package."""
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
            return target.value.id in aliases or target.value.id in imported
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
    out += handed_on(path, tree, aliases, imported, tables)
    return out


def handed_on(path: Path, tree: ast.AST, aliases, imported, tables) -> list[str]:
    """Another module's table (`alias.TABLE`, or `TABLE` imported) passed to a call that is not a plain reader, bound
    to a name, put in a tuple, list, set or dict, or returned: whoever gets it can fill it unseen."""
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            table = node.attr in tables.get(aliases[node.value.id], ())
        elif isinstance(node, ast.Name) and node.id in imported:
            table = imported[node.id][1] in tables.get(imported[node.id][0], ())
        else:
            continue
        if not table or not isinstance(node.ctx, ast.Load):
            continue
        up = parent.get(node)
        if isinstance(up, ast.keyword):
            up = parent.get(up)
        if isinstance(up, ast.Call) and up.func is not node:
            f = up.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            away = name not in READERS
        else:
            away = isinstance(up, (ast.Assign, ast.AnnAssign, ast.NamedExpr, ast.Tuple, ast.List, ast.Set, ast.Dict,
                                   ast.Return, ast.Yield)) and (not isinstance(up, ast.Dict) or node not in up.keys)
        if away:
            out.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)} handed on")
    return out


ENV_NAME = re.compile(r"LONGCTX_[A-Z0-9_]*")
ENV_WRITERS = {"setdefault", "update", "pop", "popitem", "clear", "__setitem__", "__delitem__"}


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def env_names(path: Path, docstrings: bool = False) -> list[tuple[str, str]]:
    """(file, name) of every `LONGCTX_*` environment variable a module names in a string of its code (an f-string's
    fixed head included; docstrings only with `docstrings`): what it can read or write."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = set() if docstrings else _docstrings(tree)
    rel = str(path.relative_to(REPO))
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip:
            out += [(rel, m) for m in (ENV_NAME.findall(n.value) if docstrings else
                                       [n.value] if ENV_NAME.fullmatch(n.value) else [])]
    return out


def _is_environ(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def env_writes(path: Path) -> list[tuple[str, str]]:
    """(file, name) of every environment variable a module sets or removes (`os.environ[k] = `, `del os.environ[k]`,
    `os.environ.setdefault / update / pop (k, ...)`, `os.putenv`, `os.unsetenv`, `monkeypatch.setenv / delenv`);
    a name it computes is `<computed>`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    rel = str(path.relative_to(REPO))
    keys = []
    for n in ast.walk(tree):
        targets = n.targets if isinstance(n, (ast.Assign, ast.Delete)) else [n.target] if isinstance(
            n, (ast.AugAssign, ast.AnnAssign)) else []
        keys += [t.slice for t in targets if isinstance(t, ast.Subscript) and _is_environ(t.value)]
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            f = n.func
            if (_is_environ(f.value) and f.attr in ENV_WRITERS) or f.attr in ("putenv", "unsetenv", "setenv",
                                                                               "delenv"):
                keys += n.args[:1] + [k.value if k.arg is None else ast.Constant(k.arg) for k in n.keywords
                                      if f.attr == "update"]
                if f.attr == "update" and n.args and isinstance(n.args[0], ast.Dict):
                    keys[-1:] = n.args[0].keys
    return [(rel, k.value if isinstance(k, ast.Constant) and isinstance(k.value, str) else "<computed>")
            for k in keys]


def test_no_module_changes_another_modules_globals():
    modules = find_modules(REPO, (ROOT, *SCRIPTS))
    tables = {m: mutable_globals(p) for m, p in modules.items()}
    found = [s for m, p in modules.items() for s in switches(m, p, modules, tables)]
    key = lambda s: (s.split(":", 1)[0], s.split(": ", 1)[1])  # noqa: E731
    bad = [s for s in found if key(s) not in LEFT]
    assert bad == [], "globals of another module changed (pass an option instead):\n" + "\n".join(bad)
    assert LEFT <= {key(s) for s in found}, "fixed: drop from LEFT"


def test_the_checker_finds_each_form(tmp_path):
    files = {
        "longctx_patch/__init__.py": "",
        "longctx_patch/kernels/__init__.py": "",
        "longctx_patch/kernels/knobs.py": ("TUNE = {}\nFLAG = True\nNAMES = ('a', 'b')\nLIST = list()\n"
                                           "class Knob:\n    x = 1\n"),
        "longctx_patch/user.py": "from .kernels import knobs\nknobs.FLAG = False\n",
        "benchmarks/__init__.py": "",
        "benchmarks/b.py": ("import longctx_patch.kernels.knobs as kn\nfrom longctx_patch.kernels.knobs import TUNE\n"
                            "def f():\n    kn.TUNE['x'] = 1\n    TUNE.update(x=2)\n    TUNE['y'] = 3\n"
                            "    setattr(kn, 'FLAG', 0)\n    local = {}\n    local['z'] = 4\n"),
        "benchmarks/c.py": ("import importlib\nimport sys\nfrom longctx_patch.kernels.knobs import Knob, LIST\n"
                            "m = importlib.import_module('longctx_patch.kernels.knobs')\n"
                            "n = sys.modules['longctx_patch.kernels.knobs']\n"
                            "def g(fill):\n    Knob.x = 2\n    m.FLAG = 0\n    n.TUNE['k'] = 1\n"
                            "    fill(m.TUNE)\n    fill(tiles=LIST)\n    t = m.TUNE\n    pairs = (('a', m.TUNE),)\n"
                            "    ok = len(m.TUNE), sorted(LIST), m.TUNE.get('x'), m.TUNE['x'], fill(m.NAMES)\n"
                            "    return m.TUNE\n"),
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    modules = find_modules(tmp_path, (ROOT, "benchmarks"))
    import test_no_switches as me

    was = me.REPO
    me.REPO = tmp_path
    try:
        tables = {m: mutable_globals(p) for m, p in modules.items()}
        found = [s for m, p in modules.items() for s in switches(m, p, modules, tables)]
    finally:
        me.REPO = was
    assert sorted(s.split(": ", 1)[1] for s in found) == sorted([
        "knobs.FLAG assigned", "kn.TUNE['x'] assigned", "TUNE.update(...)", "TUNE['y'] assigned",
        "setattr(kn, ...)", "Knob.x assigned", "m.FLAG assigned", "n.TUNE['k'] assigned", "m.TUNE handed on",
        "LIST handed on", "m.TUNE handed on", "m.TUNE handed on", "m.TUNE handed on"]), found


def test_the_kernels_read_no_environment_switch():
    """No kernel module names a `LONGCTX_*` variable (its options come as arguments), and no product module names
    one of OVQ's former `LONGCTX_OVQ_*` knobs, not even in a docstring."""
    modules = find_modules(REPO, (ROOT,))
    found = {x for m, p in modules.items() if m.startswith(f"{ROOT}.kernels") for x in env_names(p)}
    bad = sorted(found - ENV_READS_LEFT)
    assert bad == [], "environment variables the kernels read (pass an option instead):\n" + "\n".join(map(str, bad))
    assert ENV_READS_LEFT <= found, "fixed: drop from ENV_READS_LEFT"
    ovq = sorted(x for p in modules.values() for x in env_names(p, docstrings=True) if x[1].startswith("LONGCTX_OVQ_"))
    assert ovq == [], ovq


def test_no_benchmark_sets_a_package_environment_variable():
    """A benchmark sets no `LONGCTX_*` variable (nor one whose name it computes): what it varies, it passes."""
    modules = find_modules(REPO, SCRIPTS)
    found = {x for p in modules.values() for x in env_writes(p) if x[1].startswith("LONGCTX_") or x[1] == "<computed>"}
    bad = sorted(found - ENV_WRITES_LEFT)
    assert bad == [], "environment variables set by benchmarks (pass an option instead):\n" + "\n".join(map(str, bad))
    assert ENV_WRITES_LEFT <= found, "fixed: drop from ENV_WRITES_LEFT"


def test_the_environment_checks_find_each_form(tmp_path):
    import test_no_switches as me

    (tmp_path / "k.py").write_text(
        '"""reads LONGCTX_OVQ_DOC"""\nimport os\nA = os.environ.get("LONGCTX_A", "1")\nenv = os.environ.get\n'
        'B = env("LONGCTX_B")\nC = os.getenv(f"LONGCTX_C{1}")\nD = "not LONGCTX_D"\n')
    (tmp_path / "b.py").write_text(
        'import os\nos.environ["LONGCTX_E"] = "1"\nos.environ.setdefault("LONGCTX_F", "1")\n'
        'os.environ.pop("LONGCTX_G", None)\ndel os.environ["LONGCTX_H"]\nk = "X"\nos.environ[k] = "1"\n'
        'os.environ.update(LONGCTX_I="1")\nos.environ.update({"LONGCTX_J": "1"})\nos.putenv("LONGCTX_K", "1")\n'
        'def t(monkeypatch):\n    monkeypatch.setenv("LONGCTX_L", "1")\nos.environ["TRITON_INTERPRET"] = "1"\n'
        'x = os.environ.get("LONGCTX_M")\n')
    was = me.REPO
    me.REPO = tmp_path
    try:
        names = [n for _, n in env_names(tmp_path / "k.py")]
        with_doc = [n for _, n in env_names(tmp_path / "k.py", docstrings=True)]
        writes = [n for _, n in env_writes(tmp_path / "b.py")]
    finally:
        me.REPO = was
    assert names == ["LONGCTX_A", "LONGCTX_B", "LONGCTX_C"], names
    assert sorted(with_doc) == ["LONGCTX_A", "LONGCTX_B", "LONGCTX_C", "LONGCTX_D", "LONGCTX_OVQ_DOC"], with_doc
    assert sorted(writes) == sorted(["LONGCTX_E", "LONGCTX_F", "LONGCTX_G", "LONGCTX_H", "<computed>", "LONGCTX_I",
                                     "LONGCTX_J", "LONGCTX_K", "LONGCTX_L", "TRITON_INTERPRET"]), writes
