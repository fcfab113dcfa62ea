"""A LoLA prefill that continues a state (a prefill cut into calls, as transformers' `prefill_chunk_size` cuts it)
runs the two-pass parallel path (`prefill.lola_parallel` on the extended sequence) with the result of the chunk loop
and of one unbroken prefill: outputs, (H, s), the sparse slots, the window buffer, and the decode steps after it."""

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from longctx_patch.kernels.lola import prefill  # noqa: E402
from longctx_patch.kernels.lola import reference as ref  # noqa: E402
from longctx_patch.kernels.lola import LolaRun, LolaState, StateSizes, lola_process  # noqa: E402

D, F = 16, 8


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def _seq(B, HQ, HKV, S, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, S, D, generator=g)
    k = torch.randn(B, HKV, S, D, generator=g)
    v = torch.randn(B, HKV, S, D, generator=g)
    Wq = torch.randn(HQ, D, F, generator=g) * D ** -0.25
    Wk = torch.randn(HQ, D, F, generator=g) * D ** -0.25
    gw = torch.sigmoid(torch.randn(HQ, generator=g))
    return (q.to(dtype), k.to(dtype), v.to(dtype), ref.hedgehog_feature_map(q, Wq).to(dtype), gw, torch.ones(HQ), Wk)


def _state(seq, *, window, chunk, lam, sparse_heads):
    q, k, _, fq, _, _, _ = seq
    sizes = StateSizes(q.shape[0], q.shape[1], k.shape[1], D, 2 * F, lam, sparse_heads=sparse_heads)
    return LolaState.empty(sizes, q.dtype, q.device, capacity=window + chunk)


def _feed(st, seq, splits, *, window, chunk, lam, backend, mask=None, **_):
    """lola_process over the next pieces `splits` of the sequence (from position st.pos): their outputs."""
    q, k, v, fq, g, lf, Wk = seq
    phi_k = lambda x: ref.hedgehog_feature_map(x, Wk, out_dtype=q.dtype)  # noqa: E731
    run = LolaRun(phi_k=phi_k, window=window, chunk=chunk, lam=lam, scale=D ** -0.5, backend=backend)
    outs, i = [], st.pos
    for n in splits:
        sl = slice(i, i + n)
        outs.append(lola_process(st, q[:, :, sl], k[:, :, sl], v[:, :, sl], fq[:, :, sl], g, lf, run,
                                 key_mask_new=None if mask is None else mask[:, sl]))
        i += n
    return torch.cat(outs, 1)


def _run(splits, seq, **kw):
    st = _state(seq, **{n: kw[n] for n in ("window", "chunk", "lam", "sparse_heads")})
    return _feed(st, seq, splits, **kw), st


@pytest.fixture
def parallel_calls(monkeypatch):
    """(pos, new tokens) of every call that took the two-pass prefill."""
    calls = []
    real = prefill.lola_parallel
    monkeypatch.setattr(prefill, "lola_parallel",
                        lambda st, q, *a, **kw: calls.append((st.pos, q.shape[2])) or real(st, q, *a, **kw))
    return calls


def _pairs(st):
    """The sparse slots' pairs per (row, sparse head) as a set: the valid (k, v) rows in a fixed order (slots of equal
    score may sit in either order)."""
    out = []
    w = torch.arange(1, 2 * D + 1, dtype=torch.float64)
    for b in range(st.sp_k.shape[0]):
        for h in range(st.sp_k.shape[1]):
            ok = st.sp_valid[b, h]
            rows = torch.cat([st.sp_k[b, h][ok], st.sp_v[b, h][ok]], -1).double()
            out.append(rows[torch.argsort(rows @ w)])
    return out


def _assert_same_state(a, b, tol):
    torch.testing.assert_close(a.H, b.H, atol=tol, rtol=tol)
    torch.testing.assert_close(a.s, b.s, atol=tol, rtol=tol)
    assert torch.equal(a.sp_valid, b.sp_valid)
    for pa, pb in zip(_pairs(a), _pairs(b)):
        assert torch.equal(pa, pb)
    torch.testing.assert_close(a.sp_score.sort(-1).values, b.sp_score.sort(-1).values, atol=1e-4, rtol=1e-4)
    assert a.pos == b.pos and a.nb == b.nb
    assert torch.equal(a.wk, b.wk) and torch.equal(a.wv, b.wv)
    assert (a.win_mask is None) == (b.win_mask is None)
    if a.win_mask is not None:
        assert torch.equal(a.wmask, b.wmask)


