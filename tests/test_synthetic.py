"""Synthetic benchmarks (ICR, ICL) and the from-scratch mixer model: generators, references, tiny training runs."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import re  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from longctx_patch.errors import ConfigError  # noqa: E402
from longctx_patch.evals import synthetic as syn  # noqa: E402
from longctx_patch.evals.synthetic import icl, icr  # noqa: E402
from longctx_patch.evals.synthetic import mixers as mixers_mod  # noqa: E402

SMALL_ICR = dict(num_keys=64, num_values=64, num_noise=16)


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------ ICR data
@pytest.mark.parametrize("variant", ["basic", "positional"])
@pytest.mark.parametrize("length", [64, 131, 512])
def test_icr_deterministic_and_recoverable(variant, length):
    cfg = icr.IcrConfig(variant=variant, **SMALL_ICR)
    a = icr.generate_icr(cfg, length, 3, seed=5)
    b = icr.generate_icr(cfg, length, 3, seed=5)
    c = icr.generate_icr(cfg, length, 3, seed=6)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert not torch.equal(a["input_ids"], c["input_ids"])
    ids, labels = a["input_ids"], a["labels"]
    assert ids.shape == labels.shape == (3, length)
    assert int(ids.max()) < cfg.vocab_size and int(ids.min()) >= 0
    P = cfg.num_pairs(length)
    for row in range(3):
        # every label is recomputed from the tokens alone
        assert torch.equal(icr.recover_answers(cfg, ids[row]), labels[row])
        m = labels[row] != icr.IGNORE
        pos = m.nonzero().flatten()
        # loss mask: exactly one answer per query, all after the context, each the next input token
        assert int(m.sum()) == cfg.num_queries(length)
        assert int(pos.min()) >= 2 * P
        assert torch.equal(labels[row, pos], ids[row, pos + 1])
        assert bool(((labels[row, pos] >= cfg.val0) & (labels[row, pos] < cfg.noise0)).all())
        # the queried token is a key; context holds keys at even, values at odd positions
        assert bool(((ids[row, pos] >= cfg.key0) & (ids[row, pos] < cfg.val0)).all())
        ctx = ids[row, : 2 * P]
        assert bool(((ctx[0::2] >= cfg.key0) & (ctx[0::2] < cfg.val0)).all())
        assert bool(((ctx[1::2] >= cfg.val0) & (ctx[1::2] < cfg.noise0)).all())
        if variant == "basic":
            assert len(set(ctx[0::2].tolist())) == P  # distinct keys
        else:
            keys = ctx[0::2].tolist()
            assert all(keys.count(k) == 2 for k in keys)  # each key twice ...
            for k in set(keys):
                i, j = [2 * n + 1 for n, kk in enumerate(keys) if kk == k]
                assert ctx[i] != ctx[j]  # ... with two different values
            sel = ids[row, pos - 1]
            assert bool(((sel == icr.FIRST) | (sel == icr.SECOND)).all())
            assert {icr.FIRST, icr.SECOND} <= set(sel.tolist()) or length < 128


def test_icr_positional_answer_depends_on_selector():
    cfg = icr.IcrConfig(variant="positional", **SMALL_ICR)
    ids = icr.generate_icr(cfg, 256, 1, seed=0)["input_ids"][0]
    labels = icr.recover_answers(cfg, ids)
    pos = (labels != icr.IGNORE).nonzero().flatten()
    flipped = ids.clone()
    t = int(pos[0])
    flipped[t - 1] = icr.SECOND if int(ids[t - 1]) == icr.FIRST else icr.FIRST
    assert icr.recover_answers(cfg, flipped)[t] != labels[t]


def test_icr_pairs_scale_and_errors():
    cfg = icr.IcrConfig()
    assert [cfg.num_pairs(L) for L in (512, 1024, 4096, 8192)] == [32, 64, 256, 512]
    with pytest.raises(ConfigError, match="variant"):
        icr.IcrConfig(variant="nope").validate()
    with pytest.raises(ConfigError, match="num_keys"):
        icr.IcrConfig(num_keys=8).check_length(1024)


# ------------------------------------------------------------------------------------------------ ICL data
def test_icl_generator_deterministic_consistent():
    cfg = icl.IclConfig(num_functions=5, dim=4, segment=3, noise=0.0)
    a = icl.generate_icl(cfg, 101, 2, seed=1)
    b = icl.generate_icl(cfg, 101, 2, seed=1)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    d = cfg.dim
    w = a["weights"]
    for row in range(2):
        xs = a["mask"][row].nonzero().flatten()
        assert len(xs) == 50 and bool((xs % 2 == 0).all())
        assert not bool(a["mask"][row, 100])  # the odd last position holds no example
        for t in xs.tolist():
            f = int(a["fn"][row, t])
            assert int(a["tags"][row, t]) == int(a["tags"][row, t + 1]) == f
            y = float(a["feats"][row, t, :d] @ w[row, f])
            assert abs(y - float(a["target"][row, t])) < 1e-5
            assert abs(y - float(a["feats"][row, t + 1, d])) < 1e-5  # revealed at the next position
            assert float(a["feats"][row, t, d]) == 0.0  # the answer is not in its own x token
            earlier = [u for u in xs.tolist() if u < t and int(a["fn"][row, u]) == f]
            assert int(a["shots"][row, t]) == len(earlier)
        # segments: runs of `segment` examples share one function
        fns = a["fn"][row, xs].tolist()
        for s0 in range(0, len(fns), cfg.segment):
            assert len(set(fns[s0 : s0 + cfg.segment])) == 1


def test_icl_answers_learnable_from_context():
    """The ideal learner (ridge on the earlier examples of the same tag) reaches ~0 error after dim shots."""
    cfg = icl.IclConfig(num_functions=3, dim=4, segment=2)
    batch = icl.generate_icl(cfg, 120, 2, seed=3)
    err = icl.least_squares_error(batch, cfg)
    late = batch["mask"] & (batch["shots"] >= cfg.dim + 1)
    early = batch["mask"] & (batch["shots"] == 0)
    assert float(err[late].max()) < 1e-3
    assert float(err[early].mean()) > 0.05


def test_icl_metrics_learned_functions():
    cfg = icl.IclConfig(num_functions=4, dim=2, segment=2, shot_bins=(0, 2))
    task = icl.IclTask(cfg)
    batch = task.sample(64, 2, seed=0)
    perfect = batch["target"][..., None].clone()
    res = task.finish(task.metric_sums(perfect, batch))
    assert res["mse"] == 0.0 and res["functions_learned"] == res["functions_measured"] > 0
    zero = task.finish(task.metric_sums(torch.zeros_like(perfect), batch))
    assert zero["mse"] > 0.2 and zero["functions_learned"] < zero["functions_measured"]
    assert [c["shots_from"] for c in zero["mse_by_shots"]] == [0, 2]
    with pytest.raises(ConfigError, match="num_functions"):
        icl.IclConfig(num_functions=129).validate()


# ------------------------------------------------------------------------------------------------ references
@pytest.mark.parametrize("S,chunk", [(37, 8), (64, 16), (5, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_attention_chunked_matches_reference(S, chunk, dtype):
    g = torch.Generator().manual_seed(0)
    fq = torch.rand(2, 3, S, 6, generator=g).to(dtype) + 0.1
    fk = torch.rand(2, 3, S, 6, generator=g).to(dtype) + 0.1
    v = torch.randn(2, 3, S, 5, generator=g).to(dtype)
    o = syn.causal_linear_attention(fq, fk, v, chunk=chunk)
    r = syn.linear_attention_ref(fq, fk, v)
    torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("S,chunk", [(37, 8), (48, 16), (7, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vq_attention_chunked_matches_reference(S, chunk, dtype):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, S, 8, generator=g).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(2, 2, S, 8, generator=g), dim=-1).to(dtype)
    v = torch.randn(2, 2, S, 8, generator=g).to(dtype)
    cb = torch.nn.functional.normalize(torch.randn(2, 5, 8, generator=g), dim=-1)
    o, assign = syn.vq_attention(q, k, v, cb, chunk=chunk)
    r = syn.vq_attention_ref(q, k, v, cb, chunk=chunk)
    torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4)
    assert assign.shape == (2, 2, S) and int(assign.max()) < 5


def test_vq_attention_gradients_match_reference():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 19, 4, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 19, 4, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 19, 4, generator=g, requires_grad=True)
    cb = torch.randn(2, 3, 4, generator=g, requires_grad=True)
    w = torch.randn(1, 2, 19, 4, generator=g)
    grads = []
    for fn in (lambda: syn.vq_attention(q, k, v, cb, chunk=4)[0], lambda: syn.vq_attention_ref(q, k, v, cb, chunk=4)):
        (fn() * w).sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v, cb)])
        for t in (q, k, v, cb):
            t.grad = None
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------ mixer specs
def test_parse_mixers():
    specs = syn.parse_mixers(["softmax,ovq(max_centroids=128,growth=64)", "sliding(window=32)"])
    assert [s.label for s in specs] == ["softmax", "ovq(max_centroids=128,growth=64.0)", "sliding(window=32)"]
    assert dict(specs[1].options) == {"max_centroids": 128, "growth": 64.0}
    assert specs[1].config.to_dict() == {"max_centroids": 128, "growth": 64.0, "chunk": 64, "beta": 4.0, "backend": "auto"}
    assert syn.parse_mixer(specs[1].label) == specs[1]  # a label parses back to its spec
    with pytest.raises(ConfigError, match="unknown mixer 'mamba'; choose from: softmax, sliding, linear"):
        syn.parse_mixer("mamba")
    with pytest.raises(ConfigError, match="unknown key.* window; allowed keys: max_centroids, growth, chunk, beta, backend"):
        syn.parse_mixer("ovq(window=3)")
    with pytest.raises(ConfigError, match="given twice"):
        syn.parse_mixers("softmax,softmax")
    with pytest.raises(ConfigError, match="chunk given twice"):
        syn.parse_mixer("ovq(chunk=32,chunk=64)")


@pytest.mark.parametrize("spec,match", [
    ("ovq(backend=cuda)", "bad value 'cuda' for backend; allowed: one of 'auto', 'torch', 'triton'"),
    ("sliding(window=0)", "bad value 0 for window; allowed: int >= 1"),
    ("softmax(qknorm=maybe)", "bad value 'maybe' for qknorm; allowed: bool"),
    ("vq(commit=-1)", "bad value -1.0 for commit; allowed: float >= 0.0"),
    ("ovq(growth=inf)", "growth=inf is not a finite number"),
    ("ovq(max_centroids=128", r"bad mixer .*write NAME or NAME\(KEY=VALUE,...\)"),
    ("ovq(chunk)", r"bad mixer .*write NAME or NAME\(KEY=VALUE,...\)"),
])
def test_mixer_spec_errors_name_the_allowed_values(spec, match):
    with pytest.raises(ConfigError, match=match):
        syn.parse_mixers(spec)


def test_mixer_spec_validates_when_built_directly():
    spec = syn.MixerSpec("OVQ", (("backend", "torch"), ("growth", 8)))
    assert spec.label == "ovq(backend=torch,growth=8.0)" and spec.config.growth == 8.0
    with pytest.raises(ConfigError, match="unknown key"):
        syn.MixerSpec("ovq", (("window", 3),))
    assert isinstance(syn.parse_mixer("lola").build(32, 2).config, mixers_mod.LolaMixerConfig)
    with pytest.raises(TypeError, match="LolaMixerConfig"):
        mixers_mod.LolaMixer(32, 2, syn.parse_mixer("lolcats").config)


OLD_AND_NEW = [
    ("softmax:qknorm=false,beta=2", "softmax(qknorm=false,beta=2)"),
    ("sliding:window=16", "sliding(window=16)"),
    ("hedgehog:chunk=16,feature_dim=8", "hedgehog(chunk=16,feature_dim=8)"),
    ("vq:codes=16,chunk=16,commit=0.5", "vq(codes=16,chunk=16,commit=0.5)"),
    ("ovq:max_centroids=16,growth=8,chunk=32", "ovq(max_centroids=16,growth=8,chunk=32)"),
    ("lola:window=16,chunk=16,feature_dim=8,sparse=8", "lola(window=16,chunk=16,feature_dim=8,sparse=8)"),
]


@pytest.mark.parametrize("old,new", OLD_AND_NEW)
def test_old_spec_form_builds_the_same_mixer(old, new):
    """The deprecated NAME:KEY=VALUE form gives the spec of NAME(KEY=VALUE,...) and says so; both build the same
    module (same parameters under the same seed, same outputs)."""
    with pytest.warns(FutureWarning, match=r"NAME:KEY=VALUE form is deprecated.*write " + re.escape(repr(new))):
        a = syn.parse_mixer(old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new form warns of nothing
        b = syn.parse_mixer(new)
    assert a == b and a.label == b.label and a.config == b.config
    mods = []
    for spec in (a, b):
        torch.manual_seed(0)
        mods.append(spec.build(32, 2).eval())
    sa, sb = mods[0].state_dict(), mods[1].state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    x = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(mods[0](x), mods[1](x))


def test_old_spec_form_in_a_list():
    with pytest.warns(FutureWarning):
        old = syn.parse_mixers("softmax,ovq:max_centroids=128,growth=64,sliding:window=32,linear")
    new = syn.parse_mixers("softmax,ovq(max_centroids=128,growth=64),sliding(window=32),linear")
    assert old == new and len(new) == 4


def test_state_bytes_ordering():
    def sb(spec, L):
        return syn.parse_mixer(spec).build(128, 2).state_bytes(L)

    assert sb("softmax", 4096) == 4096 * 2 * 2 * 64 * 2
    assert sb("softmax", 4096) == 2 * sb("softmax", 2048)  # grows with length
    for s in ("sliding", "linear", "hedgehog", "vq", "ovq", "lolcats", "lola"):
        assert sb(s, 65536) == sb(s, 131072), s  # bounded
    assert sb("ovq", 4096) <= 0.3 * sb("softmax", 4096)
    assert sb("lola", 4096) > sb("lolcats", 4096)


# ------------------------------------------------------------------------------------------------ tiny training
TINY = {
    "softmax": "softmax",
    "sliding": "sliding(window=16)",
    "linear": "linear(chunk=16)",
    "hedgehog": "hedgehog(chunk=16,feature_dim=8)",
    "vq": "vq(codes=16,chunk=16)",
    "ovq": "ovq(max_centroids=16,growth=8,chunk=32)",
    "lolcats": "lolcats(window=16,chunk=16,feature_dim=8)",
    "lola": "lola(window=16,chunk=16,feature_dim=8,sparse=8)",
}


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_training_loss_decreases(name):
    task = icr.IcrTask(icr.IcrConfig(num_keys=32, num_values=32, num_noise=8))
    mcfg = syn.ModelConfig(d_model=32, n_layers=2, n_heads=2, mlp_ratio=1)
    tcfg = syn.TrainConfig(steps=24, lrs=(1e-2,), tokens_per_step=256, eval_sequences=4, log_every=1, warmup=0.1)
    rec = syn.train_one(task, syn.parse_mixer(TINY[name]), [64], mcfg, tcfg, 1e-2, seed=0)
    assert not rec["diverged"]
    losses = [v for _, v in rec["losses"]]
    assert len(losses) == 24 and rec["steps_done"] == 24 and all(torch.isfinite(torch.tensor(losses)))
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < first - 0.2, (first, last)
    acc = rec["eval"]["64"]["accuracy"]
    assert 0.0 <= acc <= 1.0 and rec["eval"]["64"]["answers"] == 4 * 4
    assert rec["state_bytes"]["64"] > 0


def test_curriculum_trains_short_sequences_first(monkeypatch):
    task = icr.IcrTask(icr.IcrConfig(num_keys=32, num_values=32, num_noise=8))
    seen = []
    orig = task.sample

    def sample(length, batch, seed):
        seen.append((length, batch))
        return orig(length, batch, seed)

    monkeypatch.setattr(task, "sample", sample)
    mcfg = syn.ModelConfig(d_model=16, n_layers=1, n_heads=2, mlp_ratio=1)
    tcfg = syn.TrainConfig(steps=10, lrs=(1e-2,), tokens_per_step=256, eval_sequences=2, log_every=1,
                              curriculum_length=32, curriculum_fraction=0.4).validate()
    rec = syn.train_one(task, syn.parse_mixer("softmax"), [64, 128], mcfg, tcfg, 1e-2, seed=0)
    train = seen[:10]  # then the evaluation's batches
    assert train[:4] == [(32, 8)] * 4
    assert [L for L, _ in train[4:]] == [64, 128, 64, 128, 64, 128] and train[5] == (128, 2)
    assert rec["steps_done"] == 10 and set(rec["eval"]) == {"64", "128"}


def test_run_sweep_checks_the_curriculum_length():
    """A curriculum length the task cannot use (too short for its pairs with 1024 keys) is refused before any
    training starts, like the run's own lengths."""
    task = icr.IcrTask(icr.IcrConfig(num_keys=1024, num_values=32, num_noise=8))
    task.check_lengths([256])  # the run's length is fine
    mcfg = syn.ModelConfig(d_model=16, n_layers=1, n_heads=2, mlp_ratio=1)
    tcfg = syn.TrainConfig(steps=2, lrs=(1e-2,), tokens_per_step=256, eval_sequences=2,
                              curriculum_length=4, curriculum_fraction=0.5).validate()
    with pytest.raises(ConfigError):
        task.check_lengths([4])
    sampled = []
    orig = task.sample
    task.sample = lambda length, batch, seed: sampled.append(length) or orig(length, batch, seed)
    with pytest.raises(ConfigError):
        syn.run_sweep(task, [syn.parse_mixer("softmax")], [256], mcfg, tcfg, progress=False)
    assert sampled == []  # refused up front, not by the first training batch


