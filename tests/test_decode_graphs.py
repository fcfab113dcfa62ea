"""Decode steps replayed from CUDA graphs (longctx_patch/decode_graphs.py), checked on the CPU with the simulated
replay: a replay re-runs the step with the layers' host fields as they were at its capture, which is what a CUDA
graph bakes in. A graph key that left out something a step reads from the host gives other logits than the eager
decode, so these tests check the keys and the host bookkeeping; the GPU run (benchmarks/generate/bench_generate.py
--decode-graphs both) checks the same equality with real graphs."""

import pytest
import torch

import longctx_patch as lp
from longctx_patch import decode_graphs as dg

from conftest import greedy_with_scores, tiny_model

LOLA = {"window": 4, "chunk": 4, "sparse_cache": 4, "feature_dim": 8, "backend": "torch", "checkpoint": "none"}


@pytest.mark.parametrize("method,config", [("lola", LOLA), ("lolcats", {k: v for k, v in LOLA.items()
                                                                        if k != "sparse_cache"})])
def test_replayed_decode_equals_eager(simulate, method, config):
    torch.manual_seed(0)
    model = tiny_model("llama").eval()
    lp.patch(model, method, **config)
    ids = torch.randint(3, 100, (2, 13))
    lp.set_decode_graphs(model, False)
    seq_e, sc_e, cache_e = greedy_with_scores(model, ids, 23)
    assert dg.stats(cache_e) is None
    lp.set_decode_graphs(model, True)
    seq_g, sc_g, cache_g = greedy_with_scores(model, ids, 23)
    st = dg.stats(cache_g)
    # 22 decode steps: the first eager, then one capture per key (two: a step inside a chunk, whatever its position,
    # and the step that ends a chunk and evicts) and replays
    assert st["eager_steps"] == 1 and st["graphs"] == st["captures"] == 2 and st["replays"] == 21, st
    assert torch.equal(seq_g, seq_e)
    torch.testing.assert_close(sc_g, sc_e, atol=1e-5, rtol=0)
    assert cache_g.get_seq_length() == cache_e.get_seq_length() == 13 + 22
    for le, lg in zip(cache_e.layers, cache_g.layers):
        assert (le.nb, le.seen) == (lg.nb, lg.seen)
        for n, t in le.state_tensors().items():
            torch.testing.assert_close(lg.state_tensors()[n], t, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method,config", [("lola", LOLA), ("lolcats", {k: v for k, v in LOLA.items()
                                                                        if k != "sparse_cache"}),
                                           ("exact", {}), ("ovq", {"chunk_size": 64, "max_centroids": 6})])
