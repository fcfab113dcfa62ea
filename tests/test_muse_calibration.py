"""Calibrated per-layer budgets (longctx_patch/calibration.py): the calibration meets its target on its text (measured
again here on the patched layers), is deterministic, saves and loads exactly, refuses bad input with named errors, and
falls back to exact attention where no MuSe setting meets the target; the key counts of its cost model equal the plan's;
`exact_heads` (what it sets per layer) makes those heads exact."""

import json
import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import longctx_patch as lp  # noqa: E402
from longctx_patch.calibration import Calibration, calibration_record  # noqa: E402
from longctx_patch.errors import AlreadyPatchedError, ConfigError, DeviceError  # noqa: E402
from longctx_patch.evals.approx import capture, relative_error  # noqa: E402
from longctx_patch.kernels.muse import attended_keys  # noqa: E402
from longctx_patch.kernels.muse.reference_cells import make_cells_plan  # noqa: E402
from longctx_patch.kernels.softmax import softmax_attention  # noqa: E402
from longctx_patch.patcher import patch_groups, patched_layers, patched_modules  # noqa: E402

from conftest import rand_qkv, tiny_model  # noqa: E402

# a small MuSe (blocks of 16, 2 cells, nothing retrieved) and one richer setting, on 200 random tokens (13 blocks):
# on the tiny llama its three layers err 0.90%, 0.57%, 0.41% as given and 0.61%, 0.39%, 0.29% with 1 + 1 blocks
BASE = dict(block_size=16, k_clusters=2, topk_blocks=0, peak_blocks=0, min_seq_len=0, backend="torch")
LADDER = [{"topk_blocks": 1, "peak_blocks": 1}]
TARGET = 0.0045


def ids(n=200, seed=0):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def calibrated(target=TARGET, ladder=LADDER, **kw):
    model = tiny_model("llama")
    cal = lp.calibrate(model, "muse", ids(), target_error=target, ladder=ladder, **{**BASE, **kw})
    return model, cal


@pytest.fixture(scope="module")
def run():
    return calibrated()


def measured_errors(model) -> dict[int, float]:
    """Each patched layer's error on the calibration text's Q/K/V (the unpatched model's: a fresh tiny llama of the
    same weights), as its module computes a long prefill, against exact attention in fp32."""
    got = capture(tiny_model("llama"), ids())
    mods = patched_modules(model)
    out = {}
    with torch.no_grad():
        for i, (q, k, v, _) in got.items():
            o = mods[i].approximate(q, k, v) if mods[i].method_name == "muse" else mods[i].attend(q, k, v, None, None)
            out[i] = relative_error(o, softmax_attention(q.float(), k.float(), v.float(), scale=mods[i].scaling))
    return out


def test_the_calibration_meets_its_target_on_its_text(run):
    model, cal = run
    errors = measured_errors(model)
    assert set(errors) == {0, 1, 2}
    for x in cal.layers:
        assert errors[x.layer] <= TARGET, (x, errors)
        assert errors[x.layer] == pytest.approx(x.error, rel=1e-6, abs=1e-9)
    # budget goes where it is needed: layer 0 (0.90% as given, 0.61% at the richest setting) runs exact attention,
    # layer 1 the richer setting, layer 2 the options as given (0.41% already meets the target)
    assert [(x.method, x.overrides) for x in cal.layers] == [
        ("exact", {}), ("muse", {"topk_blocks": 1, "peak_blocks": 1}), ("muse", {})]
    assert patched_layers(model) == {0: "exact", 1: "muse", 2: "muse"}
    assert cal.met and all(x.met for x in cal.layers)
    assert max(x.base_error for x in cal.layers) > TARGET  # the options as given miss it
    costs = [x.cost for x in cal.layers]
    assert costs[0] == cal.layers[0].exact_cost > costs[1] > costs[2] == cal.layers[2].base_cost
    table = cal.table()
    assert "met" in table and "exact attention on layers [0]" in table


def test_the_calibration_is_deterministic(run):
    model, cal = run
    model2, cal2 = calibrated()
    assert cal2.to_record() == cal.to_record()
    assert [(g.method, g.config.to_dict(), g.layers) for g in patch_groups(model2)] == \
        [(g.method, g.config.to_dict(), g.layers) for g in patch_groups(model)]


