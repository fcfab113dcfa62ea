"""The guard's Triton kernels (longctx_patch/kernels/muse/triton_guard.py, under TRITON_INTERPRET=1) against the
PyTorch ops they replace (`estimate_errors(kernels=False)`, itself checked against the first implementation in
tests/test_muse_guard_fast.py): each head's top rows equal `topk` of the row norms (one candidate chunk and several),
the estimates equal to rounding (odd lengths, 7 query heads per kv head, bf16 and fp32, head dims 16-128, a left-padded
batch, some heads skipped, a length with no top rows), the guard's decisions and output the same, and what the kernels
do not take is refused by name."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from longctx_patch.kernels.muse import triton_guard  # noqa: E402
from longctx_patch.kernels.muse.triton_guard import guard_kernels_missing, guard_top_sample  # noqa: E402
from longctx_patch.methods.muse import guard as guard_mod  # noqa: E402
from longctx_patch.methods.muse.config import MuseConfig  # noqa: E402
from longctx_patch.methods.muse.guard import estimate_errors, guard, kept_stratified  # noqa: E402


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def inputs(B, Hq, Hkv, S, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, S, D, generator=g) * torch.linspace(0.3, 1.4, Hq)[None, :, None, None]
    k, v = (torch.randn(B, Hkv, S, D, generator=g) for _ in range(2))
    o = torch.randn(B, S, Hq, D, generator=g) * torch.rand(B, S, Hq, 1, generator=g)  # rows of unequal norm
    return q.to(dtype), k.to(dtype), v.to(dtype), o.to(dtype)


@pytest.mark.parametrize("chunks", ["one", "several"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_top_rows_are_topk_of_the_row_norms(chunks, dtype, monkeypatch):
    if chunks == "several":  # small blocks and chunks: the candidates merge over several steps
        monkeypatch.setattr(triton_guard, "_BLOCK", 32)
        monkeypatch.setattr(triton_guard, "_CHUNK", 64)
    B, Hq, S, D, first, top = 2, 7, 701, 32, 37, 8
    *_, o = inputs(B, Hq, 1, S, D, dtype, seed=1)
    ranks, _ = kept_stratified(S, first, 24, o.device)
    pos = guard_top_sample(o, ranks, first, top)
    assert pos.shape == (B, Hq, 24 + top) and pos.dtype == torch.long
    assert torch.equal(pos[:, :, :24], ranks.expand(B, Hq, 24))
    norms = torch.linalg.vector_norm(o[:, first:].transpose(1, 2), dim=-1, dtype=torch.float32)
    want = norms.topk(top, dim=-1)
    got = pos[:, :, 24:]
    assert (got >= first).all() and (got < S).all()
    assert torch.equal(got.sort(-1).values, (want.indices + first).sort(-1).values)


CASES = [  # B, Hq, Hkv, S, D, first, rows
    (1, 14, 2, 1031, 64, 100, 64),   # Qwen's heads, the default rows
    (2, 7, 1, 333, 32, 40, 16),     # 7 query heads per kv head
    (1, 4, 2, 257, 128, 30, 16),
    (2, 3, 3, 150, 16, 120, 64),    # fewer approximated rows than rows: every one, no top rows
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
def test_the_kernels_estimate_what_the_ops_estimate(case, dtype, padded):
    B, Hq, Hkv, S, D, first, rows = case
    q, k, v, o = inputs(B, Hq, Hkv, S, D, dtype, seed=S)
    km = None
    if padded:
        km = torch.ones(B, S, dtype=torch.bool)
        km[-1, : S - first // 2] = False  # the last row: nothing approximated
    for heads in (None, [h for h in range(Hq) if h % 2 == 0]):
        got, gc = estimate_errors(o, q, k, v, km, scale=D ** -0.5, first=first, rows=rows, heads=heads, kernels=True)
        want, wc = estimate_errors(o, q, k, v, km, scale=D ** -0.5, first=first, rows=rows, heads=heads, kernels=False)
        assert gc == wc and got.dtype == torch.float32 and got.shape == (B, Hq)
        assert torch.equal(got.isnan(), want.isnan())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, equal_nan=True)
        if padded and B > 1:
            assert got[-1].isnan().all()
        if heads is not None:
            assert got[:, 1::2].isnan().all()


def test_the_guard_decides_and_computes_as_with_the_ops(monkeypatch):
    """With guard_kernels (the default) and a budget that some heads pass and some do not: the same heads made exact
    and the same output as the ops', bit for bit; backend torch keeps the ops."""
    B, Hq, Hkv, S, D = 1, 14, 2, 900, 32
    q, k, v, o = inputs(B, Hq, Hkv, S, D, torch.float32, seed=5)
    cfg = MuseConfig(block_size=32, guard_error=0.9)
    err, _ = estimate_errors(o, q, k, v, None, scale=D ** -0.5, first=guard_mod.first_approximated(cfg),
                             rows=cfg.guard_rows)
    e = err[0].sort().values
    budget = float(e[Hq // 2 - 1] + e[Hq // 2]) / 2  # half the heads over
    calls = []
    real = guard_mod.estimate_errors
    monkeypatch.setattr(guard_mod, "estimate_errors", lambda *a, **kw: calls.append(kw["kernels"]) or real(*a, **kw))
    with guard_mod.guard_log() as log:
        got = guard(o, q, k, v, None, config=MuseConfig(block_size=32, guard_error=budget), scale=D ** -0.5)
    with guard_mod.guard_log() as log_ops:
        want = guard(o, q, k, v, None, config=MuseConfig(block_size=32, guard_error=budget, guard_kernels=False),
                     scale=D ** -0.5)
    guard(o, q, k, v, None, config=MuseConfig(block_size=32, guard_error=budget, guard_kernels=True, backend="torch"),
          scale=D ** -0.5)
    assert calls == [None, False, False]  # guard_kernels: wherever they run; off, or backend torch: the ops
    assert log.calls[0].exact == log_ops.calls[0].exact and 0 < len(log.calls[0].exact) < Hq
    assert torch.equal(got, want)


def test_what_the_kernels_do_not_take_is_refused_by_name():
    o = torch.zeros(1, 8, 2, 48)
    assert "head_dim 48" in guard_kernels_missing(o, 16)
    o = torch.zeros(1, 8, 2, 64)
    assert guard_kernels_missing(o, 16) is None
    assert "65 top rows" in guard_kernels_missing(o, 65)
    assert "dtype" in guard_kernels_missing(o.double(), 16)
