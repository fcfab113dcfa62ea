"""The per-method hooks of `methods.base.Method`: what `longctx patch`'s fidelity check (`approximation_start`), the
fine-tune's plan (`attention_profile`) and calibration (`calibration`) ask of a method, each answered in the
method's own folder.

- A new method without them is refused by name (MissingHookError, a ConfigError), by the hook and by the feature
  that asks, instead of a guess (the fidelity check said nothing, the plan took a dense estimate).
- Every shipped method answers the first two; calibration is muse's only, the others refuse it by name.
- Each shipped method's hook gives what the code outside methods/ computed before the hooks (OLD_* below, kept here
  as the reference), from the method's own config: for muse the plan's old defaults (blocks of 256, top-10) had
  drifted from muse's own (the tilted far field: blocks of 128, top-4), so its profile is checked against the old
  formula fed the config's values.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch

import longctx_patch as lp
from conftest import tiny_model
from longctx_patch.errors import ConfigError, MissingHookError
from longctx_patch.methods import get_method, list_methods
from longctx_patch.methods.base import Approximation, Method, MethodCalibration

SHIPPED = [m for m in list_methods() if type(get_method(m)).__module__.startswith("longctx_patch.methods.")]


# ------------------------------------------------------------------------------------------------ the old code
def OLD_approximation_start(name, config, device_type="cpu", head_dim=64):
    """cli/fidelity.py's approximation_start before the hook (its branches on method names)."""
    if name == "exact":
        return None, None, "exact attention"
    if name in ("sliding-window", "lolcats", "lola"):
        w = int(config.window)
        part = "dropped" if name == "sliding-window" else "attended through the linear part"
        return w + 1, w, f"keys more than window={w} tokens back are {part}"
    if name == "moba":
        bs, k = int(config.block_size), int(config.top_k)
        first = max(int(config.min_seq_len), k * bs)
        return first + 1, first, (f"a query block attends its own and top_k - 1 = {k - 1} earlier blocks of "
                                  f"block_size={bs}, so the choice starts at block {k} (token {k * bs})"
                                  + (f", past min_seq_len={config.min_seq_len}" if config.min_seq_len > k * bs else ""))
    if name == "muse":
        L = int(config.get("block_size"))
        if config.far_field == "tilted":
            exact = int(config.local_blocks) + int(config.get("topk_blocks"))
            what = f"local_blocks={config.local_blocks} + topk_blocks={config.get('topk_blocks')}"
        else:
            exact = (int(config.sink_blocks) + int(config.local_blocks) + int(config.get("topk_blocks"))
                     + int(config.get("peak_blocks")))
            what = (f"sink_blocks={config.sink_blocks} + local_blocks={config.local_blocks} + "
                    f"topk_blocks={config.get('topk_blocks')} + peak_blocks={config.get('peak_blocks')}")
        first = (exact + 1) * L
        min_len = config.min_len(device_type, head_dim)
        return (max(min_len, first + 1), first,
                f"each query block attends {what} = {exact} earlier blocks of block_size={L} exactly, so the far field "
                f"starts at block {exact + 1} (token {first})"
                + (f" in prefills of min_seq_len={min_len} tokens or more" if min_len > first else ""))
    if name == "ovq":
        c = int(config.chunk_size)
        return c + 1, c, f"keys of earlier chunks (chunk_size={c}) are read through the dictionary"
    return None, None, ""


def OLD_attention_profile(method, config: dict, D: int, S: int, kernels: bool):
    """train/plan.py's _attention_profile before the hook (the recipe's config dict, its own defaults)."""
    name = (method or "exact").lower()
    if name in ("exact", "none", "sliding-window"):
        keys = min(int(config.get("window", 256)), S / 2) if name == "sliding-window" else S / 2
        return keys, 4 * D
    if name in ("lolcats", "lola"):
        window, chunk = int(config.get("window", 64)), 64
        f2 = 2 * int(config.get("feature_dim", 64))
        blocks = math.ceil(window / chunk) + 1
        if kernels:
            return window + chunk + f2, 2 * D + 2 * f2
        return 2 * blocks * chunk + f2, 8 * blocks * chunk + 2 * blocks * (2 * D + f2) + 3 * f2 * D / chunk + 2 * f2
    if name == "muse":
        if kernels:
            blk = int(config.get("block_size") or 256)
            exact = blk * (2 + int(config.get("topk_blocks") or 10) + int(config.get("peak_blocks") or 10))
            return min(exact, S / 2) + S / blk * 8, 4 * D
        return S, 3 * S
    if name == "moba":
        keys = min(int(config.get("block_size", 512)) * int(config.get("top_k", 3)), S / 2)
        return keys, (4 * D if kernels else 3 * S)
    if name == "ovq":
        chunk = int(config.get("chunk_size", 512))
        n = int(config.get("max_centroids", 1024))
        return chunk / 2 + n, (4 * D if kernels else 3 * (chunk + n))
    return S / 2, 3 * S


