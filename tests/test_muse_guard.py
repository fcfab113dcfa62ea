"""MuSe's run-time guard (longctx_patch/methods/muse/guard.py): its sampled estimate tracks each head's true error on
random and structured inputs; a head over budget gets exact attention for the call and the others keep MuSe's output
bit for bit; padded batches decide per row as the prompts alone; GQA 7:1, bf16, both backends; torch's RNG state is
untouched; guard_error=None / 0 is the unguarded path bit for bit; a calibrated patch keeps its choices and the guard
only adds; what it did is recorded per thread, never on the model."""

import os
import threading

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import longctx_patch as lp  # noqa: E402
from longctx_patch.errors import ConfigError  # noqa: E402
from longctx_patch.kernels.muse import muse_attention  # noqa: E402
from longctx_patch.kernels.softmax import softmax_attention  # noqa: E402
from longctx_patch.methods.muse import guard as guard_mod  # noqa: E402
from longctx_patch.methods.muse.attention import with_exact_heads  # noqa: E402
from longctx_patch.methods.muse.guard import (estimate_errors, first_approximated, guard, guard_log,  # noqa: E402
                                              sample_ranks, sampled_rows)

from conftest import left_padded_prompts, tiny_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:muse. the model is on the CPU")

# a crude MuSe on small inputs (blocks of 16, 2 cells, 1 + 1 retrieved blocks): queries from token 80 on approximate
CRUDE = dict(far_field="cells", block_size=16, k_clusters=2, topk_blocks=1, peak_blocks=1, min_seq_len=0,
             exact_tail=0, backend="torch")
D = 16
SCALE = D ** -0.5


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def config(**kw):
    return lp.get_method("muse").parse_config({**CRUDE, **kw})


def muse(q, k, v, cfg, *, key_mask=None, backend=None):
    """MuSe's output under `cfg` (its kernel options and backend, or `backend`), as the patched module computes it."""
    return muse_attention(q, k, v, scale=SCALE, options=cfg.kernel_options(), key_mask=key_mask,
                          backend=backend or cfg.backend)


def true_errors(o, q, k, v, first, km=None):
    """Each (row, head)'s relative error over the approximated rows (rank >= first among the row's real tokens)
    against exact attention in float64: [B, Hq]."""
    ref = softmax_attention(q.double(), k.double(), v.double(), scale=SCALE, key_mask=km)
    B, S = q.shape[0], q.shape[2]
    rank = torch.arange(S).expand(B, S) if km is None else km.long().cumsum(1) - 1
    keep = (rank >= first) if km is None else (rank >= first) & km
    d = ((o.double() - ref).pow(2).sum(-1) * keep[..., None]).sum(1)
    n = (ref.pow(2).sum(-1) * keep[..., None]).sum(1)
    return (d / n).sqrt()


