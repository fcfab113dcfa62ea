"""Decode steps replayed from CUDA graphs (longctx_patch/decode_graphs.py), checked on the CPU with the simulated
replay: a replay re-runs the step with the layers' host fields as they were at its capture, which is what a CUDA
graph bakes in. A graph key that left out something a step reads from the host gives other logits than the eager
decode, so these tests check the keys and the host bookkeeping; the GPU run (evals/bench/generate_speed.py
--decode-graphs both) checks the same equality with real graphs."""

import pytest
import torch

import longctx_patch as lp
from longctx_patch import decode_graphs as dg

from conftest import tiny_model

LOLA = {"window": 4, "chunk": 4, "sparse_cache": 4, "feature_dim": 8, "backend": "torch", "checkpoint": "none"}


@pytest.fixture
def simulate(monkeypatch):
    monkeypatch.setattr(dg, "SIMULATE", True)


def _generate(model, ids, n, **kw):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.scores, 1), out.past_key_values


@pytest.mark.parametrize("method,config", [("lola", LOLA), ("lolcats", {k: v for k, v in LOLA.items()
                                                                        if k != "sparse_cache"})])
def test_replayed_decode_equals_eager(simulate, method, config):
    torch.manual_seed(0)
    model = tiny_model("llama").eval()
    lp.patch(model, method, **config)
    ids = torch.randint(3, 100, (2, 13))
    lp.set_decode_graphs(model, False)
    seq_e, sc_e, cache_e = _generate(model, ids, 23)
    assert dg.stats(cache_e) is None
    lp.set_decode_graphs(model, True)
    seq_g, sc_g, cache_g = _generate(model, ids, 23)
    st = dg.stats(cache_g)
    # 22 decode steps: the first eager, then one capture per key (chunk = 4 keys: nb and seen % chunk) and replays
    assert st["eager_steps"] == 1 and st["graphs"] == st["captures"] == 4 and st["replays"] == 21, st
    assert torch.equal(seq_g, seq_e)
    torch.testing.assert_close(sc_g, sc_e, atol=1e-5, rtol=0)
    assert cache_g.get_seq_length() == cache_e.get_seq_length() == 13 + 22
    for le, lg in zip(cache_e.layers, cache_g.layers):
        assert (le.nb, le.seen) == (lg.nb, lg.seen)
        for n, t in le.state_tensors().items():
            torch.testing.assert_close(lg.state_tensors()[n], t, atol=1e-5, rtol=0)


def test_a_key_missing_a_host_field_is_caught(simulate, monkeypatch):
    """The check has teeth: a key that ignores the window's fill (`nb`, which sets where a step appends and whether
    it evicts) replays one captured step for every position."""
    from longctx_patch.methods.lolcats import LolaLayer

    monkeypatch.setattr(LolaLayer, "graph_key", lambda self: None if self.H is None else ())
    torch.manual_seed(0)
    model = tiny_model("llama").eval()
    lp.patch(model, "lola", **LOLA)
    ids = torch.randint(3, 100, (1, 13))
    lp.set_decode_graphs(model, False)
    _, sc_e, _ = _generate(model, ids, 15)
    lp.set_decode_graphs(model, True)
    _, sc_g, _ = _generate(model, ids, 15)
    fin = sc_e.isfinite()
    assert (sc_g - sc_e)[fin].abs().max() > 1e-3


def test_padded_batch_and_other_methods_stay_eager(simulate):
    torch.manual_seed(0)
    model = tiny_model("llama").eval()
    lp.patch(model, "lola", **LOLA)
    ids = torch.randint(3, 100, (2, 11))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)
    assert dg.stats(out.past_key_values) is None  # padded rows: eager (their mask tensor changes every step)
    lp.unpatch(model)
    assert "forward" not in model.__dict__
    lp.patch(model, "exact")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                         pad_token_id=0, return_dict_in_generate=True)
    assert dg.stats(out.past_key_values) is None  # a full KV cache grows: not replayable


def test_beam_reorder_drops_graphs(simulate):
    torch.manual_seed(0)
    model = tiny_model("llama").eval()
    lp.patch(model, "lolcats", **{k: v for k, v in LOLA.items() if k != "sparse_cache"})
    ids = torch.randint(3, 100, (1, 9))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=10, num_beams=2, do_sample=False, pad_token_id=0)
    lp.set_decode_graphs(model, False)
    eager = model.generate(ids, **kw)
    lp.set_decode_graphs(model, True)
    assert torch.equal(model.generate(ids, **kw), eager)


def test_set_decode_graphs_rejects_non_bool():
    model = tiny_model("llama")
    lp.patch(model, "lola", **LOLA)
    with pytest.raises(lp.ConfigError, match="True or False"):
        lp.set_decode_graphs(model, "yes")
    with pytest.raises(lp.NotPatchedError):
        lp.set_decode_graphs(tiny_model("llama"), True)
