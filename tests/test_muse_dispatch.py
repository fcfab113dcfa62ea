"""Never slower than exact attention: below the measured crossover for its head dim, a MuSe-patched layer on CUDA runs
exact attention (SDPA) by default; elsewhere min_seq_len keeps its meaning (1024); a min_seq_len set wins. The CUDA
rule is checked on the CPU by making the module see its device as CUDA (`attention._device_type`) and counting the
MuSe calls."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import longctx_patch as lp  # noqa: E402
from longctx_patch.kernels.softmax import softmax_attention  # noqa: E402
from longctx_patch.methods import get_method  # noqa: E402
from longctx_patch.methods.muse import attention as muse_attention_module  # noqa: E402
from longctx_patch.methods.muse import config as muse_config  # noqa: E402

from conftest import rand_qkv, tiny_model  # noqa: E402

SMALL = dict(block_size=16, k_clusters=2, topk_blocks=0, peak_blocks=0, exact_tail=0, backend="torch")


def test_the_default_is_the_crossover_on_cuda_and_1024_elsewhere():
    cfg = get_method("muse").parse_config({})
    assert cfg.min_seq_len is None
    assert cfg.min_len("cuda", 64) == 20480 and cfg.min_len("cuda", 128) == 24576
    assert cfg.min_len("cuda", 32) == 20480 and cfg.min_len("cuda", 96) == 24576 and cfg.min_len("cuda", 256) == 24576
    assert cfg.min_len("cpu", 64) == cfg.min_len("cpu", 128) == 1024
    tc = get_method("muse").parse_config({"far_field": "tilted-cells"})
    assert tc.min_len("cuda", 64) == tc.min_len("cuda", 128) == 32768
    # the per-block tilted design is slower than exact attention at every length measured: it keeps 1024
    assert get_method("muse").parse_config({"far_field": "tilted"}).min_len("cuda", 64) == 1024
    for n in (0, 512, 100000):  # a value set wins everywhere
        c = get_method("muse").parse_config({"min_seq_len": n})
        assert c.min_len("cuda", 64) == c.min_len("cpu", 128) == n
    assert get_method("muse").parse_config({"min_seq_len": "none"}).min_seq_len is None
    # the table holds the crossovers PERFORMANCE.md's measurements put between 16k and 32k, per head dim
    for table in muse_config.CROSSOVER.values():
        assert all(16384 < n <= 32768 for n in table.values())


@pytest.fixture
def muse_calls(monkeypatch):
    """The number of MuSe kernel calls the patched modules make."""
    calls = []
    real = muse_attention_module.muse_attention

    def counted(*a, **kw):
        calls.append(a[0].shape[2])
        return real(*a, **kw)

    monkeypatch.setattr(muse_attention_module, "muse_attention", counted)
    return calls


@pytest.fixture
def on_cuda(monkeypatch):
    """The patched modules see their device as CUDA, with a crossover of 96 tokens for the tiny models' head dim 16."""
    monkeypatch.setattr(muse_attention_module, "_device_type", lambda mod: "cuda")
    monkeypatch.setitem(muse_config.CROSSOVER, "cells", {16: 96, 128: 24576})


def logits(model, n, **kw):
    x = torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        return model(x, use_cache=False, **kw).logits


def test_on_cuda_below_the_crossover_the_layer_runs_exact_attention(on_cuda, muse_calls):
    exact = lp.patch(tiny_model("llama"), "exact")
    model = lp.patch(tiny_model("llama"), "muse", **SMALL)
    assert torch.equal(logits(model, 80), logits(exact, 80))  # 80 < 96: SDPA, bit for bit exact's
    assert muse_calls == []
    out = logits(model, 112)  # 112 >= 96: MuSe on every layer
    assert muse_calls == [112] * 3
    assert (out - logits(exact, 112)).abs().max() > 1e-4


def test_a_min_seq_len_set_wins_over_the_crossover(on_cuda, muse_calls):
    model = lp.patch(tiny_model("llama"), "muse", **SMALL, min_seq_len=0)
    logits(model, 80)
    assert muse_calls == [80] * 3
    muse_calls.clear()
    model = lp.patch(tiny_model("llama"), "muse", **SMALL, min_seq_len=200)
    logits(model, 112)
    assert muse_calls == []


def test_off_cuda_the_default_is_1024(muse_calls):
    model = lp.patch(tiny_model("llama"), "muse", **SMALL)
    logits(model, 112)
    assert muse_calls == []  # 112 < 1024 on the CPU
    one_layer = tiny_model("llama", num_hidden_layers=1, max_position_embeddings=2048)
    model = lp.patch(one_layer, "muse", **{**SMALL, "block_size": 256})
    logits(model, 1100)
    assert muse_calls == [1100]


def test_a_padded_batch_decides_each_row_by_the_crossover(on_cuda, muse_calls):
    """Rows of 112 and 80 real tokens left-padded to 112: the longer row takes MuSe, the other exact attention, as
    each prompt alone would."""
    model = lp.patch(tiny_model("llama"), "muse", **SMALL)
    x = torch.randint(3, 128, (2, 112), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(x)
    am[1, :32] = 0
    with torch.no_grad():
        batch = model(x, attention_mask=am, use_cache=False).logits
        alone = model(x[1:, 32:], use_cache=False).logits
    assert muse_calls == [112] * 3  # one MuSe call per layer, on the long row alone; none for the short one
    torch.testing.assert_close(batch[1, 32:], alone[0], rtol=1e-4, atol=1e-4)


def test_the_op_runs_what_the_layer_runs():
    """`op` (longctx eval speed --op) takes the same decision: exact attention below min_len, MuSe from it."""
    m = get_method("muse")
    q, k, v = rand_qkv(1, 4, 2, 200, 16)
    # the guard off: on random Q/K/V it makes every head exact (MuSe errs ~60% there; tests/test_muse_guard.py)
    default, forced = m.parse_config(SMALL), m.parse_config({**SMALL, "min_seq_len": 0, "guard_error": None})
    assert torch.equal(m.module_cls.op(q, k, v, scale=0.25, config=default), softmax_attention(q, k, v, scale=0.25))
    o = m.module_cls.op(q, k, v, scale=0.25, config=forced)
    assert (o - softmax_attention(q, k, v, scale=0.25)).abs().max() > 1e-4
