"""muse method: config validation, patched models (prefill through MuSe, exact decode), unpatch, training."""

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import longctx_patch as lp  # noqa: E402
from longctx_patch.errors import ConfigError  # noqa: E402
from longctx_patch.kernels.muse import make_plan, muse_reference_planned  # noqa: E402
from longctx_patch.kernels.muse.ops import muse_triton_planned  # noqa: E402
from longctx_patch.methods import get_method  # noqa: E402

from conftest import assert_left_padded_batch_matches_single, tiny_model  # noqa: E402

SMALL = dict(far_field="tilted", block_size=16, q_clusters=2, k_clusters=8, min_seq_len=0, exact_tail=0)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_config_validation():
    m = get_method("muse")
    cfg = m.parse_config({"far_field": "tilted", "block_size": "32", "dipole": "true"})
    assert cfg.block_size == 32 and cfg.dipole is True
    # far-field-dependent defaults: the cells ones unless far_field=tilted, and a value set wins
    cells, tilted = m.parse_config({}), m.parse_config({"far_field": "tilted"})
    assert cells.far_field == "cells" and cells.kernel_kwargs()["block_size"] == 256
    # the kernel's options: the same settings, the backend passed beside them
    opts = tilted.kernel_options()
    assert (opts.far_field, opts.block_size, opts.q_clusters, opts.topk_blocks) == ("tilted", 128, 16, 4)
    assert {**dataclasses.asdict(opts), "backend": tilted.backend} == tilted.kernel_kwargs()
    assert (cells.get("k_clusters"), cells.get("topk_blocks"), cells.get("peak_blocks")) == (8, 10, 10)
    assert tilted.get("peak_blocks") == 0
    assert (tilted.get("block_size"), tilted.get("k_clusters"), tilted.get("topk_blocks")) == (128, 4, 4)
    assert m.parse_config({"topk_blocks": 3}).kernel_kwargs()["topk_blocks"] == 3
    # tilted-cells: the cells' plan defaults and 256 global query clusters; the tilted design's 16 per block
    tc = m.parse_config({"far_field": "tilted-cells"}).kernel_kwargs()
    assert (tc["block_size"], tc["k_clusters"], tc["topk_blocks"], tc["peak_blocks"], tc["q_clusters"]) == (256, 8, 10, 10, 256)
    assert tilted.kernel_kwargs()["q_clusters"] == 16
    assert m.parse_config({"far_field": "tilted-cells", "q_clusters": "64"}).kernel_kwargs()["q_clusters"] == 64
    with pytest.raises(ConfigError, match="dipole"):
        m.parse_config({"far_field": "tilted-cells", "dipole": True})
    with pytest.raises(ConfigError, match="k_clusters"):
        m.parse_config({"k_clusters": 512})  # > the cells' default block of 256
    with pytest.raises(ConfigError, match="unknown"):
        m.parse_config({"blocksize": 32})
    with pytest.raises(ConfigError, match="q_clusters"):
        m.parse_config({"far_field": "tilted", "block_size": 8, "q_clusters": 16})
    with pytest.raises(ConfigError, match="peak_blocks"):
        m.parse_config({"far_field": "tilted", "peak_blocks": 2})
    with pytest.raises(ConfigError, match="backend"):
        m.parse_config({"backend": "cuda"})
    with pytest.raises(ConfigError, match="kmeans_iters"):
        m.parse_config({"kmeans_iters": -1})


