"""ovq on left-padded batches: every row computes what its prompt computes alone, for any padding.

Each row's chunks start at its padding modulo chunk_size (`kernels.ovq.ovq_attention_phased`, `OVQLayer.phases`):
checked at the kernel level (outputs and the whole dictionary state of every row against the row alone, split
into calls of any size), and through patched tiny models (prefill, greedy decode across chunk boundaries in every
row, a cache continued by a second forward, both training paths with gradients, the Triton kernels under the
interpreter, beam search) and the real SmolLM2. Paddings: 1, 7 (= chunk - 1), 9 (= chunk + 1), several chunks
plus a remainder, whole chunks, none.
"""

import pytest
import torch
import torch.nn.functional as F

import longctx_patch as lp
from longctx_patch.kernels.ovq import OpenChunk, OVQState, ovq_attention, ovq_attention_phased, phase_open_len

from conftest import assert_padded_batch_exact, left_padded_prompts, padded_batch_gap, tiny_model
from test_qwen2_gqa import qwen_tiny

C = 8
CFG = dict(chunk_size=C, max_centroids=16, growth=4.0)
# a 48-token batch: paddings 0, 1, 7 (C - 1), 9 (C + 1), 29 (3 chunks + 5), 16 (whole chunks)
LENS = [48, 47, 41, 39, 19, 32]


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def _qkv(B, Hq, H, S, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, Hq, S, D, generator=g), dim=-1) * 4.0
    k = F.normalize(torch.randn(B, H, S, D, generator=g), dim=-1)
    v = torch.randn(B, H, S, D, generator=g)
    return q, k, v


def _row_open(op: OpenChunk | None, r: int, n: int):
    """Row r's own open tokens (the last n columns of the right-aligned open chunk)."""
    if n == 0:
        return None
    assert op is not None and op.length >= n
    assert not op.valid[r, :op.length - n].any(), "columns left of a row's open tokens must be masked"
    return op.keys[r:r + 1, :, op.length - n:], op.values[r:r + 1, :, op.length - n:], op.valid[r:r + 1, op.length - n:]


@pytest.mark.parametrize("splits", [(37,), (13, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1),
                                    (3, 9, 1, 16, 2, 6)])
def test_phased_driver_equals_each_row_alone(splits):
    """Outputs, dictionary state (sums, counts, rows, tokens seen) and open chunk of every row of a padded batch,
    streamed in calls of the given sizes, equal the row's own unpadded stream; padding never enters the
    dictionary nor counts as seen."""
    S = sum(splits)
    pads = [0, 1, 7, 9, 29, 16, S - 2]  # the last row: 2 real tokens
    B, Hq, H, D = len(pads), 4, 2, 16
    q, k, v = _qkv(B, Hq, H, S, D, seed=S)
    valid = torch.ones(B, S, dtype=torch.bool)
    for r, p in enumerate(pads):
        valid[r, :p] = False
    phases = tuple(p % C for p in pads)
    kw = dict(chunk_size=C, max_centroids=12, growth=3.0, backend="torch")
    state, op, s0, outs = None, None, 0, []
    for n in splits:
        o, state, op = ovq_attention_phased(q[:, :, s0:s0 + n], k[:, :, s0:s0 + n], v[:, :, s0:s0 + n], state, op,
                                            valid[:, s0:s0 + n], phases, s0, **kw)
        outs.append(o)
        s0 += n
    o = torch.cat(outs, 2)
    for r, p in enumerate(pads):
        alone, st, op1, _ = ovq_attention(q[r:r + 1, :, p:], k[r:r + 1, :, p:], v[r:r + 1, :, p:], None, None, None, **kw)
        torch.testing.assert_close(o[r:r + 1, :, p:], alone, atol=1e-5, rtol=1e-5)
        assert int(state.seen[r]) == int(st.seen[0]) == (S - p) // C * C
        assert int(state.n_active[r]) == int(st.n_active[0])
        torch.testing.assert_close(state.counts[r:r + 1], st.counts, atol=0, rtol=0)
        torch.testing.assert_close(state.key_sums[r:r + 1], st.key_sums, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state.value_sums[r:r + 1], st.value_sums, atol=1e-5, rtol=1e-5)
        mine = _row_open(op, r, phase_open_len(phases[r], S, C))
        if op1 is None:
            assert mine is None
        else:
            for a, b in zip(mine, (op1.keys, op1.values, op1.valid)):
                assert torch.equal(a, b)
    assert op.length == max(phase_open_len(p, S, C) for p in phases)  # no wider than the longest row's