def test_the_calibration_saves_and_loads_exactly(run, tmp_path):
    model, cal = run
    lp.save_patched(model, tmp_path)
    rec = json.loads((tmp_path / "longctx_patch.json").read_text())
    assert rec["format"] == 1 and rec["calibration"] == cal.to_record()
    assert len(rec["patches"]) == 3  # exact on 0, muse 1 + 1 on 1, muse as given on 2
    loaded = lp.load_patched(tmp_path, device="cpu")
    assert calibration_record(loaded) == cal.to_record()
    assert Calibration.from_record(calibration_record(loaded)) == cal
    assert [(g.method, g.config, g.layers) for g in patch_groups(loaded)] == \
        [(g.method, g.config, g.layers) for g in patch_groups(model)]
    with torch.no_grad():
        assert torch.equal(loaded(ids(), use_cache=False).logits, model(ids(), use_cache=False).logits)
    # a damaged calibration is named; a record without the key (an older save, an uncalibrated patch) loads as before
    rec["calibration"] = [1, 2]
    (tmp_path / "longctx_patch.json").write_text(json.dumps(rec))
    with pytest.raises(lp.CheckpointError, match='"calibration" is'):
        lp.load_patched(tmp_path, device="cpu")
    del rec["calibration"]
    (tmp_path / "longctx_patch.json").write_text(json.dumps(rec))
    assert calibration_record(lp.load_patched(tmp_path, device="cpu")) is None


def test_a_layer_no_setting_meets_falls_back_to_exact():
    """0.2% is below every setting's error on every layer (per head too: three exact heads of four cost more than the
    layer exact): the layers run exact attention and meet it."""
    model, cal = calibrated(target=0.002)
    assert [x.method for x in cal.layers] == ["exact"] * 3 and patched_layers(model) == {0: "exact", 1: "exact", 2: "exact"}
    assert cal.met and all(x.error <= 0.002 for x in cal.layers)
    assert [g.method for g in patch_groups(model)] == ["exact"]


def test_exact_heads_are_chosen_where_they_pay():
    """The options as given alone: layer 2 meets 0.36% with its worst head exact (0.35%, for 278.5 keys a query of
    the exact layer's 402); layers 0 and 1 would need three heads, dearer than exact."""
    model, cal = calibrated(target=0.0036, ladder=[])
    assert [(x.method, x.overrides) for x in cal.layers] == [("exact", {}), ("exact", {}), ("muse", {"exact_heads": [0]})]
    errors = measured_errors(model)
    assert errors[2] <= 0.0036 and errors[2] == pytest.approx(cal.layers[2].error, rel=1e-6)
    assert patched_modules(model)[2].method_config.exact_heads == [0]


def test_the_mean_objective_spends_where_error_falls_fastest(run):
    """objective 'mean': the mean over the layers meets the target, a layer may not (layer 1 stays at its 0.57%), and
    it costs less than every layer meeting it."""
    model, cal = calibrated(objective="mean")
    assert cal.mean_error <= TARGET and cal.met and cal.max_error > TARGET
    assert [(x.method, x.overrides) for x in cal.layers] == [("exact", {}), ("muse", {}), ("muse", {})]
    assert sum(measured_errors(model).values()) / 3 <= TARGET
    assert sum(x.cost for x in cal.layers) < sum(x.cost for x in run[1].layers)
    assert "exact attention on layers [0]: the steps that lower the mean most" in cal.table()


@pytest.mark.parametrize("target", [0, -0.1, 1, 1.5, math.nan, math.inf, "0.01", True, None])
def test_bad_targets_are_refused(target):
    with pytest.raises(ConfigError, match="target_error"):
        lp.calibrate(tiny_model("llama"), "muse", ids(), target_error=target, **BASE)


@pytest.mark.parametrize("kw,error,needle", [
    (dict(objective="median"), ConfigError, "objective"),
    (dict(cost="flops"), ConfigError, "cost"),
    (dict(cost="time"), DeviceError, "CUDA"),
    (dict(exact_heads=[0]), ConfigError, "exact_heads is what calibrate chooses"),
    (dict(ladder=[{"exact_heads": [1]}]), ConfigError, "ladder"),
    (dict(ladder=[{"topk_blocks": -1}]), ConfigError, "topk_blocks"),
    (dict(text=None), ConfigError, "needs a text"),
    (dict(text="some words"), ConfigError, "tokenizer"),
    (dict(text=ids(40)), ConfigError, "40 tokens"),  # blocks of 32: the own and local blocks hold all 40
    (dict(length=0), ConfigError, "length"),
    (dict(per_head="yes"), ConfigError, "per_head"),
])
def test_bad_input_is_refused_before_anything_changes(kw, error, needle):
    model = tiny_model("llama")
    text = kw.pop("text", ids())
    if needle == "40 tokens":
        kw["block_size"] = 32
    with pytest.raises(error, match=needle):
        lp.calibrate(model, "muse", text, target_error=0.01, **{**BASE, **kw})
    assert not lp.is_patched(model)


