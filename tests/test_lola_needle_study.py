"""benchmarks.quality.bench_lola_needle_study's probes on cases whose answer is known: a window over the whole prompt
(every pair exact: lola's needle share is the softmax mass, no linear term), no sparse cache under a small window (the
needle held only inside the window), a sparse cache whose slots the probe must find (its folded sum equal to the
linear state's), a prefill in chunks (the same figures), and the slot search itself."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import longctx_patch as lp
from benchmarks.quality.bench_lola_needle_study import NeedleProbe, layer_rows, slot_positions, top_heads

N = 40  # prompt tokens
NEEDLE = slice(10, 14)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 128, (N,), generator=torch.Generator().manual_seed(0)).tolist()


def probe(model, ids, method, needle=NEEDLE, prefill_chunk=None, **cfg):
    lp.patch(model, method, **cfg)
    try:
        with NeedleProbe(model, len(ids), needle) as p, torch.no_grad():
            x = torch.tensor([ids])
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=2, do_sample=False, pad_token_id=0,
                           prefill_chunk_size=prefill_chunk)
    finally:
        lp.unpatch(model)
    assert sorted(p.results) == [0, 1, 2]
    p.results["calls"] = p.prompt_calls
    return p.results


def test_a_window_over_the_whole_prompt_holds_every_pair(model, ids):
    exact = probe(model, ids, "exact")
    lola = probe(model, ids, "lola", checkpoint="none", window=64, sparse_cache=8, chunk=4)
    assert exact.pop("calls") == lola.pop("calls") == {0: 1, 1: 1, 2: 1}
    for L, d in lola.items():
        assert d["needle_held"] == d["needle_held_after_prefill"] == d["random_held"] == d["needle_in_window"] == 1.0
        assert d["sink_held"] == d["sink_held_after_prefill"] == 1.0
        assert torch.equal(d["linear_share"], torch.zeros(4)) and torch.equal(d["needle_linear"], torch.zeros(4))
        # all exact: the share of the normaliser on the needle is the softmax mass, the model's q / k the exact one's
        torch.testing.assert_close(d["needle_exact"], d["softmax_needle"])
        torch.testing.assert_close(d["sink_exact"], d["softmax_sink"])
        torch.testing.assert_close(d["softmax_sink"], exact[L]["exact_sink"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(d["softmax_needle"], exact[L]["exact_needle"], rtol=1e-4, atol=1e-5)
        assert d["unmatched"] == 0 and d["fold_check"] == 0.0
    rows, tops = layer_rows(exact, lola), top_heads(exact, lola)
    assert [r["layer"] for r in rows] == [0, 1, 2] and len(tops) == 5
    assert all(abs(r["exact_needle"] - r["needle_exact"]) < 1e-3 and r["linear_share"] == 0 for r in rows + tops)
    assert tops == sorted(tops, key=lambda t: -t["exact_needle"])


@pytest.mark.parametrize("needle, inside", [(NEEDLE, 0.0), (slice(37, 40), 1.0)])
def test_without_a_sparse_cache_the_needle_is_held_only_in_the_window(model, ids, needle, inside):
    lola = probe(model, ids, "lola", needle=needle, checkpoint="none", window=4, sparse_cache=0, chunk=4)
    lola.pop("calls")
    for d in lola.values():
        assert d["needle_held"] == d["needle_in_window"] == inside
        assert d["random_held"] == pytest.approx(4 / N)  # the window's share
        assert d["sink_held"] == d["sink_held_after_prefill"] == 0.0 and bool((d["sink_linear"] > 0).all())
        assert d["fold_check"] < 1e-5 and d["unmatched"] == 0
        assert bool((d["linear_share"] > 0.05).all())
        if inside == 0.0:
            assert torch.equal(d["needle_exact"], torch.zeros(4)) and bool((d["needle_linear"] > 0).all())
        else:
            assert torch.equal(d["needle_linear"], torch.zeros(4))
        total = d["needle_exact"] + d["needle_linear"]
        assert bool((total <= 1).all()) and bool((d["linear_share"] + d["needle_exact"] <= 1 + 1e-6).all())


def test_a_window_of_the_prompt_s_length_loses_the_first_token_at_the_first_decode_step(model, ids):
    lola = probe(model, ids, "lolcats", checkpoint="none", window=N)
    lola.pop("calls")
    for d in lola.values():
        assert d["sink_held"] == 1.0 and d["sink_held_after_prefill"] == 0.0
        assert d["needle_held"] == d["needle_held_after_prefill"] == 1.0


@pytest.mark.parametrize("combine", ["shifted", "unshifted"])
def test_the_sparse_cache_is_found_and_a_chunked_prefill_measures_the_same(model, ids, combine):
    cfg = dict(checkpoint="none", window=4, sparse_cache=8, chunk=4, combine=combine)
    one = probe(model, ids, "lola", **cfg)
    chunked = probe(model, ids, "lola", prefill_chunk=16, **cfg)
    assert one.pop("calls") == {0: 1, 1: 1, 2: 1}
    assert chunked.pop("calls") == {0: 3, 1: 3, 2: 3}  # 16 + 16 + 8: the last prompt token in the third call
    for L, d in one.items():
        assert d["unmatched"] == 0 and d["fold_check"] < 1e-5  # every slot found; the rest sums to the state
        assert d["random_held"] == pytest.approx((4 + 8) / N)  # window + 8 filled slots per kv head
        for k, v in d.items():
            got = chunked[L][k]
            if torch.is_tensor(v):
                torch.testing.assert_close(got, v, rtol=1e-4, atol=1e-6)
            elif k != "fold_check":
                assert got == pytest.approx(v), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_positions(dtype):
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 30, 8, generator=g).to(dtype)  # [Hkv, N, D]
    want = torch.tensor([[3, 29, -1], [0, 7, 7], [12, -1, 5], [1, 2, 3]])  # [Hs = 4 query heads, 3 slots]
    kv = torch.arange(4) // 2
    slots = keys[kv[:, None], want.clamp_min(0)]
    valid = want >= 0
    pos, missing = slot_positions(slots, valid, keys)
    assert torch.equal(pos, want) and missing == 0
    slots[3, 1] += 1  # a slot whose key is no key of its head
    pos, missing = slot_positions(slots, valid, keys)
    assert missing == 1 and pos[3, 1] == -1 and pos[3, 0] == 1
    assert slot_positions(slots[:, :0], valid[:, :0], keys)[0].shape == (4, 0)