# configs at which the old code read every value the hook reads (defaults, and the options it did read changed)
CONFIGS = {
    "exact": [{}],
    "sliding-window": [{}, {"window": 8}, {"window": 4096}],
    "lolcats": [{}, {"window": 8}, {"window": 256, "feature_dim": 32}],
    "lola": [{}, {"window": 128, "sparse_cache": 16}, {"feature_dim": 16}],
    "muse": [{}, {"block_size": 64, "topk_blocks": 2, "peak_blocks": 3, "k_clusters": 8},
             {"far_field": "tilted-cells", "min_seq_len": 16}, {"far_field": "tilted"}, {"min_seq_len": 100000}],
    "moba": [{}, {"block_size": 8, "top_k": 2}, {"block_size": 64, "top_k": 4, "min_seq_len": 1000}],
    "ovq": [{}, {"chunk_size": 16, "max_centroids": 16}],
}


def _cases(name):
    """The configs of a method the old code knew (a method added since has no old figures to equal)."""
    return [pytest.param(name, c, id=f"{name}-{json.dumps(c, sort_keys=True)}") for c in CONFIGS.get(name, [])]


# ------------------------------------------------------------------------------------------------ a new method
@pytest.fixture
def bare_method():
    """A method registered with no hook of its own (exact attention under another name)."""
    from longctx_patch.methods.base import _REGISTRY, MethodConfig, register_method
    from longctx_patch.methods.exact import ExactAttention

    @dataclass
    class BareConfig(MethodConfig):
        pass

    class BareAttention(ExactAttention):
        method_name = "test-bare"

    @register_method
    class Bare(Method):
        name = "test-bare"
        config_cls = BareConfig
        module_cls = BareAttention

    yield get_method("test-bare")
    _REGISTRY.pop("test-bare")


def test_a_method_without_the_hooks_is_refused_by_name(bare_method):
    cfg = bare_method.parse_config({})
    for call, hook in ((lambda: bare_method.approximation_start(cfg), "approximation_start"),
                       (lambda: bare_method.attention_profile(cfg, 64, 1024, False), "attention_profile")):
        with pytest.raises(MissingHookError, match=rf"'test-bare' does not implement Method\.{hook}, which .* needs"):
            call()
    with pytest.raises(MissingHookError, match="'test-bare' has no budgets to calibrate .*calibrate takes 'muse'"):
        bare_method.calibration()
    assert issubclass(MissingHookError, ConfigError) and issubclass(MissingHookError, NotImplementedError)


def test_the_features_refuse_a_method_without_the_hooks(bare_method):
    """The fidelity check, the plan and calibrate ask the hook, and pass its refusal on."""
    from longctx_patch.cli.fidelity import approximation_start
    from longctx_patch.train.plan import ModelShape, attention_profile

    cfg = bare_method.parse_config({})
    with pytest.raises(MissingHookError, match="approximation_start"):
        approximation_start("test-bare", cfg)
    shape = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=100, tied=True)
    with pytest.raises(MissingHookError, match="attention_profile"):
        attention_profile("test-bare", {}, shape, 256, False)
    model = tiny_model("llama")
    with pytest.raises(MissingHookError, match="no budgets to calibrate"):
        lp.calibrate(model, "test-bare", torch.arange(3, 300)[None])
    assert not lp.is_patched(model)


# ------------------------------------------------------------------------------------------------ shipped methods
@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_method_answers_its_hooks(name):
    meth = get_method(name)
    cls = type(meth)
    assert cls.approximation_start is not Method.approximation_start, f"{name}: no approximation_start"
    assert cls.attention_profile is not Method.attention_profile, f"{name}: no attention_profile"
    cfg = meth.parse_config(dict(CONFIGS.get(name, [{}])[0]))
    assert isinstance(meth.approximation_start(cfg, "cpu", 64), Approximation)
    keys, held = meth.attention_profile(cfg, 64, 4096, True)
    assert keys > 0 and held > 0
    if name == "muse":
        assert isinstance(meth.calibration(), MethodCalibration)
    else:
        with pytest.raises(MissingHookError, match="no budgets to calibrate"):
            meth.calibration()


