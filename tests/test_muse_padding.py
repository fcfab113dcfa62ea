"""muse on left-padded batches: every row gets the logits and greedy tokens of its prompt alone in MuSe's
approximate regime (any padding, both far fields, both backends, exact_tail, gradients), the decision MuSe or exact
attention taken by each row's real length, and the unpadded batch one call as before."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import longctx_patch as lp  # noqa: E402
import longctx_patch.methods.muse.attention as muse_method  # noqa: E402

from conftest import assert_padded_batch_exact, padded_batch_gap, tiny_model  # noqa: E402

L = 16
# approximating settings for a tiny model (few blocks retrieved, so summaries matter)
CELLS = dict(far_field="cells", block_size=L, k_clusters=4, topk_blocks=1, peak_blocks=1, sink_blocks=1,
             min_seq_len=0, exact_tail=0, backend="torch")
TILTED = dict(far_field="tilted", block_size=L, q_clusters=2, k_clusters=4, topk_blocks=1, topk_clusters=2,
              min_seq_len=0, exact_tail=0, backend="torch")
# cells with nothing retrieved beyond the sink and the local block: every other earlier block is a summary, so a
# block grid cut elsewhere shows (with CELLS, rows of 70 tokens or fewer retrieve every block: exact either way)
CELLS_FAR = dict(CELLS, topk_blocks=0, peak_blocks=0)
# paddings 0, 1, 7, L - 1, L + 1 and a long one (60)
LENS = (100, 99, 93, 100 - (L - 1), 100 - (L + 1), 40)


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


TILTED_CELLS = dict(CELLS, far_field="tilted-cells", q_clusters=8)


@pytest.mark.parametrize("far_field", ["cells", "tilted", "tilted-cells"])
@pytest.mark.parametrize("exact_tail", [0, 5])
def test_padded_rows_equal_prompts_alone(far_field, exact_tail):
    """Prefill logits (1e-4) and 3 greedy steps of each row against the prompt alone; with exact_tail, generate()'s
    prefill recomputes the tail exactly (the forward without a cache does not). Before: 1.8e-3 (cells) and 1.8e-3
    (tilted) on this model."""
    model = tiny_model("llama")
    cfg = {"cells": CELLS, "tilted": TILTED, "tilted-cells": TILTED_CELLS}[far_field]
    lp.patch(model, "muse", **dict(cfg, exact_tail=exact_tail))
    assert_padded_batch_exact(model, LENS, max_new_tokens=3)


def test_real_length_decides_muse_or_exact():
    """min_seq_len and block_size apply to a row's real length: the 50-token prompt takes exact attention alone
    (min_seq_len=64), and so it does in a batch padded to 100; the 70- and 100-token rows take MuSe."""
    model = tiny_model("llama")
    lp.patch(model, "muse", **dict(CELLS, min_seq_len=64))
    calls = []
    orig = muse_method.muse_attention

    def spy(q, *a, **kw):
        calls.append((q.shape[0], q.shape[2]))
        return orig(q, *a, **kw)

    muse_method.muse_attention = spy
    try:
        assert_padded_batch_exact(model, (100, 50, 70, 12), max_new_tokens=2)
    finally:
        muse_method.muse_attention = orig
    # per layer one call for the 100-token row (phase 0) and one for the 70-token row (padding 30: its own phase
    # group, trimmed to its 70 columns), in the batch as alone; never one for the 50- or 12-token rows
    assert calls[:2] == [(1, 100), (1, 70)] and set(calls) == {(1, 100), (1, 70)}


def test_unpadded_batch_is_one_call_without_host_reads():
    """No padding: one MuSe call over the whole batch with no key mask, and the row grouping is never computed; a
    batch padded by whole blocks only is one call too (the key mask as it is)."""
    model = tiny_model("llama", num_hidden_layers=1)
    lp.patch(model, "muse", **CELLS)
    calls = []
    orig, orig_groups = muse_method.muse_attention, muse_method._row_groups

    def spy(q, *a, **kw):
        calls.append((tuple(q.shape), kw.get("key_mask") is None))
        return orig(q, *a, **kw)

    def no_groups(*a, **kw):
        raise AssertionError("row groups computed for an unpadded batch")

    ids = torch.randint(3, 128, (3, 60), generator=torch.Generator().manual_seed(0))
    muse_method.muse_attention = spy
    muse_method._row_groups = no_groups
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
            model(ids, attention_mask=torch.ones_like(ids), use_cache=False)
        muse_method._row_groups = orig_groups
        am = torch.ones_like(ids)
        am[1, :L] = 0
        am[2, :2 * L] = 0
        with torch.no_grad():
            model(ids, attention_mask=am, use_cache=False)
    finally:
        muse_method.muse_attention, muse_method._row_groups = orig, orig_groups
    assert calls == [((3, 4, 60, 16), True), ((3, 4, 60, 16), True), ((3, 4, 60, 16), False)]


def test_gradients_of_a_padded_batch_equal_the_prompts_alone():
    """Training mode (MuSe with gradients, no tail): the loss of a left-padded batch and its gradients equal the
    sum over the prompts alone."""
    model = tiny_model("llama", num_hidden_layers=2)
    lp.patch(model, "muse", **CELLS_FAR)
    model.train()
    g = torch.Generator().manual_seed(3)
    lens = (70, 63, 45)
    prompts = [torch.randint(3, 128, (n,), generator=g) for n in lens]
    S = max(lens)
    ids = torch.zeros(len(lens), S, dtype=torch.long)
    am = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, S - len(p):], am[r, S - len(p):] = p, 1

    def ce(logits, p):
        return torch.nn.functional.cross_entropy(logits[:-1].float(), p[1:], reduction="sum")

    params = [p for p in model.parameters() if p.requires_grad]
    logits = model(ids, attention_mask=am, position_ids=(am.cumsum(1) - 1).clamp_min(0), use_cache=False).logits
    loss = sum(ce(logits[r, S - len(p):], p) for r, p in enumerate(prompts))
    gb = torch.autograd.grad(loss, params)
    alone = sum(ce(model(p[None], use_cache=False).logits[0], p) for p in prompts)
    ga = torch.autograd.grad(alone, params)
    torch.testing.assert_close(loss, alone, atol=1e-4, rtol=1e-5)
    for a, b in zip(gb, ga):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_qwen2_gqa_14_2_heads():
    """A qwen2 tiny model with 14 query / 2 kv heads (head_dim 8, q/k/v biases): both far fields."""
    from test_qwen2_gqa import qwen_tiny

    for kw in (CELLS_FAR, TILTED):
        model = qwen_tiny()
        lp.patch(model, "muse", **kw)
        assert_padded_batch_exact(model, (70, 69, 50, 39), max_new_tokens=2)


@pytest.mark.filterwarnings("ignore:muse. the model is on the CPU")
def test_triton_under_the_interpreter():
    """The Triton path of the tilted far field (block 16, 4 x 4 clusters, no block retrieved: the blocks before the
    local one are summaries) on a one-layer model, in the interpreter: a 48- and a 41-token row (padding 7)."""
    model = tiny_model("llama", num_hidden_layers=1)
    lp.patch(model, "muse", **dict(TILTED, q_clusters=4, k_clusters=4, topk_blocks=0, topk_clusters=1,
                                   backend="triton"))
    assert_padded_batch_exact(model, (48, 41), max_new_tokens=0)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:muse. the model is on the CPU")
def test_triton_cells_under_the_interpreter():
    """The cells Triton kernels need block_size 128: a one-layer model, 2 rows (300 and 150 tokens)."""
    model = tiny_model("llama", num_hidden_layers=1)
    lp.patch(model, "muse", far_field="cells", block_size=128, k_clusters=4, topk_blocks=0, peak_blocks=0,
             sink_blocks=0, local_blocks=0, min_seq_len=0, exact_tail=0, backend="triton")
    assert_padded_batch_exact(model, (300, 150), max_new_tokens=0)


@pytest.mark.slow
def test_smollm2_rows_equal_prompts_alone(smollm2):
    """Real SmolLM2 (fp32, CPU), block_size 128, min_seq_len 256, cells with nothing retrieved (each query block
    summarises every block before its local one), 4 layers patched: a 600- and a 300-token row (padding 300, 44 past
    two blocks), prefill logits (greedy tokens: the tiny-model tests). Before: 5.95; after: 5e-5."""
    model, _ = smollm2
    lp.patch(model, "muse", layers=[0, 10, 20, 29], block_size=128, min_seq_len=256, topk_blocks=0, peak_blocks=0,
             sink_blocks=0, exact_tail=0, backend="torch")
    try:
        gap, _ = padded_batch_gap(model, (600, 300), max_new_tokens=0, vocab=model.config.vocab_size)
    finally:
        lp.unpatch(model)
    assert gap <= 1e-4, gap