def graded(Hq=4, Hkv=2, S=320, seed=0, dtype=torch.float32):
    """Random q, k, v whose query heads run from nearly flat attention (MuSe's cells summarise it well: ~3%
    error) to peaked (~40%): the query scale grows with the head."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, S, D, generator=g) for h in (Hq, Hkv, Hkv))
    q = q * torch.linspace(0.05, 0.6, Hq)[None, :, None, None]
    return q.to(dtype), k.to(dtype), v.to(dtype)


def structured(S=640, seed=0):
    """Heads with structure: kv head 0 topical keys (8 centres, a topic per 40-token span) read by a mild and a
    peaked topical query head; kv head 1 random keys read by a flat head and an induction head whose every query
    finds one key 150 tokens back (a few far keys carry its attention: MuSe's worst case)."""
    g = torch.Generator().manual_seed(seed)
    n = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    cent = 1.5 * n(8, D)
    topic = (torch.arange(S) // 40) % 8
    k = torch.stack([cent[topic] + 0.5 * n(S, D), n(S, D)])[None]
    v = n(1, 2, S, D)
    q = torch.stack([0.3 * cent[topic] + 0.5 * n(S, D), cent[topic] + 0.5 * n(S, D), 0.2 * n(S, D),
                     0.5 * n(S, D)])[None]
    q[0, 3, 150:] += 2.5 * k[0, 1, :S - 150]
    return q, k, v


# ----------------------------------------------------------------------------------------------- the sample
def test_the_sample_is_stratified_over_the_approximated_rows():
    ranks, weights = sample_ranks(400, 80, 16)
    assert len(ranks) == 16 and sum(weights) == 320 and all(80 <= r < 400 for r in ranks)
    assert all(80 + i * 20 <= r < 80 + (i + 1) * 20 for i, r in enumerate(ranks))  # one per stratum of 20
    assert len({r % 16 for r in ranks}) >= 10  # offsets spread over the positions in a block (not all at one)
    assert sample_ranks(90, 80, 16) == (list(range(80, 90)), [1] * 10)  # fewer than 16: all, weight 1
    assert sample_ranks(80, 80, 16) == ([], [])
    # per head: the rows of largest MuSe output among the approximated ones (a quarter: 4 of 16), then 12 stratified
    # ones standing for the rest; a left-padded row samples the columns of its real tokens (the prompt's ranks)
    o = 0.1 * torch.randn(2, 400, 2, 4, generator=torch.Generator().manual_seed(0))
    o[:, 300, 0] = 5.0  # head 0's largest output
    o[:, 50, 1] = 9.0  # before token 80: attended exactly, never sampled
    km = torch.ones(2, 400, dtype=torch.bool)
    km[1, :37] = False
    o[1, :37] = 50.0  # padding: never sampled
    pos, w, counts = sampled_rows(o, km, 80, 16)
    assert counts == [16, 16] and pos.shape == w.shape == (2, 2, 16)
    strat = sample_ranks(400, 80, 12)[0]
    assert pos[0, :, :12].tolist() == [strat, strat] and (pos[1, :, :12] - 37).tolist() == [sample_ranks(363, 80, 12)[0]] * 2
    assert 300 in pos[0, 0, 12:].tolist() and (w[:, :, 12:] == 1).all()
    assert (pos[0] >= 80).all() and (pos[1] >= 37 + 80).all()
    torch.testing.assert_close(w.sum(-1), torch.tensor([[320.0, 320.0], [283.0, 283.0]]))  # the approximated rows
    # a stratified row that is also a top row counts once: it is dropped from the stratified part
    o2 = o.clone()
    o2[0, strat[3], 1] = 7.0
    pos2, w2, _ = sampled_rows(o2, None, 80, 16)
    assert w2[0, 1, 3] == 0 and strat[3] in pos2[0, 1, 12:].tolist()
    torch.testing.assert_close(w2[0].sum(-1), torch.tensor([320.0, 320.0]))


def test_a_batch_of_a_long_and_a_short_row_samples_each_as_alone():
    """Rows of 320 and 96 real tokens (left padding 224, whole blocks: MuSe's output is the prompt's alone): the long
    one samples 16 of its 240 approximated rows (4 top, 12 stratified), the short one all of its 16; each row's
    estimate is what it gets alone (the filler columns weigh nothing)."""
    cfg = config()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, h, 320, D, generator=g) * 0.5 for h in (4, 2, 2))
    km = torch.ones(2, 320, dtype=torch.bool)
    km[1, :224] = False
    o = muse(q, k, v, cfg, key_mask=km)
    pos, w, counts = sampled_rows(o, km, 80, 16)
    assert counts == [16, 16] and pos.shape[-1] == 20
    torch.testing.assert_close(w.sum(-1), torch.tensor([[240.0] * 4, [16.0] * 4]))
    assert (w[1, :, 16:] == 0).all() and (w[1, :, :16] == 1).all() and (pos[1, :, :16] == torch.arange(304, 320)).all()
    est, _ = estimate_errors(o, q, k, v, km, scale=SCALE, first=80, rows=16)
    assert torch.isfinite(est).all()
    for r, cols in ((0, slice(None)), (1, slice(224, None))):
        o1 = muse(q[r:r + 1, :, cols], k[r:r + 1, :, cols], v[r:r + 1, :, cols], cfg)
        alone, _ = estimate_errors(o1, q[r:r + 1, :, cols], k[r:r + 1, :, cols], v[r:r + 1, :, cols], None,
                                   scale=SCALE, first=80, rows=16)
        torch.testing.assert_close(est[r], alone[0], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("inputs", ["random", "structured"])
def test_the_estimate_tracks_each_heads_true_error(inputs):
    """64 sampled rows estimate every head's error over the approximated rows within 25% (measured: up to 24%), over
    errors from 3% to 78%; with every approximated row sampled the estimate is the true error."""
    cfg = config()
    first = first_approximated(cfg)
    assert first == 80
    cases = [graded(seed=s) for s in range(2)] if inputs == "random" else [structured(seed=s) for s in range(2)]
    for q, k, v in cases:
        o = muse(q, k, v, cfg)
        true = true_errors(o, q, k, v, first).float()
        assert true.max() > 4 * true.min() and true.max() > 0.3  # a range of errors to track
        est, counts = estimate_errors(o, q, k, v, None, scale=SCALE, first=first, rows=64)
        assert counts == [64]
        ratio = est / true
        assert ratio.min() > 0.75 and ratio.max() < 1.33, (est, true)
        assert est.argmax() == true.argmax() and est.argmin() == true.argmin()
        every, _ = estimate_errors(o, q, k, v, None, scale=SCALE, first=first, rows=q.shape[2])
        torch.testing.assert_close(every, true, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------------------------- the action
def check_guarded(q, k, v, cfg, budget, *, bf16_atol=None, o=None):
    """Runs the guard at `budget` over MuSe's output `o` (default: computed here): the heads whose estimate is over
    it are exact attention (as with_exact_heads computes it), the others bit-identical to MuSe's output. Returns
    (the estimate, the heads made exact)."""
    first = first_approximated(cfg)
    if o is None:
        o = muse(q, k, v, cfg)
    est, _ = estimate_errors(o, q, k, v, None, scale=SCALE, first=first, rows=cfg.guard_rows)
    bad = [h for h in range(q.shape[1]) if est[0, h] > budget]
    with guard_log() as log:
        g = guard(o, q, k, v, None, config=cfg, scale=SCALE)
    assert log.calls[0].exact == [(0, h) for h in bad]
    good = [h for h in range(q.shape[1]) if h not in bad]
    assert torch.equal(g[:, :, good], o[:, :, good])
    exact = softmax_attention(q, k, v, scale=SCALE)
    torch.testing.assert_close(g[:, :, bad], exact[:, :, bad], rtol=0, atol=bf16_atol or 1e-6)
    return est, bad


def test_a_head_over_budget_is_made_exact_and_the_others_are_untouched():
    cfg = config(guard_error=0.1)
    q, k, v = graded()
    est, bad = check_guarded(q, k, v, cfg, 0.1)
    assert bad == [1, 2, 3] and est[0, 0] < 0.05  # the flat head stays MuSe
    # a budget above every head: MuSe's output itself, no copy
    o = muse(q, k, v, cfg)
    assert guard(o, q, k, v, None, config=config(guard_error=0.9), scale=SCALE) is o


def test_an_adversarial_head_is_caught_among_good_ones():
    """The structured inputs at a 20% budget: only the induction head (65-78% error) is made exact."""
    q, k, v = structured()
    _, bad = check_guarded(q, k, v, config(guard_error=0.2), 0.2)
    assert bad == [3]


def test_gqa_seven_query_heads_per_kv_head():
    cfg = config(guard_error=0.15)
    q, k, v = graded(Hq=14, Hkv=2)
    o = muse(q, k, v, cfg)
    true = true_errors(o, q, k, v, first_approximated(cfg)).float()
    est, bad = check_guarded(q, k, v, cfg, 0.15)
    assert 3 <= len(bad) <= 11 and bad == [h for h in range(14) if true[0, h] > 0.15 or est[0, h] > 0.15]
    assert {h // 7 for h in bad} == {0, 1}  # heads of both kv groups, each with its own kv head
    assert (est / true).min() > 0.75 and (est / true).max() < 1.33


def test_bf16():
    """bf16 inputs: the estimate (fp32 reference on the bf16 inputs) tracks the true error, and the heads over budget
    equal with_exact_heads' bf16 exact attention."""
    cfg = config(guard_error=0.1)
    q, k, v = graded(dtype=torch.bfloat16)
    o = muse(q, k, v, cfg)
    assert o.dtype == torch.bfloat16
    true = true_errors(o, q, k, v, first_approximated(cfg)).float()
    est, bad = check_guarded(q, k, v, cfg, 0.1, bf16_atol=1e-2)
    assert bad == [1, 2, 3]
    assert (est / true).min() > 0.75 and (est / true).max() < 1.33
    g = guard(o, q, k, v, None, config=cfg, scale=SCALE)
    assert g.dtype == torch.bfloat16
    assert torch.equal(g[:, :, bad], with_exact_heads(o, q, k, v, bad, scale=SCALE)[:, :, bad])


def test_triton_backend_under_the_interpreter():
    """The guard reads MuSe's output whatever computed it: the tilted far field's Triton kernels (block 16, 4 x 4
    clusters, nothing retrieved)."""
    cfg = lp.get_method("muse").parse_config(dict(far_field="tilted", block_size=16, q_clusters=4, k_clusters=4,
                                                  topk_blocks=0, topk_clusters=1, min_seq_len=0, exact_tail=0,
                                                  backend="triton", guard_error=0.1, guard_rows=24))
    q, k, v = graded(S=96)
    first = first_approximated(cfg)
    assert first == 32
    o = muse(q, k, v, cfg)
    torch.testing.assert_close(o, muse(q, k, v, cfg, backend="torch"), rtol=1e-4, atol=1e-5)  # it ran the kernels
    true = true_errors(o, q, k, v, first).float()
    est, bad = check_guarded(q, k, v, cfg, 0.1, o=o)
    assert 0 < len(bad) < 4 and (est / true).min() > 0.75 and (est / true).max() < 1.33


# ----------------------------------------------------------------------------------------------- the module
def logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, use_cache=False, **kw).logits


def test_guard_off_is_the_unguarded_path_bit_for_bit():
    """guard_error None and 0 compute what the module computed before the guard (MuSe, then exact_heads), with no
    estimate; the op entry point too."""
    calls = []
    orig = guard_mod.exact_rows
    guard_mod.exact_rows = lambda *a, **kw: calls.append(1) or orig(*a, **kw)
    try:
        q, k, v = graded()
        for off in (None, 0, 0.0):
            cfg = config(guard_error=off, exact_heads=[2])
            before = with_exact_heads(muse(q, k, v, cfg), q, k, v, [2], scale=SCALE)
            assert torch.equal(lp.get_method("muse").module_cls.op(q, k, v, scale=SCALE, config=cfg), before)
            model = lp.patch(tiny_model("llama"), "muse", **{**CRUDE, "guard_error": off, "exact_heads": [2]})
            mod = lp.patcher.patched_modules(model)[1]
            assert torch.equal(mod.approximate(q, k, v), before)
        assert calls == []
        # and on: measured, and different (random Q/K/V: every head above 10% but the flat one)
        on = config(guard_error=0.1, exact_heads=[2])
        assert not torch.equal(lp.get_method("muse").module_cls.op(q, k, v, scale=SCALE, config=on), before)
        assert calls
    finally:
        guard_mod.exact_rows = orig


def test_a_model_with_nothing_over_budget_is_bit_identical_and_rng_is_untouched():
    """On the tiny llama (200 tokens, heads err 0.2-1.5%), a 5% budget finds nothing: the logits are those of the
    guard off bit for bit; a 0.5% budget makes some heads exact and changes them. No call draws from torch's RNG."""
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    off = logits(lp.patch(tiny_model("llama"), "muse", **dict(CRUDE, guard_error=None)), ids)
    model = lp.patch(tiny_model("llama"), "muse", **dict(CRUDE, guard_error=0.05))
    state = torch.get_rng_state()
    with guard_log() as log:
        on = logits(model, ids)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(on, off) and log.measured() == 12 and not log.exact_heads()  # 3 layers x 4 heads
    low = lp.patch(tiny_model("llama"), "muse", **dict(CRUDE, guard_error=0.005))
    with guard_log() as log:
        tight = logits(low, ids)
    assert torch.equal(torch.get_rng_state(), state)
    assert log.exact_heads() and not torch.equal(tight, off)
    exact = logits(tiny_model("llama"), ids)
    assert (tight - exact).abs().max() < (off - exact).abs().max()  # closer to the unpatched model
    with guard_log() as again:
        assert torch.equal(logits(low, ids), tight)  # deterministic
    assert [c.exact for c in again.calls] == [c.exact for c in log.calls]


def test_padded_rows_decide_as_the_prompts_alone():
    """A left-padded batch (paddings 0, 7, 17 and 60 with blocks of 16): each row's guard samples, measures and
    decides as its prompt alone, and its logits are the prompt's alone (1e-4)."""
    model = lp.patch(tiny_model("llama"), "muse", **dict(CRUDE, guard_error=0.006))
    lens = (200, 193, 183, 140)
    prompts, ids, am = left_padded_prompts(lens, seed=4)
    L = max(lens)
    with guard_log() as log:
        batch = logits(model, ids, attention_mask=am, position_ids=(am.cumsum(1) - 1).clamp_min(0))
    decided = {}
    for c in log.calls:
        for j, r in enumerate(c.rows):
            decided[(c.layer, r)] = (c.sampled[j], sorted(h for rr, h in c.exact if rr == r))
    some = 0
    for r, p in enumerate(prompts):
        with guard_log() as alone_log:
            alone = logits(model, p[None])
        (torch.testing.assert_close(batch[r, L - len(p):], alone[0], rtol=1e-4, atol=1e-4))
        for c in alone_log.calls:
            assert decided[(c.layer, r)] == (c.sampled[0], sorted(h for _, h in c.exact)), (r, c.layer)
            some += len(c.exact)
    assert some > 0  # the budget made heads exact in some rows


def test_a_calibrated_patch_keeps_its_choices_and_the_guard_only_adds():
    """calibrate's exact layers run exact attention (no MuSe call, no guard) and its exact heads are not measured;
    the guard makes other heads exact on top. The calibration's own measurement runs MuSe unguarded."""
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    model = tiny_model("llama")
    base = dict(block_size=16, k_clusters=2, topk_blocks=0, peak_blocks=0, min_seq_len=0, backend="torch")
    cal = lp.calibrate(model, "muse", ids, target_error=0.0036, ladder=[], **base, guard_error=0.0051)
    assert [(x.method, x.overrides) for x in cal.layers] == [("exact", {}), ("exact", {}), ("muse", {"exact_heads": [0]})]
    with guard_log() as log:
        logits(model, ids)
    assert [c.layer for c in log.calls] == [2]
    assert log.calls[0].errors[0][0] is None and all(e is not None for e in log.calls[0].errors[0][1:])
    # its heads 1-3 are estimated at 0.49%, 0.52%, 0.49% on the approximated rows: a 0.51% budget adds head 2
    assert log.calls[0].exact == [(0, 2)]


def test_the_log_is_per_thread_and_nothing_is_kept_on_the_model():
    model = lp.patch(tiny_model("llama"), "muse", **dict(CRUDE, guard_error=0.005))
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    before = {n: set(vars(m)) for n, m in model.named_modules()}
    other = []

    def run():
        with guard_log() as log:
            logits(model, ids)
        other.append(log)

    with guard_log() as mine:
        t = threading.Thread(target=run)
        t.start()
        t.join()
    assert not mine.calls and len(other[0].calls) == 3  # the thread's calls went to its own log only
    with guard_log() as mine:
        logits(model, ids)
    assert [c.exact for c in mine.calls] == [c.exact for c in other[0].calls]
    assert {n: set(vars(m)) for n, m in model.named_modules()} == before
    text = mine.summary()
    assert "made exact" in text and "worst estimate" in text and "layer" in mine.table()


# ----------------------------------------------------------------------------------------------- the options
@pytest.mark.parametrize("value, needle", [(-0.1, "guard_error"), (1.0, r"\[0, 1\)"), (1.5, r"\[0, 1\)"),
                                           (float("nan"), "finite"), ("lots", "guard_error"), (True, "guard_error")])
def test_bad_budgets_are_refused_by_name(value, needle):
    with pytest.raises(ConfigError, match=needle):
        lp.get_method("muse").parse_config({"guard_error": value})


def test_options():
    m = lp.get_method("muse")
    assert m.parse_config({}).guard_error == guard_mod.GUARD_ERROR and m.parse_config({}).guard_rows == 64
    assert m.parse_config({"guard_error": "none"}).guard_error is None
    assert m.parse_config({"guard_error": "0.02", "guard_rows": "32"}).guard_rows == 32
    for bad in (0, 5000, "x"):
        with pytest.raises(ConfigError, match="guard_rows"):
            m.parse_config({"guard_rows": bad})
