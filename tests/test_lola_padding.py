"""Left-padded batches under `lola` are exact: every row gets the logits and greedy tokens of its prompt alone,
for any padding (each row evicts on the grid of its own real tokens: kernels/lola/ops.py, `RowPhases`), in
prefill, decode, a continued cache and the training path, on both backends."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import longctx_patch as lp  # noqa: E402
from longctx_patch.kernels.lola import padded, prefill, sparse_cache  # noqa: E402
from longctx_patch.kernels.lola.state import LolaRun, LolaState, StateSizes  # noqa: E402
from longctx_patch.kernels.lola import reference as ref  # noqa: E402

from conftest import assert_padded_batch_exact, padded_batch_gap, tiny_model  # noqa: E402

SMALL = dict(window=16, chunk=8, sparse_cache=8, feature_dim=16)  # paddings below: 1, 7 = chunk-1, 9 = chunk+1, 31


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def qwen_tiny():
    """qwen2 with 14 query heads on 2 kv heads (groups of 7), as tests/test_qwen2_gqa.py builds it."""
    return tiny_model("qwen2", hidden_size=112, num_attention_heads=14, num_key_value_heads=2, num_hidden_layers=2,
                      intermediate_size=96, tie_word_embeddings=True)


def _lens(L, pads):
    return [L - p for p in pads]


# ------------------------------------------------------------------------------------------- the manager
B, HQ, HKV, D, F = 3, 4, 2, 16, 8


def _seq(S, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (HQ, HKV, HKV))
    Wq, Wk = (torch.randn(HQ, D, F, generator=g) * D ** -0.25 for _ in range(2))
    return q, k, v, ref.hedgehog_feature_map(q, Wq), torch.sigmoid(torch.randn(HQ, generator=g)), torch.ones(HQ), Wk


def _run(splits, seq, mask, rows=None, **kw):
    q, k, v, fq, g, lf, Wk = seq
    if rows is not None:  # one row alone, from its first real token
        r, p = rows
        q, k, v, fq = (x[r:r + 1, :, p:] for x in (q, k, v, fq))
        mask = None
    st = LolaState.empty(StateSizes(q.shape[0], HQ, HKV, D, 2 * F, kw["lam"]), q.dtype, q.device,
                         capacity=kw["window"] + kw["chunk"])
    run = LolaRun(phi_k=lambda x: ref.hedgehog_feature_map(x, Wk), scale=D ** -0.5, **kw)
    outs, i = [], 0
    for n in splits:
        sl = slice(i, i + n)
        outs.append(sparse_cache.lola_process(st, q[:, :, sl], k[:, :, sl], v[:, :, sl], fq[:, :, sl], g, lf, run,
                                              key_mask_new=None if mask is None else mask[:, sl]))
        i += n
    return torch.cat(outs, 1), st


@pytest.mark.parametrize("backend,window,chunk,S,splits", [
    ("torch", 6, 4, 45, "full,steps,mixed"),
    ("triton", 16, 16, 44, "full"),  # prefill.lola_parallel per phase group (the chunk loop: the model test's decode)
])
def test_manager_rows_equal_their_prompts_alone(backend, window, chunk, S, splits):
    """Paddings 0, 3 (< chunk) and 13 (> chunk, no multiple) in one batch, the sequence in one call, token by
    token (a row's first real token in a later call) and cut anywhere: each row, its state included, equals its
    prompt alone; the buffer keeps window + chunk rows."""
    pads = [0, 3, 13]
    seq = _seq(S, seed=3)
    mask = torch.ones(B, S, dtype=torch.bool)
    for r, p in enumerate(pads):
        mask[r, :p] = False
    kw = dict(window=window, chunk=chunk, lam=5, backend=backend)
    cuts = {"full": [S], "steps": [1] * S, "mixed": [13, 1, 1, S - 15]}
    for name in splits.split(","):
        got, st = _run(cuts[name], seq, mask, **kw)
        assert st.win_k.shape[2] == window + chunk and st.nb <= window + chunk
        assert st.phases is not None and st.phases.lead == tuple(pads)
        for r, p in enumerate(pads):
            want, sa = _run([S - p], seq, None, rows=(r, p), **kw)
            torch.testing.assert_close(got[r, p:], want[0], atol=1e-5, rtol=1e-5, msg=lambda m: f"{name} {r}: {m}")
            assert got[r, :p].abs().max().item() == 0 if p else True
            torch.testing.assert_close(st.H[r], sa.H[0], atol=1e-5, rtol=1e-5)
            ok = sa.sp_valid[0]
            assert torch.equal(st.sp_valid[r], ok)
            torch.testing.assert_close(st.sp_k[r][ok], sa.sp_k[0][ok])


def test_no_padding_and_whole_chunk_padding_keep_the_plain_grid(monkeypatch):
    """No mask: no phase work at all (no host sync); padding of whole chunks: the plain grid (no RowPhases)."""
    S, kw = 30, dict(window=6, chunk=4, lam=5, backend="torch")
    seq = _seq(S, seed=1)

    def refuse(*a, **k):
        raise AssertionError("phase work without padding")

    with monkeypatch.context() as m:
        m.setattr(padded, "left_padding_counts", refuse)
        m.setattr(padded, "row_phases", refuse)
        _, st = _run([S - 3, 1, 1, 1], seq, None, **kw)
    assert st.phases is None
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, :8] = False
    _, st = _run([S - 3, 1, 1, 1], seq, mask, **kw)
    assert st.phases is None


# ------------------------------------------------------------------------------------------- models
@pytest.mark.parametrize("family,pads", [
    ("llama", [0, 1, 7, 9, 31]),
    ("qwen2", [31, 9, 0, 7]),
])
def test_padded_batch_equals_prompts_alone(family, pads):
    """Prefill (use_cache=False) and 20 greedy decode steps, so that every row crosses evictions on its own grid."""
    model = tiny_model("llama") if family == "llama" else qwen_tiny()
    lp.patch(model, "lola", backend="torch", **SMALL)
    assert_padded_batch_exact(model, _lens(44, pads), max_new_tokens=20, atol=1e-4)


def test_padded_batch_equals_prompts_alone_triton():
    """The Triton kernels under the interpreter: `prefill.lola_parallel` per phase group (window and chunk multiples of
    16), then decode steps across evictions on two grids."""
    model = tiny_model("llama", num_hidden_layers=1)
    lp.patch(model, "lola", backend="triton", window=16, chunk=16, sparse_cache=8, feature_dim=8)
    calls = []
    real = prefill.lola_parallel
    try:
        prefill.lola_parallel = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        # generate() only (its prefill is the cached one, through `prefill.lola_parallel`): the interpreter is slow.
        # prefill: evictions at 16, 32 (row 0) and 17, 33 (row 1, 1 of padding); decode: row 0 evicts at 48 (the
        # 3rd scores read its new state), row 1 at 49 (its 48th real token; the 4th scores)
        g = torch.Generator().manual_seed(4)
        prompts = [torch.randint(3, 128, (n,), generator=g) for n in (47, 46)]
        ids = torch.zeros(2, 47, dtype=torch.long)
        ids[0], ids[1, 1:] = prompts
        am = (torch.arange(47) >= torch.tensor([[0], [1]])).long()
        gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        with torch.no_grad():
            batch = model.generate(ids, attention_mask=am, **gen)
            for r, p in enumerate(prompts):
                one = model.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), **gen)
                assert torch.equal(batch.sequences[r, 47 - len(p):], one.sequences[0])
                for sb, so in zip(batch.scores, one.scores):
                    torch.testing.assert_close(sb[r], so[0], atol=1e-4, rtol=0)
    finally:
        prefill.lola_parallel = real
    assert calls  # the two-pass prefill ran


def test_continued_cache_equals_prompts_alone():
    """A padded prefill into a cache, then a second forward of 13 tokens (the chunk loop on a state whose rows are
    out of phase): each row's logits are those of its prompt alone through the same two forwards."""
    model = tiny_model("llama")
    lp.patch(model, "lola", backend="torch", **SMALL)
    pads, L, M = [0, 7, 9], 30, 13
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (len(pads), L + M), generator=g)
    am = torch.ones_like(ids)
    for r, p in enumerate(pads):
        ids[r, :p], am[r, :p] = 0, 0
    pos = (am.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        out = model(ids[:, :L], attention_mask=am[:, :L], position_ids=pos[:, :L], use_cache=True)
        nxt = model(ids[:, L:], attention_mask=am, position_ids=pos[:, L:], past_key_values=out.past_key_values,
                    use_cache=True).logits
        for r, p in enumerate(pads):
            one = model(ids[r:r + 1, p:L], use_cache=True)
            alone = model(ids[r:r + 1, L:], past_key_values=one.past_key_values, use_cache=True).logits
            torch.testing.assert_close(out.logits[r, p:], one.logits[0], atol=1e-4, rtol=0)
            torch.testing.assert_close(nxt[r], alone[0], atol=1e-4, rtol=0)


def test_training_path_padded_equals_rows_alone(monkeypatch):
    """Under gradients (use_cache=False) lola takes the sparse-sets path, once per phase group: the padded batch's
    logits and the feature maps' gradients equal those of the rows alone."""
    from longctx_patch.methods.lola import attention as lolcats

    model = tiny_model("llama", num_hidden_layers=2)
    lp.patch(model, "lola", backend="torch", **SMALL)
    calls = []
    real = lolcats.sparse_positions
    monkeypatch.setattr(lolcats, "sparse_positions", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    pads, L = [0, 9, 7], 40
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 128, (len(pads), L), generator=g)
    am = torch.ones_like(ids)
    for r, p in enumerate(pads):
        ids[r, :p], am[r, :p] = 0, 0
    pos = (am.cumsum(1) - 1).clamp_min(0)
    w = torch.randn(L, 128, generator=g)
    params = [p for n, p in model.named_parameters() if "feature_map" in n]
    assert params

    logits = model(ids, attention_mask=am, position_ids=pos, use_cache=False).logits
    loss = sum((logits[r, p:] * w[p:]).sum() for r, p in enumerate(pads))
    grads = torch.autograd.grad(loss, params)
    assert len(calls) == 3 * 2  # 2 layers x 3 phase groups (paddings 0, 9 and 7: remainders 0, 1, 7)
    want_grads = [torch.zeros_like(p) for p in params]
    for r, p in enumerate(pads):
        alone = model(ids[r:r + 1, p:], use_cache=False).logits
        torch.testing.assert_close(logits[r, p:].detach(), alone[0].detach(), atol=1e-4, rtol=0)
        for acc, gr in zip(want_grads, torch.autograd.grad((alone[0] * w[p:]).sum(), params)):
            acc += gr
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_smollm2_padded_batch_equals_prompts_alone(smollm2):
    """The real model (fp32, CPU, the shipped weights; its first 4 layers patched, to keep the test short): 2 rows
    of 300 and 100 tokens (200 of padding, 8 past a multiple of the chunk), prefill and 4 greedy tokens. The
    tolerance is the model's own fp32 noise between a batch of 2 and one row (logits of magnitude ~20: a batch
    of whole-chunk paddings, where nothing depends on the grid, differs by 2.4e-4); before the rows had their
    own grids the gap was 41.2 (other tokens) with all 30 layers patched, 5.4e-4 after (docs/lola.md)."""
    model, _ = smollm2
    lp.patch(model, "lola", layers=[0, 1, 2, 3], window=32, chunk=32, sparse_cache=16, backend="torch")
    try:
        gap, same = padded_batch_gap(model, [300, 100], max_new_tokens=4, vocab=model.config.vocab_size)
    finally:
        lp.unpatch(model)
    assert same and gap <= 1e-3, gap