@pytest.mark.parametrize("name,config", [c for n in SHIPPED for c in _cases(n)])
@pytest.mark.parametrize("device_type,head_dim", [("cpu", 64), ("cuda", 64), ("cuda", 128)])
def test_approximation_start_is_what_the_fidelity_check_computed(name, config, device_type, head_dim):
    meth = get_method(name)
    cfg = meth.parse_config(dict(config))
    assert tuple(meth.approximation_start(cfg, device_type, head_dim)) == OLD_approximation_start(
        name, cfg, device_type, head_dim)


# the old plan took the cells far field's blocks for muse's tilted one too: that one has a test of its own below
PROFILE_CASES = [c for n in SHIPPED for c in _cases(n) if c.values[1].get("far_field") != "tilted"]


@pytest.mark.parametrize("name,config", PROFILE_CASES)
@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("D,S", [(64, 1024), (128, 32768), (16, 100)])
def test_attention_profile_is_what_the_plan_computed(name, config, kernels, D, S):
    """From the method's parsed config: the old plan's figures wherever it read the same values (muse's cells far
    fields: the old formula fed the config's block size and retrieved blocks, with its constants 2 = sink + local
    blocks and 8 cells checked to be the config's)."""
    from longctx_patch.train.plan import ModelShape, attention_profile

    meth = get_method(name)
    cfg = meth.parse_config(dict(config))
    old_config = dict(config)
    if name == "muse":
        old_config = {k: cfg.get(k) for k in ("block_size", "topk_blocks", "peak_blocks")}
        assert cfg.get("k_clusters") == 8 and cfg.sink_blocks + cfg.local_blocks == 2  # the old formula's constants
    want = OLD_attention_profile(name, old_config, D, S, kernels)
    shape = ModelShape(layers=2, hidden=D * 4, heads=4, kv_heads=2, head_dim=D, intermediate=128, vocab=100, tied=True)
    assert attention_profile(name, dict(config), shape, S, kernels) == want
    assert meth.attention_profile(cfg, D, S, kernels) == want


def test_the_plan_reads_muse_defaults_from_muse_config():
    """The drift the hook removes: the tilted far field's own block size and retrieved blocks, not the cells'."""
    from longctx_patch.methods.muse.config import FAR_FIELD_DEFAULTS

    meth = get_method("muse")
    d = FAR_FIELD_DEFAULTS["tilted"]
    keys, _ = meth.attention_profile(meth.parse_config({"far_field": "tilted"}), 64, 65536, True)
    assert keys == d["block_size"] * (1 + d["topk_blocks"]) + 65536 / d["block_size"] * d["k_clusters"]
    assert keys != OLD_attention_profile("muse", {"far_field": "tilted"}, 64, 65536, True)[0]


def test_no_method_is_the_models_own_attention():
    from longctx_patch.train.plan import ModelShape, attention_profile

    shape = ModelShape(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=128, vocab=100, tied=True)
    for method in (None, "none"):
        assert attention_profile(method, {}, shape, 1000, True) == OLD_attention_profile(method, {}, 64, 1000, True)


def test_muse_calibration_runs_what_calibrate_ran():
    """Muse's MethodCalibration: the op (`muse_attention` of the config's kernel options), the exact heads
    (methods/muse/heads.py), the key of a setting (its kernel options), the ladder and the attended keys of `Muse`."""
    from longctx_patch.kernels.muse import muse_attention
    from longctx_patch.methods.muse.heads import with_exact_heads

    meth = get_method("muse")
    cal = meth.calibration()
    cfg = meth.parse_config(dict(block_size=8, min_seq_len=16, k_clusters=2, topk_blocks=1, backend="torch"))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 64, 16, generator=g) for h in (4, 2, 2))
    o = cal.attend(q, k, v, scale=0.25, config=cfg)
    assert torch.equal(o, muse_attention(q, k, v, scale=0.25, options=cfg.kernel_options(), backend=cfg.backend))
    assert torch.equal(cal.with_exact_heads(o.clone(), q, k, v, [1], scale=0.25),
                       with_exact_heads(o.clone(), q, k, v, [1], scale=0.25))
    assert cal.key(cfg) == json.dumps(cfg.kernel_kwargs(), sort_keys=True)
    assert cal.ladder(cfg, 64) == meth.calibration_ladder(cfg, 64)
    assert cal.attended_keys(cfg, 64) == meth.attended_keys(cfg, 64)