@pytest.mark.parametrize("backend,parallel", [("torch", True), ("torch", False), ("triton", True), ("triton", False)])
def test_phased_driver_gradients_equal_rows_alone(backend, parallel):
    """Training forward (no cache) of a padded batch, both training paths, both backends (Triton under the
    interpreter): outputs and the gradients of q, k, v equal each row alone."""
    pads = [0, 1, 7, 9]
    B, Hq, H, D, S = len(pads), 2, 1, 16, 19
    q, k, v = (x.requires_grad_() for x in _qkv(B, Hq, H, S, D, seed=11))
    valid = torch.ones(B, S, dtype=torch.bool)
    for r, p in enumerate(pads):
        valid[r, :p] = False
    kw = dict(chunk_size=C, max_centroids=6, growth=3.0, backend=backend, parallel=parallel)
    w = torch.randn(B, Hq, S, D, generator=torch.Generator().manual_seed(12))
    o, st, op = ovq_attention_phased(q, k, v, None, None, valid, tuple(p % C for p in pads), 0, keep_state=False, **kw)
    assert st is None and op is None
    sum((o[r, :, p:] * w[r, :, p:]).sum() for r, p in enumerate(pads)).backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    for r, p in enumerate(pads):
        alone, *_ = ovq_attention(q[r:r + 1, :, p:], k[r:r + 1, :, p:], v[r:r + 1, :, p:], None, None, None, **kw)
        torch.testing.assert_close(o[r:r + 1, :, p:].detach(), alone.detach(), atol=1e-5, rtol=1e-5)
        (alone[0] * w[r, :, p:]).sum().backward()
    assert got[1].abs().sum() > 0
    for a, t in zip(got, (q, k, v)):
        torch.testing.assert_close(a, t.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_padded_batch_exact_prefill_and_decode(family):
    """Prefill and 12 greedy decode steps (every row crosses a chunk boundary) of a 6-row batch, paddings 0, 1, 7,
    9, 29, 16: logits within 1e-4 of each prompt alone, the same tokens."""
    model = tiny_model("llama") if family == "llama" else qwen_tiny()
    lp.patch(model, "ovq", backend="torch", **CFG)
    model.generation_config.eos_token_id = None
    assert_padded_batch_exact(model, LENS, max_new_tokens=12, atol=1e-4)
    gap, _ = padded_batch_gap(model, LENS, 0, position_ids=False)  # no position ids: transformers' own positions
    assert gap <= 1e-4


def test_padded_batch_exact_triton_interpreter():
    """The Triton kernels (under TRITON_INTERPRET on the CPU): prefill with paddings 0 and 1, then two decode
    steps in which one row, then the other, completes its chunk (an absorbing sub-batch beside an idle one)."""
    model = tiny_model("llama", num_hidden_layers=1)
    lp.patch(model, "ovq", backend="triton", **CFG)
    model.generation_config.eos_token_id = None
    assert_padded_batch_exact(model, [15, 14], max_new_tokens=3, atol=1e-4)


def test_padded_batch_exact_under_inference_mode():
    """Under torch.inference_mode (masks without a version counter) a padded batch is still exact, without a cache
    and through generate()."""
    model = tiny_model("llama", num_hidden_layers=2)
    lp.patch(model, "ovq", backend="torch", **CFG)
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        assert_padded_batch_exact(model, [14, 11, 5], max_new_tokens=4, atol=1e-4)


def test_cache_continued_by_a_second_forward():
    """A padded prefill into a cache, then a 13-token forward over it (every row crosses a boundary), equals each
    row's whole sequence alone in one forward."""
    model = tiny_model("llama")
    lp.patch(model, "ovq", backend="torch", **CFG)
    g = torch.Generator().manual_seed(5)
    pads = [0, 1, 7, 9, 21]
    P, T = 30, 13
    ids = torch.randint(3, 128, (len(pads), P + T), generator=g)
    am = torch.ones_like(ids)
    for r, p in enumerate(pads):
        am[r, :p] = 0
    with torch.no_grad():
        pos = (am.cumsum(1) - 1).clamp_min(0)
        out = model(ids[:, :P], attention_mask=am[:, :P], position_ids=pos[:, :P], use_cache=True)
        cache = out.past_key_values
        assert cache.layers[0].phases == (0, 1, 7, 1, 5)
        out2 = model(ids[:, P:], attention_mask=am, position_ids=pos[:, P:], past_key_values=cache, use_cache=True)
        logits = torch.cat([out.logits, out2.logits], 1)
        for r, p in enumerate(pads):
            alone = model(ids[r:r + 1, p:], use_cache=False).logits
            torch.testing.assert_close(logits[r:r + 1, p:], alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", ["parallel", "loop"])
def test_training_paths_padded_equal_rows_alone(path):
    """Under gradients with use_cache=False: a padded batch's logits equal each row alone, and the gradients of
    ovq_log_beta (and k_proj) equal the sum of the rows' own."""
    model = tiny_model("llama")
    lp.patch(model, "ovq", backend="torch", train_path=path, **CFG)
    model.train()
    g = torch.Generator().manual_seed(6)
    pads = [0, 7, 9, 1, 29]
    S = 40
    ids = torch.randint(3, 128, (len(pads), S), generator=g)
    am = torch.ones_like(ids)
    for r, p in enumerate(pads):
        am[r, :p] = 0
    w = torch.randn(len(pads), S, 128, generator=g)
    attn = [layer.self_attn for layer in model.model.layers]

    def grads():
        out = [a.ovq_log_beta.grad.clone() for a in attn] + [attn[0].k_proj.weight.grad.clone()]
        model.zero_grad(set_to_none=True)
        return out

    logits = model(ids, attention_mask=am, position_ids=(am.cumsum(1) - 1).clamp_min(0), use_cache=False).logits
    sum(((logits[r, p:] * w[r, p:]).sum() for r, p in enumerate(pads))).backward()
    got = grads()
    want, alone_logits = None, []
    for r, p in enumerate(pads):
        lr = model(ids[r:r + 1, p:], use_cache=False).logits
        (lr[0] * w[r, p:]).sum().backward()
        alone_logits.append(lr.detach())
        gr = grads()
        want = gr if want is None else [a + b for a, b in zip(want, gr)]
    for r, p in enumerate(pads):
        torch.testing.assert_close(logits[r:r + 1, p:].detach(), alone_logits[r], atol=1e-4, rtol=1e-4)
    assert got[0].abs().sum() > 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_layer_batch_operations_carry_the_phases():
    """reorder_cache / batch_repeat_interleave / batch_select_indices move each row's phase with its state; reset
    forgets them."""
    from longctx_patch.methods.ovq import OVQLayer

    layer = OVQLayer(C, 4)
    layer.lazy_initialization(torch.zeros(3, 1, 1, 2))
    layer.key_sums = torch.arange(3.0)[:, None, None, None].expand(3, 1, 4, 2).clone()
    layer.phases = (0, 5, 7)
    layer.batch_repeat_interleave(2)
    assert layer.phases == (0, 0, 5, 5, 7, 7) and layer.key_sums[:, 0, 0, 0].tolist() == [0, 0, 1, 1, 2, 2]
    layer.reorder_cache(torch.tensor([4, 2, 0, 1, 3, 5]))
    assert layer.phases == (7, 5, 0, 0, 5, 7) and layer.key_sums[:, 0, 0, 0].tolist() == [2, 1, 0, 0, 1, 2]
    layer.batch_select_indices(torch.tensor([1, 5]))
    assert layer.phases == (5, 7) and layer.key_sums[:, 0, 0, 0].tolist() == [1, 2]
    layer.reset()
    assert layer.phases is None


def test_beam_search_padded_rows_match_alone():
    """Beam search on a padded batch gives each row's beams alone."""
    model = tiny_model("llama")
    lp.patch(model, "ovq", backend="torch", **CFG)
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 128, (n,), generator=g) for n in (21, 14)]
    ids = torch.zeros(2, 21, dtype=torch.long)
    am = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, 21 - len(p):], am[r, 21 - len(p):] = p, 1
    gen = dict(max_new_tokens=9, do_sample=False, num_beams=3, pad_token_id=0)
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=am, **gen)
        for r, p in enumerate(prompts):
            one = model.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), **gen)
            assert torch.equal(batch[r, 21 - len(p):], one[0]), r


