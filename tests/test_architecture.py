"""docs/ARCHITECTURE.md's claims about names and flow, each against the code: the root's exports, the layer table
against the tree, what `patch()` installs, which modules write a patch state, `PatchContext`'s fields, the signature of
`PatchedAttention.forward`, the methods whose cache is a `KVBufferLayer`, and the method hooks. (The import rules are
tests/test_import_graph.py's and test_layering.py's; the folders and the recipes tests/test_layout.py's.)"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import longctx_patch as lp
from conftest import tiny_model

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "longctx_patch"
DOC = (REPO / "docs" / "ARCHITECTURE.md").read_text()


def _section(title: str) -> str:
    start = DOC.index(f"\n## {title}\n")
    end = DOC.find("\n## ", start + 1)
    return DOC[start:end if end != -1 else len(DOC)]


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _layout_entry(name: str) -> str:
    """The text of one entry of the Layout block (`  name   text`, with its continuation lines)."""
    lines = _section("Layout").split("```")[1].splitlines()
    i = next(i for i, line in enumerate(lines) if re.match(rf" +{re.escape(name)} ", line))
    out = [lines[i].strip()[len(name):]]
    for line in lines[i + 1:]:
        if not line.startswith(" " * 20):
            break
        out.append(line)
    return _flat(" ".join(out)).strip()


# ------------------------------------------------------------------------------------------------ the root
def test_the_root_exports_what_the_layout_says():
    from longctx_patch import errors

    listed = [x.strip() for x in _layout_entry("__init__.py").split(",")]
    assert listed[-1] == "the errors"
    names = set(listed[:-1]) | set(errors.__all__)
    assert names == set(lp.__all__), (sorted(names - set(lp.__all__)), sorted(set(lp.__all__) - names))
    for name in lp.__all__:
        assert hasattr(lp, name), name


# ------------------------------------------------------------------------------------------------ the layers
def test_the_layer_table_names_every_module_of_the_tree():
    """Every module and folder directly in longctx_patch/ is named in one row of the layer table (each row's layer is
    the import graph's: tests/test_layout.py), and each name in the table is in the tree."""
    rows = re.findall(r"^\| (\w[\w /]*?) \| (.+) \|$", _section("Layers"), re.M)[1:]
    named = [n.removesuffix("/*").removesuffix("/") for _, cells in rows for n in re.findall(r"`([^`]+)`", cells)]
    named = [n for n in named if not n.startswith("benchmarks")]
    assert len(named) == len(set(named)), named
    tree = {p.name for p in PKG.glob("*.py")} | {p.name for p in PKG.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    tree |= {p.name for p in PKG.iterdir() if p.is_dir() and any(p.rglob("*.py"))}  # kernels/: a namespace package
    assert set(named) == tree, (sorted(tree - set(named)), sorted(set(named) - tree))


# ------------------------------------------------------------------------------------------------ the patch state
def test_what_patch_installs_is_what_the_doc_names():
    from longctx_patch.architectures import base_model
    from longctx_patch.decode_graphs import DecodeGraphs, PrefillThenCapture
    from longctx_patch.fused_ops import FusedOps
    from longctx_patch.patch_state import find_state
    from longctx_patch.patcher import PrepareCache, _forward_pre_hook

    text = _flat(_section("The patch state"))
    for name in ("patcher._forward_pre_hook", "patcher.PrepareCache", "decode_graphs.PrefillThenCapture",
                 "decode_graphs.DecodeGraphs", "fused_ops.FusedOps", "_prepare_cache_for_generation", "_prefill"):
        assert f"`{name}`" in text, name
    model = tiny_model("llama")
    lp.patch(model, "exact", layers=[0])
    base = base_model(model)
    assert _forward_pre_hook in [h for h in base._forward_pre_hooks.values()]
    assert isinstance(model.__dict__["_prepare_cache_for_generation"], PrepareCache)
    assert isinstance(model.__dict__["_prefill"], PrefillThenCapture)
    assert isinstance(model.__dict__["forward"], DecodeGraphs)
    assert isinstance(find_state(model).fused, FusedOps)
    lp.unpatch(model)
    assert not base._forward_pre_hooks and not {"_prepare_cache_for_generation", "_prefill", "forward"} & set(
        model.__dict__)


def test_patch_context_fields_are_the_docs():
    from longctx_patch.patch_state import PatchContext

    text = _flat(_section("The patch state"))
    fields = set(vars(PatchContext()))
    assert fields == {"recorder", "recompute", "fused_ops"}
    for f in fields:
        assert f"`{f}`" in text, f


STATE_READERS = {"find_state", "state_of", "patch_context"}
STATE_WRITERS = {"keep_original_weight", "keep_original_weights", "take_original_weights"}  # patch_state.py's own


def state_writes(path: Path) -> list[str]:
    """What a module writes of a patch state: attributes of an object it got from find_state / state_of /
    patch_context (directly or through a name bound to one, or its `.ctx`), and calls of patch_state.py's functions
    that change the kept weights."""
    tree = ast.parse(path.read_text(encoding="utf-8"))

    def from_state(expr) -> bool:
        if isinstance(expr, ast.IfExp):
            return from_state(expr.body) or from_state(expr.orelse)
        return (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in STATE_READERS)

    bound = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and from_state(n.value)
             for t in n.targets if isinstance(t, ast.Name)}

    def is_state(expr) -> bool:
        if isinstance(expr, ast.Name):
            return expr.id in bound
        if isinstance(expr, ast.Attribute) and expr.attr == "ctx":
            return is_state(expr.value)
        return from_state(expr)

    out = []
    for n in ast.walk(tree):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AugAssign) else []
        for t in targets:
            while isinstance(t, ast.Subscript):
                t = t.value
            if isinstance(t, ast.Attribute) and is_state(t.value):
                out.append(ast.unparse(t))
        if isinstance(n, ast.Call):
            f = n.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in STATE_WRITERS:
                out.append(f"{name}()")
            if isinstance(f, ast.Attribute) and f.attr in ("append", "pop", "clear", "update") and isinstance(
                    f.value, ast.Attribute) and is_state(f.value.value):
                out.append(ast.unparse(f))
    return out


