"""The layering of `longctx_patch/kernels/`, read from the source with `ast` (nothing is imported):

- a kernel module imports nothing of the package above the kernels (methods, patcher, cache, cli, train, evals, the
  package's own `__init__` ...): inside `longctx_patch` only `longctx_patch.kernels.*` and `longctx_patch.errors`;
- only the Triton files (`triton_*.py`) import triton at module level, and the other modules import a Triton file
  only inside a function (lazily, once `backend.resolve_backend` chose "triton"); tests/test_without_triton.py
  checks the same at run time, in an interpreter where `import triton` fails;
- the kernels have no import cycle, counting the imports inside functions too;
- a host function (not a `@triton.jit` kernel) takes at most MAX_PARAMS parameters: what travels together is one
  object (`wide_functions`); a public host function of kernels/lola at most LOLA_MAX_PARAMS: its tensors beside one
  settings object (`wide_public_functions`).

`layering_problems` is checked on the real tree and, below it, on small trees that break each rule once.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

from conftest import REPO

ALLOWED_ABOVE = ("errors",)  # what the kernels may import of the package outside kernels/


def _modules(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package `__init__`) for every .py file under root/<package>/kernels."""
    out = {}
    for f in sorted((root / package / "kernels").rglob("*.py")):
        parts = f.relative_to(root).with_suffix("").parts
        is_init = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_init else parts)] = (f, is_init)
    return out


def _imports(tree: ast.Module, mod: str, is_init: bool, known: set[str]) -> list[tuple[str, bool, int]]:
    """(imported module, at module level, line) for every import statement of a module: relative imports resolved,
    `from X import name` taken as the module X.name where that is one of `known`."""
    pkg = mod if is_init else mod.rpartition(".")[0]
    found: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, top, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = pkg
                    for _ in range(child.level - 1):
                        up = up.rpartition(".")[0]
                    base = f"{up}.{base}" if base else up
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    found.append((sub if sub in known else base, top, child.lineno))
            visit(child, top)

    visit(tree, True)
    return found


def _is_triton_file(path: Path) -> bool:
    return path.name.startswith("triton_")