def test_unpadded_and_whole_chunk_batches_keep_the_plain_path(monkeypatch):
    """No padding, or padding by whole chunks only: the plain batched call (no phases, no regrouping)."""
    import longctx_patch.methods.ovq.attention as ovq_method

    def refuse(*a, **k):
        raise AssertionError("the phased path ran")

    monkeypatch.setattr(ovq_method, "ovq_attention_phased", refuse)
    model = tiny_model("llama", num_hidden_layers=1)
    lp.patch(model, "ovq", backend="torch", **CFG)
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(8))
    am = torch.ones_like(ids)
    am[1, :16] = 0
    with torch.no_grad():
        for mask in (None, am):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                                 return_dict_in_generate=True)
            assert out.past_key_values.layers[0].phases is None
            model(ids, attention_mask=mask, use_cache=False)


def test_smollm2_padded_batch(smollm2):
    """The real SmolLM2-135M (fp32): rows of 150 and 62 tokens (padding 88 = 2 chunks of 32 + 24), 3 new tokens
    (the short row completes a chunk in its second decode step). Without per-row grids: 10.1, other tokens."""
    model, _ = smollm2
    eos = model.generation_config.eos_token_id
    lp.patch(model, "ovq", chunk_size=32, max_centroids=32, growth=8.0, backend="torch")
    try:
        model.generation_config.eos_token_id = None
        gap, same = padded_batch_gap(model, [150, 62], max_new_tokens=3, vocab=model.config.vocab_size)
    finally:
        lp.unpatch(model)
        model.generation_config.eos_token_id = eos
    assert same and gap <= 1e-4, gap


def test_phases_read_once_per_call_for_every_layer(monkeypatch):
    """The rows' phases are read from the device once per forward call, kept in the call's own memo
    (patch_state.CallState): the layers of one call share it, and nothing of it is left on the model or the module
    for the next call."""
    from longctx_patch.methods.ovq import attention as ovq_attention

    model = tiny_model("llama", num_hidden_layers=3)
    lp.patch(model, "ovq", backend="torch", **CFG)
    reads = []
    orig = ovq_attention.left_padding
    monkeypatch.setattr(ovq_attention, "left_padding", lambda km: reads.append(1) or orig(km))
    _, ids, am = left_padded_prompts([14, 11, 5])
    with torch.no_grad():
        model(ids, attention_mask=am, use_cache=False)
        assert len(reads) == 1
        model(ids, attention_mask=am, use_cache=False)
    assert len(reads) == 2