def test_patched_prefill_uses_muse_and_unpatch_is_bit_identical():
    model = tiny_model()
    ids = torch.randint(3, 128, (2, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits.clone()
    lp.patch(model, "muse", topk_blocks=0, topk_clusters=0, local_blocks=0, **SMALL)
    with torch.no_grad():
        approx = model(ids).logits
    lp.unpatch(model)
    lp.patch(model, "muse", topk_blocks=99, **SMALL)  # every earlier block exact: MuSe == exact attention
    with torch.no_grad():
        exact = model(ids).logits
    lp.unpatch(model)
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(after, before)
    assert not torch.allclose(approx, before, atol=1e-4)  # the approximation really ran
    assert rel(approx, before) < 0.2
    torch.testing.assert_close(exact, before, atol=2e-5, rtol=1e-4)


def test_short_prompts_and_decode_are_exact():
    """Below min_seq_len the prefill is exact; decode steps are always exact: greedy generation equals the
    unpatched model's; above it, generation runs and its decode steps attend exactly over the full cache."""
    model = tiny_model()
    x = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(x, **kw)
    lp.patch(model, "muse", **dict(SMALL, min_seq_len=64))
    with torch.no_grad():
        assert torch.equal(model.generate(x, **kw), ref)
    lp.unpatch(model)
    lp.patch(model, "muse", **SMALL)
    with torch.no_grad():
        got = model.generate(x, **kw)
        # the same tokens recomputed step by step: prefill of 40 through MuSe, then exact cached decode
        out = model(x, use_cache=True)
        cache, seq = out.past_key_values, x
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(8):
            seq = torch.cat([seq, nxt], 1)
            out = model(nxt, past_key_values=cache, use_cache=True)
            cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    assert torch.equal(got, seq)
    # a full KV cache (exact's preallocated buffer: 48 tokens seen, every one of them held)
    assert all(layer.seen == 48 and layer.capacity >= 48 and bool(layer.mask[:, :48].all()) for layer in cache.layers)


def test_generation_prefill_recomputes_the_tail_exactly():
    """One layer, so the logits of a position depend only on its own attention row: a prefill that fills a cache
    in eval mode gives the unpatched logits at its last `exact_tail` positions and MuSe's before them; without a
    cache, or in training mode, the tail is MuSe's too."""
    model = tiny_model(num_hidden_layers=1)
    ids = torch.randint(3, 128, (2, 70), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
    lp.patch(model, "muse", **dict(SMALL, topk_blocks=0, topk_clusters=0, local_blocks=0, exact_tail=9))
    with torch.no_grad():
        tail = model(ids, use_cache=True).logits
        plain = model(ids, use_cache=False).logits
    torch.testing.assert_close(tail[:, -9:], ref[:, -9:], atol=2e-5, rtol=1e-4)
    assert torch.equal(tail[:, :-9], plain[:, :-9])
    assert not torch.allclose(plain[:, -9:], ref[:, -9:], atol=1e-3)  # MuSe really approximates the tail
    with torch.enable_grad():  # the same with autograd on (the tail is joined, not written in place)
        torch.testing.assert_close(model(ids, use_cache=True).logits.detach(), tail)
    model.train()
    trained = model(ids, use_cache=True).logits  # with grad: the tail is not recomputed in training mode
    torch.testing.assert_close(trained, plain)


def test_left_padded_batch_matches_single_prompts_when_exact():
    model = tiny_model()
    lp.patch(model, "muse", topk_blocks=99, **SMALL)
    assert_left_padded_batch_matches_single(model, (37, 20), max_new_tokens=6)


def test_training_step_through_muse():
    model = tiny_model()
    model.train()
    lp.patch(model, "muse", layers=[0, 2], **SMALL)
    ids = torch.randint(3, 128, (2, 50), generator=torch.Generator().manual_seed(2))
    loss = model(ids, labels=ids).loss
    loss.backward()
    g = model.model.layers[0].self_attn.k_proj.weight.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
    assert type(model.model.layers[1].self_attn).__name__ != "MuseAttention"


@pytest.mark.slow
def test_triton_matches_reference_on_smollm2_qkv(smollm2):
    """Real post-rotary Q/K/V of SmolLM2 (9 query / 3 kv heads, D=64), odd length; fp32 and bf16."""
    from longctx_patch.evals.approx import capture

    model, tok = smollm2
    text = "The history of the river valley begins with farmers who planted barley along its banks. " * 6
    q0, k0, v0, _ = capture(model, tok(text, return_tensors="pt").input_ids[:, :51], layers=[5])[5]
    scale = 64**-0.5
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]:
        q, k, v = (t.to(dtype).requires_grad_(True) for t in (q0, k0, v0))
        plan = make_plan(q.detach(), k.detach(), scale=scale, block_size=16, q_clusters=2, k_clusters=8,
                         topk_blocks=1, topk_clusters=2)
        o_t = muse_triton_planned(q, k, v, plan, scale=scale)
        o_r = muse_reference_planned(q, k, v, plan, scale=scale)
        do = torch.randn(o_t.shape, generator=torch.Generator().manual_seed(0)).to(dtype)
        g_t = torch.autograd.grad(o_t, (q, k, v), do)
        g_r = torch.autograd.grad(o_r, (q, k, v), do)
        assert rel(o_t, o_r) < tol
        for a, b in zip(g_t, g_r):
            assert rel(a, b) < tol


@pytest.mark.slow
def test_smollm2_generate_with_muse_and_unpatch_identity(smollm2):
    model, tok = smollm2
    ids = tok("The quick brown fox jumps over the lazy dog. " * 30, return_tensors="pt").input_ids[:, :160]
    with torch.no_grad():
        before = model(ids).logits.clone()
    # 5 blocks of 32: each query block summarises at least one earlier block (1 local, 1 retrieved)
    lp.patch(model, "muse", far_field="tilted", block_size=32, q_clusters=4, k_clusters=4, topk_blocks=1, topk_clusters=2,
             min_seq_len=128, exact_tail=0)
    try:
        with torch.no_grad():
            patched = model(ids).logits
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
        assert out.shape == (1, 163)
        assert (patched - before).abs().max() > 1e-3  # 160 tokens > min_seq_len: the approximation ran
        agree = (patched.argmax(-1) == before.argmax(-1)).float().mean().item()
        assert agree > 0.9
    finally:
        lp.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_patching_a_cpu_model_warns_that_muse_runs_its_reference():
    """On the CPU MuSe runs its dense reference (slower than exact attention): patch() says so, once per call;
    backend='torch' (asking for the reference) does not warn."""
    import warnings

    with pytest.warns(UserWarning, match="dense PyTorch reference"):
        lp.patch(tiny_model("llama"), "muse", **SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lp.patch(tiny_model("llama"), "muse", **SMALL, backend="torch")