def _cycle_through(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """One import cycle inside the strongly connected component `comp`, from its first module back to it."""
    start = min(comp)
    path, seen = [start], {start}

    def walk(v: str) -> bool:
        for w in sorted(graph[v] & comp):
            if w == start:
                path.append(w)
                return True
            if w not in seen:
                seen.add(w)
                path.append(w)
                if walk(w):
                    return True
                path.pop()
        return False

    walk(start)
    return path


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle of each strongly connected component with more than one module, or of a module that imports
    itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
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
            if len(comp) > 1 or v in graph[v]:
                out.append(_cycle_through(graph, set(comp)))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return out


def layering_problems(root: Path, package: str = "longctx_patch") -> list[str]:
    """Every breach of the three rules (module docstring) under root/<package>/kernels, in words."""
    mods = _modules(root, package)
    known = set(mods)
    problems = []
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, (path, is_init) in mods.items():
        where = path.relative_to(root)
        for target, top, line in _imports(ast.parse(path.read_text(), str(path)), mod, is_init, known):
            inside = target == package or target.startswith(package + ".")
            allowed = target.startswith(f"{package}.kernels.") or target in {f"{package}.{m}" for m in ALLOWED_ABOVE}
            if inside and not allowed:
                problems.append(f"{where}:{line}: a kernel module imports {target} (above the kernels)")
            if top and not _is_triton_file(path):
                if target == "triton" or target.startswith("triton."):
                    problems.append(f"{where}:{line}: imports {target} at module level but is no Triton file "
                                    "(triton_*.py)")
                elif target in mods and _is_triton_file(mods[target][0]):
                    problems.append(f"{where}:{line}: imports the Triton file {target} at module level (import it "
                                    "inside the function that runs it, once the backend chose triton)")
            if target in mods:
                graph[mod].add(target)
    problems += [f"import cycle in the kernels: {' -> '.join(c)}" for c in _cycles(graph)]
    return problems


def test_kernels_are_layered():
    problems = layering_problems(REPO)
    assert not problems, "\n".join(problems)
    # and the walk saw the tree: every op folder, the toolbox, the Triton files
    mods = _modules(REPO, "longctx_patch")
    for name in ("backend", "triton_lib", "graphs", "lola.ops", "lola.triton_hybrid", "muse.ops", "muse.triton_cluster",
                 "ovq.ops", "ovq.triton_fast", "decode.ops", "decode.triton_decode", "softmax.ops", "window.ops",
                 "window.triton_window", "model_ops.ops", "model_ops.triton_model_ops"):
        assert f"longctx_patch.kernels.{name}" in mods, name


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, src in files.items():
        f = tmp_path / "pkg" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(textwrap.dedent(src))
    return tmp_path


def test_layering_check_finds_each_breach(tmp_path):
    root = _tree(tmp_path, {
        "errors.py": "",
        "methods/exact.py": "",
        "kernels/backend.py": "import torch\nfrom ..errors import ConfigError\n",
        "kernels/triton_lib.py": "import triton\nfrom .backend import INTERPRET\n",
        "kernels/fam/__init__.py": "from .ops import run\n",
        "kernels/fam/ops.py": textwrap.dedent("""\
            from ...methods.exact import softmax_attention
            from . import triton_fast as eager

            def run():
                import triton
                from .triton_fast import kern
            """),
        "kernels/fam/triton_fast.py": "import triton\nfrom ..triton_lib import dot\nfrom .other import helper\n",
        "kernels/fam/other.py": "import triton.language as tl\n\ndef helper():\n    from .ops import run\n",
        "kernels/fam/reference.py": "import pkg\n",
    })
    problems = layering_problems(root, "pkg")
    text = "\n".join(problems)
    assert "kernels/fam/ops.py:1: a kernel module imports pkg.methods.exact" in text, text
    assert "kernels/fam/reference.py:1: a kernel module imports pkg (above" in text, text
    assert "kernels/fam/ops.py:2: imports the Triton file pkg.kernels.fam.triton_fast at module level" in text, text
    assert "kernels/fam/other.py:1: imports triton.language at module level but is no Triton file" in text, text
    assert ("import cycle in the kernels: pkg.kernels.fam.ops -> pkg.kernels.fam.triton_fast -> pkg.kernels.fam.other "
            "-> pkg.kernels.fam.ops") in text, text
    # and nothing else: errors.py may be imported, Triton files import triton, a function may import it lazily
    assert len(problems) == 5, text


def test_layering_check_passes_a_layered_tree(tmp_path):
    root = _tree(tmp_path, {
        "errors.py": "",
        "kernels/backend.py": "from ..errors import DeviceError\n",
        "kernels/triton_lib.py": "import triton\n",
        "kernels/fam/__init__.py": "from .ops import run\n",
        "kernels/fam/ops.py": "from . import reference\n\ndef run():\n    from .triton_fam import kern\n",
        "kernels/fam/reference.py": "import torch\n",
        "kernels/fam/triton_fam.py": "import triton\nfrom ..triton_lib import dot\nfrom .reference import ref\n",
    })
    assert layering_problems(root, "pkg") == []


# ------------------------------------------------------------------------------------------------ narrow host functions
MAX_PARAMS = 16  # a kernel host function's parameters (self / cls / ctx aside); more: group them (below)
# host functions still wider, by module and name; this list may only shrink (empty: every host function is narrow)
WIDE_LEFT: set[tuple[str, str]] = set()


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any((isinstance(d, ast.Attribute) and d.attr == "jit") or (
        isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "jit")
        for d in fn.decorator_list)


def wide_functions(root: Path, package: str = "longctx_patch", limit: int = MAX_PARAMS) -> dict[tuple[str, str], int]:
    """(module, function) -> its parameter count, for the host functions (not `@triton.jit` kernels) of the kernels
    that take more than `limit`: what travels together belongs in one object (LolaTuning, LolaRun, HybridKeys and
    HybridRule, OvqKernelOptions, MuseOptions, MuseTiles, MobaStep, WindowTiles)."""
    out = {}
    for mod, (path, _) in _modules(root, package).items():
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or _is_jit(fn):
                continue
            a = fn.args
            names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
            n = len(names) - (names[:1] in (["self"], ["cls"], ["ctx"]))
            if n > limit:
                out[(mod, fn.name)] = n
    return out


def test_kernel_host_functions_are_narrow():
    wide = wide_functions(REPO)
    assert set(wide) - WIDE_LEFT == set(), f"host functions over {MAX_PARAMS} parameters: {wide}"
    assert WIDE_LEFT <= set(wide), f"narrowed: drop from WIDE_LEFT {sorted(WIDE_LEFT - set(wide))}"


def test_the_width_check_counts_parameters(tmp_path):
    root = _tree(tmp_path, {"kernels/fam/ops.py": """\
        import triton

        def wide(a, b, c, *, d=1, e=2):
            pass

        class F:
            @staticmethod
            def forward(ctx, a, b, c, d):
                pass

        @triton.jit
        def kern(A, B, C, D, E, F):
            pass
        """})
    assert wide_functions(root, "pkg", limit=3) == {("pkg.kernels.fam.ops", "wide"): 5,
                                                    ("pkg.kernels.fam.ops", "forward"): 4}


# ----------------------------------------------------------------------------------------- the LoLA host functions
LOLA_MAX_PARAMS = 9  # a public host function of kernels/lola: its tensors and one settings object (self, ctx aside)


def _param_count(fn: ast.FunctionDef) -> int:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return len(names) - (names[:1] in (["self"], ["cls"], ["ctx"]))


def wide_public_functions(root: Path, package: str = "longctx_patch", family: str = "lola",
                          limit: int = LOLA_MAX_PARAMS) -> dict[tuple[str, str], int]:
    """(module, function or Class.method) -> its parameter count, for the public host functions of
    kernels/<family> that take more than `limit`. Public: a module-level function or a method of a module-level
    class, no name of the two with a leading underscore, and a public class's `__init__` / `__call__` (the class's
    own call); `@triton.jit` kernels and nested functions are left out. The settings go as one object (HybridSpec,
    LolaRun, StateSizes, SetsSpec, EvictionPlan, LolaTuning, HybridKeys / HybridRule) beside the tensors."""
    out = {}
    for mod, (path, _) in _modules(root, package).items():
        if not mod.startswith(f"{package}.kernels.{family}."):
            continue
        tree = ast.parse(path.read_text(), str(path))
        found: list[tuple[str, ast.FunctionDef]] = []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                found.append((node.name, node))
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                found += [(f"{node.name}.{fn.name}", fn) for fn in node.body
                          if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                          and (not fn.name.startswith("_") or fn.name in ("__init__", "__call__"))]
        for name, fn in found:
            if not _is_jit(fn) and _param_count(fn) > limit:
                out[(mod, name)] = _param_count(fn)
    return out


def test_lola_host_functions_take_one_settings_object():
    wide = wide_public_functions(REPO)
    assert wide == {}, (f"public host functions of kernels/lola over {LOLA_MAX_PARAMS} parameters (pass the settings "
                        f"as one object: HybridSpec, LolaRun, StateSizes, SetsSpec, EvictionPlan): {wide}")
    # and the walk saw them: the entry points that take such an object
    for mod, name in (("ops", "hybrid_attention"), ("sparse_cache", "lola_process"), ("state", "LolaState.empty"),
                      ("training", "lola_attention_sets"), ("triton_evict", "PrefillEvictions.__init__")):
        assert wide_public_functions(REPO, limit=0).get((f"longctx_patch.kernels.lola.{mod}", name), 0) > 0, name


def test_the_public_width_check_counts_public_functions_only(tmp_path):
    root = _tree(tmp_path, {"kernels/lola/ops.py": """\
        import triton

        def wide(a, b, c, *, d=1, e=2):
            def nested(a, b, c, d, e):
                pass

        def _private(a, b, c, d, e):
            pass

        class Fn:
            @staticmethod
            def forward(ctx, a, b, c, d):
                pass

            def __init__(self, a, b, c, d):
                pass

            def _helper(self, a, b, c, d):
                pass

            @classmethod
            def empty(cls, a, b, c, d):
                pass

        class _Hidden:
            def run(self, a, b, c, d):
                pass

        @triton.jit
        def kern(A, B, C, D, E, F):
            pass
        """, "kernels/other/ops.py": "def wide(a, b, c, d, e):\n    pass\n"})
    assert wide_public_functions(root, "pkg", limit=3) == {
        ("pkg.kernels.lola.ops", "wide"): 5, ("pkg.kernels.lola.ops", "Fn.forward"): 4,
        ("pkg.kernels.lola.ops", "Fn.__init__"): 4, ("pkg.kernels.lola.ops", "Fn.empty"): 4}
