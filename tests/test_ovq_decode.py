"""ovq decode steps in the open-chunk buffer (`OVQLayer.buffered_step`) and their replay from CUDA graphs.

A decode step writes its key at a device position and attends to the whole buffer under its validity mask, so its
launch depends on the dictionary size only: one graph per dictionary size replays every step of a chunk; the step
that completes a chunk absorbs it eagerly. Checked here on the CPU: the buffered kernel (Triton interpreter) against
the general path, and the simulated replay (the `simulate` fixture: a replay re-runs the step with the host fields
of its capture) against eager decoding."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import longctx_patch as lp  # noqa: E402
from longctx_patch import decode_graphs as dg  # noqa: E402
from longctx_patch.kernels.ovq import OpenChunk, OVQState, ovq_attention, ovq_open_attention, target_int  # noqa: E402

from conftest import greedy_with_scores, tiny_model  # noqa: E402

OVQ = {"chunk_size": 8, "max_centroids": 12, "growth": 4.0, "backend": "torch"}


def _state(g, B, H, N, D, n_active):
    st = OVQState.empty(B, H, N, D)
    st.counts[:, :, :n_active] = torch.randint(1, 5, (B, H, n_active), generator=g).float()
    st.key_sums.copy_(torch.randn(B, H, N, D, generator=g) * st.counts[..., None])
    st.value_sums.copy_(torch.randn(B, H, N, D, generator=g) * st.counts[..., None])
    st.n_active.fill_(n_active)
    st.seen.fill_(n_active)  # growth 0: the dictionary has min(seen, N) rows
    return st


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_open", [0, 5, 14])
def test_buffer_attention_equals_the_general_path(backend, dtype, n_open):
    """The new token written into a 16-slot buffer whose unused slots hold garbage, 7 query heads per kv head:
    the same output as `ovq_attention` over the open tokens (its decode step), bit for bit on Triton."""
    g = torch.Generator().manual_seed(n_open)
    B, H, G, D, C, N, n_dict = 2, 2, 7, 16, 16, 40, 23
    st = _state(g, B, H, N, D, n_dict)
    q = torch.randn(B, H * G, 1, D, generator=g).to(dtype)
    keys = torch.randn(B, H, C, D, generator=g).to(dtype)
    values = torch.randn(B, H, C, D, generator=g).to(dtype)
    valid = torch.zeros(B, C, dtype=torch.bool)
    valid[:, :n_open + 1] = True
    if n_open > 2:
        valid[1, 2] = False  # a padded key of the open chunk
    out = ovq_open_attention(q, st, OpenChunk(keys, values, valid), n_dict, backend=backend)
    # the general path: the open tokens, then the new one (slot n_open), as a decode step sees them
    op = OpenChunk(keys[:, :, :n_open], values[:, :, :n_open], valid[:, :n_open]) if n_open else None
    ref, _, op2, _ = ovq_attention(q, keys[:, :, n_open:n_open + 1], values[:, :, n_open:n_open + 1], st, op,
                                   valid[:, n_open:n_open + 1], chunk_size=C, max_centroids=N, growth=0.0,
                                   backend=backend, seen_bound=int(st.seen.max()))
    assert op2.length == n_open + 1 and out.dtype == dtype and torch.isfinite(out).all()
    if backend == "triton":
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_replayed_decode_equals_eager(simulate, family):
    """29 decode steps over 4 chunk boundaries (chunk 8): the first step and each absorbing step run eagerly, one
    graph per dictionary size is captured, every other step replays one; tokens, scores and the final state equal eager decoding."""
    kw = {"num_attention_heads": 14, "num_key_value_heads": 2} if family == "qwen2" else {}
    model = tiny_model(family, **kw).eval()
    lp.patch(model, "ovq", **OVQ)
    ids = torch.randint(3, 100, (2, 13), generator=torch.Generator().manual_seed(1))
    lp.set_decode_graphs(model, False)
    seq_e, sc_e, cache_e = greedy_with_scores(model, ids, 30)
    assert dg.stats(cache_e) is None
    lp.set_decode_graphs(model, True)
    seq_g, sc_g, cache_g = greedy_with_scores(model, ids, 30)
    st = dg.stats(cache_g)
    # positions 13..41 are decoded; steps at positions 15, 23, 31, 39 complete a chunk (eager)
    n_dicts = set()
    for p in range(14, 42):
        if p % 8 != 7:
            n_dicts.add(target_int(p - p % 8, 12, 4.0))
    assert st["eager_steps"] == 1, st  # (absorbing steps have no key: they bypass the graphs, uncounted)
    assert st["graphs"] == st["captures"] == len(n_dicts), (st, n_dicts)
    assert st["replays"] == 29 - 5, st
    assert torch.equal(seq_g, seq_e)
    torch.testing.assert_close(sc_g, sc_e, atol=1e-5, rtol=0)
    for le, lg in zip(cache_e.layers, cache_g.layers):
        assert (le.seen, le.open_len) == (lg.seen, lg.open_len) == (42, 42 % 8)
        for n, t in le.state_tensors().items():
            torch.testing.assert_close(lg.state_tensors()[n], t, atol=1e-5, rtol=0)


def test_state_keeps_its_memory_across_absorbs():
    """Decode steps, absorbing ones included, write into the tensors the prefill allocated (a captured step reads
    them by address); the cache's size is what `state_bytes` says."""
    model = tiny_model("llama").eval()
    lp.patch(model, "ovq", **OVQ)
    ids = torch.randint(3, 100, (1, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = out.past_key_values
        sig = dg._state_sig(cache)
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(12):
            out = model(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
    assert dg._state_sig(cache) == sig
    mod = model.model.layers[0].self_attn
    assert cache.nbytes() == len(cache.layers) * mod.state_bytes(23, batch=1, dtype=torch.float32)


def test_beam_search_with_graphs(simulate):
    model = tiny_model("llama").eval()
    lp.patch(model, "ovq", **OVQ)
    ids = torch.randint(3, 100, (1, 9), generator=torch.Generator().manual_seed(3))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, num_beams=2, do_sample=False, pad_token_id=0)
    lp.set_decode_graphs(model, False)
    eager = model.generate(ids, **kw)
    lp.set_decode_graphs(model, True)
    assert torch.equal(model.generate(ids, **kw), eager)


def test_a_key_without_the_dictionary_size_is_caught(simulate, monkeypatch):
    """The replay check has teeth: a key that leaves out the dictionary size replays a step captured before an
    absorb (fewer dictionary rows visible) after it."""
    from longctx_patch.methods.ovq import OVQLayer

    real = OVQLayer.graph_key
    monkeypatch.setattr(OVQLayer, "graph_key", lambda self: None if real(self) is None else ("ovq",))
    model = tiny_model("llama").eval()
    lp.patch(model, "ovq", **OVQ)
    ids = torch.randint(3, 100, (1, 13), generator=torch.Generator().manual_seed(1))
    lp.set_decode_graphs(model, False)
    _, sc_e, _ = greedy_with_scores(model, ids, 30)
    lp.set_decode_graphs(model, True)
    _, sc_g, _ = greedy_with_scores(model, ids, 30)
    fin = sc_e.isfinite()
    assert (sc_g - sc_e)[fin].abs().max() > 1e-3