def test_call_report_says_what_a_method_decided_in_its_calls():
    """`call_report` (what `longctx patch` prints under its fidelity check): no lines by default; muse's guard summary
    once a MuSe call ran inside it, nothing outside it or after it."""
    ids = torch.randint(3, 128, (1, 80))
    for name in SHIPPED:
        with get_method(name).call_report() as lines:
            pass
        assert lines() == [], name
    model = tiny_model()
    lp.patch(model, "muse", block_size=16, k_clusters=2, topk_blocks=1, min_seq_len=32, backend="torch")
    with torch.no_grad(), get_method("muse").call_report() as lines:
        model(ids)
    got = lines()
    assert len(got) == 1 and got[0].startswith("muse guard:"), got
    with torch.no_grad():
        model(ids)  # outside: recorded nowhere
    assert lines() == got


# ------------------------------------------------------------------------------------------------ names outside methods/
# Where code outside methods/ compares against a method's name (or the names that stand for no method: UNPATCHED),
# by file and name, with why it may. Anything else is per-method knowledge and belongs in a hook or an attribute of
# the method (exact_reference, converts_from, lolcats_layout, ...). This list may only shrink.
NAMES_ALLOWED = {
    # calibrate's outcome label: a layer it leaves exact is recorded as "exact" (old records too) and patched with the
    # exact method of that name; a label of the result, not knowledge of a method
    ("longctx_patch/calibration.py", "exact"): "the label of a layer calibrate leaves exact",
    # the assets lie below the methods (which import them): the methods of LoLCATs' layout are named there, held to
    # Method.lolcats_layout by tests/test_assets.py
    ("longctx_patch/assets/__init__.py", "lolcats"): "assets.LOLCATS_LAYOUT",
    ("longctx_patch/assets/__init__.py", "lola"): "assets.LOLCATS_LAYOUT",
    # the names that stand for no method, defined once (evals, train and the CLI read them through UNPATCHED and
    # is_unpatched)
    ("longctx_patch/methods/__init__.py", "none"): "is_unpatched, UNPATCHED's home",
    ("longctx_patch/methods/__init__.py", "unpatched"): "is_unpatched, UNPATCHED's home",
    # the same word as another option's value, not a method: a model config's windows, a mixer's option
    ("longctx_patch/architectures.py", "none"): "an ArchAdapter's windows setting",
    ("longctx_patch/evals/synthetic/train.py", "none"): "a synthetic mixer option's value",
    ("longctx_patch/train/recipe.py", "none"): "method_config.checkpoint's value none (fresh feature maps)",
    ("longctx_patch/train/lora_init.py", "none"): "PEFT's LoraConfig.bias value for no bias",
}