def test_the_modules_that_write_a_patch_state_are_the_docs():
    paragraph = _flat(next(p for p in _section("The patch state").split("\n\n") if "write a patch state" in p))
    doc = {n for n in re.findall(r"`([\w/]+\.py)`", paragraph) if n != "patch_state.py"}
    writers = set()
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG).as_posix()
        if rel != "patch_state.py" and state_writes(p):
            writers.add(rel)
    assert writers == doc, (sorted(writers - doc), sorted(doc - writers))


# ------------------------------------------------------------------------------------------------ the methods
def test_the_forward_signature_is_the_docs():
    from longctx_patch.methods.base import PatchedAttention

    m = re.search(r"`PatchedAttention\.forward\(([^`]+)\)`", _flat(_section("The method contract")))
    doc = [x.strip() for x in m.group(1).split(",")]
    sig = inspect.signature(PatchedAttention.forward)
    code = [(f"**{p.name}" if p.kind is p.VAR_KEYWORD else p.name if p.default is p.empty else f"{p.name}={p.default!r}")
            for p in sig.parameters.values() if p.name != "self"]
    assert doc == code


def test_the_methods_with_a_kv_buffer_are_the_docs():
    """kv_layer.py's entry names the methods whose cache layer is a KVBufferLayer (or a subclass)."""
    from longctx_patch.methods.kv_layer import KVBufferLayer
    from longctx_patch.patch_state import patched_modules

    entry = _layout_entry("kv_layer.py")
    doc = set(re.search(r"cache of ([\w, -]+?) \(", entry).group(1).replace(" and ", ", ").split(", "))
    settings = {"muse": dict(block_size=8, backend="torch"), "moba": dict(block_size=8, top_k=2),
                "lolcats": dict(window=8, chunk=8),
                "lola": dict(window=8, chunk=8, sparse_cache=4), "ovq": dict(chunk_size=16, max_centroids=16),
                "sliding-window": dict(window=8)}
    users = set()
    for name in lp.list_methods():
        if not type(lp.get_method(name)).__module__.startswith("longctx_patch.methods."):
            continue
        model = tiny_model("llama")
        lp.patch(model, name, layers=[0], **settings.get(name, {}))
        if isinstance(patched_modules(model)[0].make_cache_layer(), KVBufferLayer):
            users.add(name)
    assert users == doc


def test_the_hooks_the_doc_names_are_the_methods():
    from longctx_patch.methods.base import Method

    text = _flat(_section("The method contract"))
    for hook in ("approximation_start", "attention_profile", "calibration"):
        assert f"`{hook}(" in text, hook
        assert callable(getattr(Method, hook))
    for name in ("Approximation", "MethodCalibration", "MissingHookError"):
        assert f"`{name}`" in text, name


@pytest.mark.parametrize("name", ["cli/fidelity.py", "provenance.py", "calibration.py", "kernels/lola/tuning.py"])
def test_modules_the_doc_describes_exist(name):
    assert (PKG / name).is_file()