CASES = {
    # mid-chunk continuations (37 and 77 with chunk 16); the first piece is fresh and two-pass too
    "kv": dict(heads=(4, 2), sparse_heads=2, window=16, chunk=16, lam=8, splits=[37, 40, 47], B=2),
    # a continuation right after an eviction (64 with chunk 32); window 16 < chunk 32: the buffer starts 16 rows
    # after a multiple of the chunk, so the extended sequence has 16 rows of padding in front
    "query-gap": dict(heads=(4, 2), sparse_heads=4, window=16, chunk=32, lam=8, splits=[64, 64]),
    # window 48 > chunk 16: the first piece (20 tokens, the chunk loop) leaves a buffer that starts at 0 and no pair
    # decided; the second continues it from an empty sparse cache and H = 0
    "wide-window": dict(heads=(4, 2), sparse_heads=2, window=48, chunk=16, lam=8, splits=[20, 40, 36]),
    # 7 query heads per kv head, one sparse cache per query head (each its own rows of the extended sequence)
    "gqa7-query": dict(heads=(7, 1), sparse_heads=7, window=16, chunk=16, lam=4, splits=[40, 33, 35]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_continued_prefill_equals_unbroken_prefill_and_chunk_loop(case, parallel_calls):
    """fp32: the prefill cut into `splits` (the first piece fresh, the others continuing the state) against one
    unbroken prefill and the chunk loop (torch), then decode steps (`sparse_cache.decode_step`) across the next
    eviction against the chunk loop's."""
    c = dict(CASES[case])
    (HQ, HKV), splits, B = c.pop("heads"), c.pop("splits"), c.pop("B", 1)
    S, C = sum(splits), c["chunk"]
    steps = (S // C + 1) * C - S + 1 if C - S % C < 8 else 2  # decode steps: across the next eviction when near
    seq = _seq(B, HQ, HKV, S + steps, seed=len(case))
    got, st = _run(splits, seq, backend="triton", **c)
    assert [p for p in parallel_calls if p[0] > 0] == [(sum(splits[:i]), n) for i, n in enumerate(splits) if i > 0]
    parallel_calls.clear()
    full, st_full = _run([S], seq, backend="triton", **c)
    assert parallel_calls == [(0, S)]
    loop, st_loop = _run(splits, seq, backend="torch", **c)
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, loop, atol=1e-5, rtol=1e-5)
    _assert_same_state(st, st_full, 1e-5)
    _assert_same_state(st, st_loop, 1e-5)
    assert st.sp_valid.any()  # the sparse cache is used (pairs kept through the continuations)
    dec = _feed(st, seq, [1] * steps, backend="triton", **c)
    dec_loop = _feed(st_loop, seq, [1] * steps, backend="torch", **c)
    torch.testing.assert_close(dec, dec_loop, atol=1e-5, rtol=1e-5)
    _assert_same_state(st, st_loop, 1e-5)


def test_continued_prefill_bf16_and_left_padding_of_whole_chunks(parallel_calls):
    """bf16 (loose), row 1 left-padded by two whole chunks (no phases: one grid, the window mask carried on), the
    pieces passing their mask columns; then decode steps across an eviction."""
    B, HQ, HKV, W, C, lam = 2, 4, 2, 16, 16, 8
    splits, steps = [40, 38, 46], 6  # decode across the eviction at 128
    S = sum(splits)
    seq = _seq(B, HQ, HKV, S + steps, seed=3, dtype=torch.bfloat16)
    mask = torch.ones(B, S + steps, dtype=torch.bool)
    mask[1, :2 * C] = False
    kw = dict(window=W, chunk=C, lam=lam, sparse_heads=HKV, mask=mask)
    got, st = _run(splits, seq, backend="triton", **kw)
    assert st.phases is None and st.win_mask is not None
    assert [p for p in parallel_calls if p[0] > 0] == [(40, 38), (78, 46)]
    full, st_full = _run([S], seq, backend="triton", **kw)
    loop, st_loop = _run(splits, seq, backend="torch", **kw)
    got = torch.cat([got, _feed(st, seq, [1] * steps, backend="triton", **kw)], 1)
    full = torch.cat([full, _feed(st_full, seq, [1] * steps, backend="triton", **kw)], 1)
    loop = torch.cat([loop, _feed(st_loop, seq, [1] * steps, backend="torch", **kw)], 1)
    real = mask[:, :, None, None].expand_as(got)
    assert got.dtype == torch.bfloat16 and got[~real].abs().max().item() == 0
    for want, st_want in ((full, st_full), (loop, st_loop)):
        torch.testing.assert_close(got[real].float(), want[real].float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(st.H, st_want.H, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(st.s, st_want.s, atol=1e-5, rtol=1e-5)
        assert torch.equal(st.sp_valid, st_want.sp_valid)
        assert st.nb == st_want.nb and torch.equal(st.wk, st_want.wk) and torch.equal(st.wmask, st_want.wmask)
    for st_want in (st_full, st_loop):  # the same kept pairs
        for a, b in zip(_pairs(st), _pairs(st_want)):
            assert torch.equal(a, b)


def test_continuation_takes_the_chunk_loop_when_rows_are_out_of_phase(parallel_calls):
    """A left padding that is no whole chunk gives the rows their own grids (`st.phases`): a continued piece runs
    the chunk loop (the rows evict at different positions), with the result of the rows alone."""
    B, HQ, HKV, W, C, lam = 2, 4, 2, 16, 16, 4
    splits = [40, 36]
    S = sum(splits)
    seq = _seq(B, HQ, HKV, S, seed=5)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, :5] = False
    kw = dict(window=W, chunk=C, lam=lam, sparse_heads=HKV)
    got, st = _run(splits, seq, backend="triton", mask=mask, **kw)
    assert st.phases is not None
    assert all(p[0] == 0 for p in parallel_calls)  # fresh phase groups only
    loop, _ = _run(splits, seq, backend="torch", mask=mask, **kw)
    real = mask[:, :, None, None].expand_as(got)
    torch.testing.assert_close(got[real], loop[real], atol=1e-5, rtol=1e-5)


def test_parallel_ok_continues_in_place_states_with_one_grid():
    """The dispatch rule: at least two chunks of new tokens; a continued state must be in place, with one grid (no
    phases) and the fixed window buffer."""
    B, HQ, HKV, W, C = 1, 4, 2, 16, 16
    q, k = torch.zeros(B, HQ, 2 * C, D), torch.zeros(B, HKV, 2 * C, D)
    st = LolaState.empty(StateSizes(B, HQ, HKV, D, 2 * F, 4), q.dtype, q.device, capacity=W + C)
    kw = dict(window=W, chunk=C, lam=4)
    assert prefill.parallel_ok(st, q, k, **kw)
    st.pos, st.nb = 21, 21
    assert prefill.parallel_ok(st, q, k, **kw)
    assert not prefill.parallel_ok(st, q[:, :, :-1], k[:, :, :-1], **kw)  # fewer than two chunks
    assert not prefill.parallel_ok(st, q, k, window=W, chunk=C, lam=0)  # lolcats: `lolcats_parallel`
    st.phases = object()
    assert not prefill.parallel_ok(st, q, k, **kw)
    st.phases, st.inplace = None, False
    assert not prefill.parallel_ok(st, q, k, **kw)


def test_extended_rows_put_the_evictions_on_the_chunk_grid():
    """The extended sequence starts at the multiple of the chunk at or before the first buffered token; its first
    eviction is the one at the end of the current chunk; the queries start on a query block."""
    for pos, nb, S, C in [(37, 21, 40, 16), (64, 16, 64, 32), (20, 20, 45, 16), (128, 64, 32, 64), (100, 36, 50, 16)]:
        x0, first, n_real, q_pad = prefill.extended_rows(pos, nb, S, chunk=C)
        assert x0 % C == 0 and 0 <= pos - nb - x0 < C
        assert x0 + (first + 1) * C == (pos // C + 1) * C  # X's eviction `first` is the next one of the stream
        assert n_real == pos + S - x0
        assert (pos - x0 - q_pad) % min(64, C) == 0 and 0 <= q_pad < min(64, C)


def test_prefill_evictions_started_mid_stream_continue_an_unbroken_run():
    """`PrefillEvictions.start`: the evictions from chunk f on, started from the state an unbroken run had after
    eviction f - 1 (its (H, s) and sparse slots), give that run's states and slots, for both sparse-head layouts,
    a first fold still to come (H = 0: the state stays exactly 0 while nothing is folded) and a first eviction that
    folds nothing after earlier folds (its candidates masked: the state stays as it was)."""
    from longctx_patch.kernels.lola import triton_kernels as tk

    B, HQ, HKV, S, W, C = 2, 4, 2, 96, 16, 16
    g = torch.Generator().manual_seed(8)
    k = torch.randn(B, HKV, S, D, generator=g)
    v = torch.randn(B, HKV, S, D, generator=g)
    fk = ref.hedgehog_feature_map(k, torch.randn(HQ, D, F, generator=g) * D ** -0.25)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[:, 48:64] = False  # eviction 4's candidates
    for hs, lam, f in [(HQ, 6, 4), (HKV, 40, 2)]:  # lam 40: nothing folded by eviction 2
        plan = tk.EvictionPlan(window=W, chunk=C, lam=lam, sparse_heads=hs, n_ev=S // C)
        one = tk.PrefillEvictions(fk, v, mask, plan)
        one.run()
        two = tk.PrefillEvictions(fk, v, mask, dataclasses.replace(plan, first=f))
        two.start(one.H_all[f], one.s_all[f], one.SPIDX[f], one.SPSC[f])
        two.run()
        if lam == 40:
            assert (one.H_all[f + 1] == 0).all() and (two.H_all[f + 1] == 0).all()
        else:
            assert (two.H_all[f] != 0).any()
            torch.testing.assert_close(two.H_all[f + 1], two.H_all[f], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(two.H_all[f:], one.H_all[f:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(two.s_all[f:], one.s_all[f:], atol=1e-5, rtol=1e-5)
        assert torch.equal(two.SPIDX[f:], one.SPIDX[f:])
        torch.testing.assert_close(two.SPSC[f:], one.SPSC[f:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("combine", ["shifted", "unshifted"])
def test_last_prompt_token_alone_equals_unbroken_prefill_under_either_combination(combine):
    """A prompt whose last token comes in a call of its own (S - 1 tokens, then 1: what a probe of the last prompt
    position or a server appending one token does) gives the unbroken prefill's outputs under both combinations,
    Triton and torch, with the sparse cache in use; so do the decode steps after it."""
    window, chunk, lam = 16, 16, 8
    S, steps = 100, 3
    seq = _seq(1, 4, 2, S + steps, seed=3)
    q, k, v, fq, g, lf, Wk = seq
    phi_k = lambda x: ref.hedgehog_feature_map(x, Wk, out_dtype=q.dtype)  # noqa: E731

    def run(splits, backend, combine=combine):
        st = _state(seq, window=window, chunk=chunk, lam=lam, sparse_heads=2)
        lola_run = LolaRun(phi_k=phi_k, window=window, chunk=chunk, lam=lam, scale=D ** -0.5, backend=backend,
                           combine=combine)
        outs, i = [], 0
        for n in splits:
            sl = slice(i, i + n)
            outs.append(lola_process(st, q[:, :, sl], k[:, :, sl], v[:, :, sl], fq[:, :, sl], g, lf, lola_run))
            i += n
        return torch.cat(outs, 1), st

    whole, st_whole = run([S] + [1] * steps, "triton")
    split, st_split = run([S - 1, 1] + [1] * steps, "triton")
    loop, st_loop = run([S - 1, 1] + [1] * steps, "torch")
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split, loop, atol=1e-5, rtol=1e-5)
    _assert_same_state(st_split, st_whole, 1e-5)
    _assert_same_state(st_split, st_loop, 1e-5)
    assert st_split.sp_valid.any()
    other = run([S - 1, 1] + [1] * steps, "triton", "unshifted" if combine == "shifted" else "shifted")[0]
    assert (other - split).abs().max() > 1e-3  # the combination reaches the split path