def name_branches(root, names) -> set[tuple[str, str]]:
    """(file, name) of every comparison (`==`, `!=`, `in`, `not in`), set operation (`-`, `&`, `|`, `^`) and `match`
    case outside methods/ with a string of `names` as an operand, written out or through a module-level constant
    bound to it (`EXACT = "exact"` ... `x == EXACT`). `root`: the folder holding longctx_patch/."""
    import ast as _ast

    out = set()
    pkg = root / "longctx_patch"
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("longctx_patch/methods/") and rel != "longctx_patch/methods/__init__.py":
            continue
        tree = _ast.parse(path.read_text())
        consts = {}
        for node in tree.body:
            if isinstance(node, (_ast.Assign, _ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, _ast.Assign) else [node.target]
                found = [c.value for c in _ast.walk(node.value) if isinstance(c, _ast.Constant) and c.value in names]
                for t in targets:
                    if isinstance(t, _ast.Name) and found:
                        consts[t.id] = found

        def named(operand):
            """The names an operand compares against; a call's keyword arguments are labels, not operands
            (`resolve_backend(..., what="moba") != "triton"`)."""
            labels = {id(k.value) for c in _ast.walk(operand) if isinstance(c, _ast.Call) for k in c.keywords}
            hits = []
            for c in _ast.walk(operand):
                if id(c) in labels:
                    continue
                if isinstance(c, _ast.Constant) and isinstance(c.value, str) and c.value in names:
                    hits.append(c.value)
                elif isinstance(c, _ast.Name) and c.id in consts:
                    hits += consts[c.id]
            return hits

        for node in _ast.walk(tree):
            operands = []
            if isinstance(node, _ast.Compare):
                operands = [node.left, *node.comparators]
            elif isinstance(node, _ast.BinOp) and isinstance(node.op, (_ast.Sub, _ast.BitAnd, _ast.BitOr, _ast.BitXor)):
                operands = [node.left, node.right]
            elif isinstance(node, _ast.match_case):
                operands = [node.pattern]
            out |= {(rel, n) for o in operands for n in named(o)}
    return out


def test_no_feature_outside_methods_branches_on_a_method_name():
    from conftest import REPO
    from longctx_patch.methods import UNPATCHED

    found = name_branches(REPO, set(list_methods()) | set(UNPATCHED))
    assert found - set(NAMES_ALLOWED) == set(), "branches on a method's name outside methods/ (give the method a hook " \
        "or an attribute instead): " + repr(sorted(found - set(NAMES_ALLOWED)))
    assert set(NAMES_ALLOWED) <= found, f"gone: drop from NAMES_ALLOWED {sorted(set(NAMES_ALLOWED) - found)}"


def test_the_name_check_finds_each_form(tmp_path):
    (tmp_path / "longctx_patch" / "methods" / "m").mkdir(parents=True)
    (tmp_path / "longctx_patch" / "methods" / "m" / "__init__.py").write_text('x = 1 if n == "exact" else 2\n')
    (tmp_path / "longctx_patch" / "a.py").write_text(
        'REF = "exact"\nLAYOUT = ("lola", "lolcats")\n'
        'def f(n, r, s):\n    if n == "muse" or n in ("ovq", "none"):\n        pass\n'
        '    if r.name != REF and s - set(LAYOUT):\n        pass\n'
        '    match n:\n        case "moba":\n            pass\n'
        '    return {"muse": 1}[n], "sliding-window", g("lola"), g(what="ovq") != "x"\n')
    found = name_branches(tmp_path, {"exact", "muse", "ovq", "none", "lola", "lolcats", "moba", "sliding-window"})
    assert found == {("longctx_patch/a.py", n) for n in ("muse", "ovq", "none", "exact", "lola", "lolcats", "moba")}


@pytest.fixture
def twin_method():
    """A method registered as the model's own attention (`exact_reference`) under another name."""
    from longctx_patch.methods.base import _REGISTRY, register_method
    from longctx_patch.methods.exact import Exact

    @register_method
    class Twin(Exact):
        name = "test-twin"

    yield get_method("test-twin")
    _REGISTRY.pop("test-twin")


def test_the_reference_is_what_a_method_says(bare_method, twin_method):
    """Which run is the evaluations' baseline is the method's `exact_reference`, not its name: the unpatched model and
    exact are, a method that declares it is, one that does not is not; `reference_method` names the one method that
    declares it (and refuses by name when there are several)."""
    from longctx_patch.cli.eval_options import method_runs
    from longctx_patch.evals import speed
    from longctx_patch.evals.common import MethodRun, parse_methods
    from longctx_patch.methods import reference_method

    assert [MethodRun(n).reference for n in ("none", "exact", "test-twin", "test-bare", "sliding-window")] == [
        True, True, True, False, False]
    with pytest.raises(ConfigError, match=r"several registered methods \(exact, test-twin\) declare "
                                          r"Method\.exact_reference"):
        reference_method()
    model = tiny_model("llama")
    res = speed.run_speed((model, None), parse_methods(["sliding-window(window=8)", "test-twin"]), cells=[(1, 16)],
                          calls=[2], repeats=1, out_dir=None, model_name="tiny", echo=lambda *_: None)
    assert res["figures"]["reference"] == "test-twin"
    assert [r.label for r in method_runs(["test-twin"], [], baseline=True)] == ["test-twin"]
    from longctx_patch.methods.base import _REGISTRY

    _REGISTRY.pop("test-twin")
    assert reference_method() == "exact"
    assert [r.label for r in method_runs(["test-bare"], [], baseline=True)] == ["exact", "test-bare"]
    _REGISTRY["test-twin"] = twin_method  # the fixture removes it


def test_the_unpatched_names_are_read_in_one_place():
    from longctx_patch.methods import is_unpatched

    assert [is_unpatched(x) for x in (None, "", " None ", "UNPATCHED", "exact", "none-of-these")] == [
        True, True, True, True, False, False]