def test_a_second_generate_captures_ahead(simulate, method, config):
    """Once a decode step of a shape ran in this process, the next generate() of that shape captures its graphs right
    after the prefill (the first step's, and LoLA's evicting step's): no decode step runs eagerly or captures, and
    the tokens and scores are the eager decode's."""
    torch.manual_seed(0)
    model = tiny_model("llama").eval()
    lp.patch(model, method, **config)
    ids = torch.randint(3, 100, (2, 13))
    lp.set_decode_graphs(model, False)
    seq_e, sc_e, _ = greedy_with_scores(model, ids, 23)
    lp.set_decode_graphs(model, True)
    greedy_with_scores(model, ids[:, :11], 5)  # a first call: its first step runs eagerly (its kernels compile)
    seq_g, sc_g, cache_g = greedy_with_scores(model, ids, 23)
    st = dg.stats(cache_g)
    keys = 2 if method in ("lola", "lolcats") else 1
    assert st["eager_steps"] == 0 and st["graphs"] == st["captures"] == keys and st["replays"] == 22, st
    assert torch.equal(seq_g, seq_e)
    torch.testing.assert_close(sc_g, sc_e, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method,config", [("lola", LOLA), ("exact", {})])
def test_graphs_are_captured_after_the_last_prefill_chunk(simulate, method, config):
    """With `prefill_chunk_size` the prefill is several forwards: the graphs are captured once, when generate()'s
    prefill has ended (a capture after an earlier chunk could hold tensors that a later chunk replaces, as a growing
    KV buffer does)."""
    torch.manual_seed(0)
    model = tiny_model("llama").eval()
    lp.patch(model, method, **config)
    ids = torch.randint(3, 100, (2, 21))
    lp.set_decode_graphs(model, False)
    seq_e, sc_e, _ = greedy_with_scores(model, ids, 12, prefill_chunk_size=8)
    lp.set_decode_graphs(model, True)
    greedy_with_scores(model, ids[:, :9], 3, prefill_chunk_size=8)
    seq_g, sc_g, cache_g = greedy_with_scores(model, ids, 12, prefill_chunk_size=8)
    st = dg.stats(cache_g)
    assert st["eager_steps"] == 0 and st["replays"] == 11 and st["captures"] == st["graphs"], st
    assert torch.equal(seq_g, seq_e)
    torch.testing.assert_close(sc_g, sc_e, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method,config", [("exact", {}), ("sliding-window", {"window": 6}),
                                           ("sliding-window", {"window": 40}), ("moba", {"block_size": 4, "top_k": 2}),
                                           ("muse", {"block_size": 4, "k_clusters": 2, "topk_blocks": 1, "peak_blocks": 0,
                                                     "min_seq_len": 0, "exact_tail": 2, "backend": "torch"})])
def test_exact_and_window_decode_replayed_equals_eager(simulate, method, config):
    """exact, sliding-window, moba and muse (methods/kv_layer.py): one graph per buffer capacity; a window smaller
    than the prompt (a full ring from the prefill on) and larger (the buffer grows up to the window, then rings);
    moba's step gates the buffer's blocks from device state only; muse's prefill is MuSe, its decode exact's."""
    torch.manual_seed(0)
    model = tiny_model("llama").eval()
    lp.patch(model, method, **config)
    ids = torch.randint(3, 100, (2, 13))
    lp.set_decode_graphs(model, False)
    seq_e, sc_e, cache_e = greedy_with_scores(model, ids, 21)
    lp.set_decode_graphs(model, True)
    seq_g, sc_g, cache_g = greedy_with_scores(model, ids, 21)
    st = dg.stats(cache_g)
    assert st["eager_steps"] == 1 and st["graphs"] == st["captures"] == 1 and st["replays"] == 19, st
    assert torch.equal(seq_g, seq_e)
    torch.testing.assert_close(sc_g, sc_e, atol=1e-5, rtol=0)
    for le, lg in zip(cache_e.layers, cache_g.layers):
        assert le.seen == lg.seen == 13 + 20
        for n, t in le.state_tensors().items():
            torch.testing.assert_close(lg.state_tensors()[n], t, atol=1e-5, rtol=0)


def test_a_buffer_regrow_drops_the_graphs(simulate, monkeypatch):
    """A full buffer: the step that would overflow runs eagerly and grows it (new tensors), later steps are captured
    again at the new capacity."""
    from longctx_patch.methods import kv_layer

    monkeypatch.setattr(kv_layer, "ALIGN", 8)
    monkeypatch.setattr(kv_layer, "HEADROOM", 2)
    monkeypatch.setattr(kv_layer, "GROW", 8)
    torch.manual_seed(0)
    model = tiny_model("llama").eval()
    lp.patch(model, "exact")
    ids = torch.randint(3, 100, (1, 13))
    lp.set_decode_graphs(model, False)
    seq_e, sc_e, _ = greedy_with_scores(model, ids, 21)
    lp.set_decode_graphs(model, True)
    seq_g, sc_g, cache = greedy_with_scores(model, ids, 21)
    assert cache.layers[0].capacity == 40  # 16 after the prefill, 24 at token 16, 32 at 24, 40 at 32
    # stats since the last state replacement: the step at 24 grew the buffer (eager, the key is None), the one at
    # 25 found new tensors (eager, a new store), 26 was captured, 26-31 replayed, 32 grew it again (eager)
    assert dg.stats(cache) == {"eager_steps": 1, "captures": 1, "replays": 6, "graphs": 1}
    assert torch.equal(seq_g, seq_e)
    torch.testing.assert_close(sc_g, sc_e, atol=1e-5, rtol=0)