def test_parse_curriculum():
    assert syn.parse_curriculum("256:0.3") == (256, 0.3)
    assert syn.parse_curriculum("1k:0.5") == (1024, 0.5)
    assert syn.parse_curriculum(None) == (None, 0.0)
    assert syn.parse_curriculum("none") == (None, 0.0)
    for bad in ("256", "256:1.5", "256:0", "x:0.2", "256:abc"):
        with pytest.raises(ConfigError, match="LENGTH:FRACTION|bad length"):
            syn.parse_curriculum(bad)
    with pytest.raises(ConfigError, match="curriculum fraction"):
        syn.TrainConfig(curriculum_length=64, curriculum_fraction=1.0).validate()


def test_tiny_icl_training_and_report(tmp_path):
    task = icl.IclTask(icl.IclConfig(num_functions=2, dim=2, segment=2, shot_bins=(0, 2, 4)))
    mcfg = syn.ModelConfig(d_model=16, n_layers=1, n_heads=2, mlp_ratio=1)
    tcfg = syn.TrainConfig(steps=12, lrs=(3e-3, 1e-2), tokens_per_step=128, eval_sequences=4, log_every=1)
    specs = syn.parse_mixers("softmax,linear(chunk=8)")
    recs = syn.run_sweep(task, specs, [32], mcfg, tcfg, progress=False)
    assert len(recs) == 4 and not any(r.get("error") for r in recs)
    for r in recs:
        losses = [v for _, v in r["losses"]]
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    text, summary = syn.write_report(tmp_path / "icl-smoke.json", task, specs, recs, [32], mcfg, tcfg,
                                        label="test", command="pytest")
    data = json.loads((tmp_path / "icl-smoke.json").read_text())
    for key in ("device", "date", "commit", "command", "summary", "runs"):
        assert key in data
    assert (tmp_path / "icl-smoke-length.png").stat().st_size > 0
    assert (tmp_path / "icl-smoke-state.png").stat().st_size > 0
    assert (tmp_path / "icl-smoke-shots.png").stat().st_size > 0
    assert data["plots"] == ["icl-smoke-length.png", "icl-smoke-state.png", "icl-smoke-shots.png"]
    assert data["mixer_options"] == {"softmax": {"qknorm": True, "beta": 4.0}, "linear(chunk=8)": {"chunk": 8}}
    assert summary["softmax"]["best_lr"] in (3e-3, 1e-2)
    assert "softmax" in text and "mse@32" in text