def test_a_patched_model_or_another_method_is_refused():
    model = lp.patch(tiny_model("llama"), "exact", layers=[0])
    with pytest.raises(AlreadyPatchedError, match="unpatch"):
        lp.calibrate(model, "muse", ids(), **BASE)
    with pytest.raises(ConfigError, match="no budgets to calibrate"):
        lp.calibrate(tiny_model("llama"), "sliding-window", ids(), window=8)


@pytest.mark.parametrize("cfg", [
    dict(block_size=32, k_clusters=4, topk_blocks=2, peak_blocks=1, local_blocks=1, sink_blocks=1),
    dict(block_size=32, k_clusters=4, topk_blocks=1, peak_blocks=3, local_blocks=2, sink_blocks=2),
    dict(block_size=16, k_clusters=2, topk_blocks=0, peak_blocks=0, local_blocks=0, sink_blocks=1),
    dict(block_size=16, k_clusters=2, topk_blocks=30, peak_blocks=30, local_blocks=1, sink_blocks=1),
])
def test_attended_keys_count_the_cells_plan(cfg):
    """The cost model's key counts equal the plan's: per query block, its own block causally, the local blocks, the
    retrieved ones (`retrieved`) exact, k_clusters super-keys for each other far block."""
    S = 300
    q, k, _ = rand_qkv(1, 4, 2, S, 16)
    plan = make_cells_plan(q, k, scale=0.25, **cfg, backend="torch")
    L, nb = cfg["block_size"], plan.num_blocks
    ret = plan.retrieved.sum(-1).double()  # [B, Hq, nb]
    exact = sup = 0.0
    for n in range(nb):
        c = min(L, S - n * L)
        far = max(0, n - cfg["local_blocks"])
        exact += c * (c + 1) / 2 + c * min(cfg["local_blocks"], n) * L + c * L * ret[0, :, n].mean().item()
        sup += c * (far - ret[0, :, n].mean().item()) * cfg["k_clusters"]
    got = attended_keys(S, far_field="cells", **cfg)
    assert got == pytest.approx((exact / S, sup / S), rel=1e-12)


def test_exact_heads_make_those_heads_exact():
    """exact_heads (query heads; GQA: each with its kv head) are exact attention, the other heads MuSe's; a head
    past the layer's count is refused before the model changes; '0+3' and '0,3' are the same list."""
    m = lp.get_method("muse")
    assert m.parse_config({"exact_heads": "3,0"}).exact_heads == m.parse_config({"exact_heads": "0+3"}).exact_heads == [0, 3]
    with pytest.raises(ConfigError, match="exact_heads"):
        m.parse_config({"exact_heads": "one"})
    with pytest.raises(ConfigError, match="negative"):
        m.parse_config({"exact_heads": [-1]})
    with pytest.raises(ConfigError, match="4 query heads"):
        lp.patch(tiny_model("llama"), "muse", exact_heads=[4], **BASE)
    q, k, v = rand_qkv(1, 4, 2, 100, 16, seed=3)
    # the guard off: on random Q/K/V it would make every head exact (tests/test_muse_guard.py checks the two together)
    plain = m.parse_config({**BASE, "guard_error": None})
    some = m.parse_config({**BASE, "exact_heads": [1, 2], "guard_error": None})
    mod = m.module_cls
    o_plain, o_some = (mod.op(q, k, v, scale=0.25, config=c) for c in (plain, some))
    exact = softmax_attention(q, k, v, scale=0.25)
    assert torch.equal(o_some[:, :, [0, 3]], o_plain[:, :, [0, 3]])
    torch.testing.assert_close(o_some[:, :, [1, 2]], exact[:, :, [1, 2]], rtol=1e-6, atol=1e-6)
    assert (o_plain[:, :, [1, 2]] - exact[:, :, [1, 2]]).abs().max() > 1e-4  # MuSe approximates those heads otherwise