def test_a_key_missing_a_host_field_is_caught(simulate, monkeypatch):
    """The check has teeth: a key that leaves out the evicting step (the one step whose launches the host sizes)
    replays a step that does not evict at the end of a chunk, so the buffered count outgrows the buffer."""
    from longctx_patch.methods.lola import LolaLayer

    monkeypatch.setattr(LolaLayer, "graph_key", lambda self: None if self.H is None else ("lola", 0))
    torch.manual_seed(0)
    model = tiny_model("llama").eval()
    lp.patch(model, "lola", **LOLA)
    ids = torch.randint(3, 100, (1, 13))
    lp.set_decode_graphs(model, False)
    greedy_with_scores(model, ids, 15)
    lp.set_decode_graphs(model, True)
    with pytest.raises(IndexError, match="out of bounds"):
        greedy_with_scores(model, ids, 15)


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
    lp.patch(model, "exact", layers=[0, 1])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                         pad_token_id=0, return_dict_in_generate=True)
    assert dg.stats(out.past_key_values) is None  # an unpatched layer's KV cache grows: not replayable


@pytest.mark.parametrize("method,config", [("lolcats", {k: v for k, v in LOLA.items() if k != "sparse_cache"}),
                                           ("exact", {}), ("sliding-window", {"window": 5})])
def test_beam_reorder_drops_graphs(simulate, method, config):
    torch.manual_seed(0)
    model = tiny_model("llama").eval()
    lp.patch(model, method, **config)
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


def test_a_cache_with_graphs_is_freed_without_the_garbage_collector(simulate):
    """The graphs a cache keeps do not point back at it: once generate()'s output is gone, reference counting frees
    the cache and its state (a cycle held a 32k-token cache per generate() call on the GPU until a collection)."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = tiny_model("llama").eval()
    lp.patch(model, "lola", **LOLA)
    ids = torch.randint(3, 100, (1, 13))
    gc.collect()
    gc.disable()
    try:
        seq, _, cache = greedy_with_scores(model, ids, 12)
        assert dg.stats(cache)["replays"] > 0
        ref = weakref.ref(cache)
        del cache
        assert ref() is None
    finally:
        gc.enable()


def test_forward_rebound_as_a_method_still_runs_and_unpatches():
    """accelerate's `unwrap_model` (after its mixed-precision wrapper on CUDA) sets `model.forward =
    MethodType(<the forward it found>, model)`: the decode-graph forward then receives the model first."""
    import types

    torch.manual_seed(0)
    model = tiny_model("llama").eval()
    ids = torch.randint(3, 100, (1, 9))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    lp.patch(model, "exact")
    model.forward = types.MethodType(model.forward, model)
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, want, atol=1e-5)
    lp.unpatch(model)
    assert "forward" not in model.__dict__


def test_a_model_over_several_devices_decodes_eagerly(simulate):
    """A graph is one device's: a model whose parameters sit on more than one device (device_map) is never captured,
    every step runs eagerly and gives the same tokens."""
    torch.manual_seed(0)
    model = tiny_model("llama").eval()
    lp.patch(model, "exact")
    ids = torch.randint(3, 100, (2, 9))
    seq_1, _, cache_1 = greedy_with_scores(model, ids, 6)
    assert dg.stats(cache_1)["captures"] == 1
    model.register_parameter("elsewhere", torch.nn.Parameter(torch.zeros(1, device="meta")))  # a second device
    seq_2, _, cache_2 = greedy_with_scores(model, ids, 6)
    assert dg.stats(cache_2) == {"eager_steps": 5, "captures": 0, "replays": 0, "graphs": 0}
    assert torch.equal(seq_2, seq_1)
