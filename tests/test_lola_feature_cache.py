"""The feature cache (`LolaState.win_fk`: phi(k) of the buffered keys older than the window, computed once per key)
gives the same attention and state as recomputing phi(k) every step (`feature_cache=False`, the layout before it):
prefill + decode over several evictions, lam > 0 and lam = 0, GQA, a left-padded batch, torch and the Triton
interpreter; through the model (generate) with and without the simulated graph replay."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import longctx_patch as lp  # noqa: E402
from longctx_patch import decode_graphs as dg  # noqa: E402
from longctx_patch.kernels.lola import reference as ref  # noqa: E402
from longctx_patch.kernels.lola import LolaRun, LolaState, StateSizes, lola_process  # noqa: E402

from conftest import tiny_model  # noqa: E402


def _seq(B, HQ, HKV, S, D, F, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, S, D, generator=g)
    k = torch.randn(B, HKV, S, D, generator=g)
    v = torch.randn(B, HKV, S, D, generator=g)
    Wq = torch.randn(HQ, D, F, generator=g) * D ** -0.25
    Wk = torch.randn(HQ, D, F, generator=g) * D ** -0.25
    gw = torch.sigmoid(torch.randn(HQ, generator=g))
    return q, k, v, ref.hedgehog_feature_map(q, Wq), gw, torch.ones(HQ), Wk


def _run(seq, splits, *, feature_cache, backend, window, chunk, lam, mask=None, calls=None):
    q, k, v, fq, g, lf, Wk = seq
    B, HQ, _, D = q.shape
    st = LolaState.empty(StateSizes(B, HQ, k.shape[1], D, fq.shape[-1], lam), q.dtype, q.device,
                         feature_cache=feature_cache)

    def phi_k(x):
        if calls is not None:
            calls.append(x.shape[2])
        return ref.hedgehog_feature_map(x, Wk, out_dtype=q.dtype)

    run = LolaRun(phi_k=phi_k, window=window, chunk=chunk, lam=lam, scale=D ** -0.5, backend=backend)
    outs, i = [], 0
    for n in splits:
        sl = slice(i, i + n)
        outs.append(lola_process(st, q[:, :, sl], k[:, :, sl], v[:, :, sl], fq[:, :, sl], g, lf, run,
                                 key_mask_new=None if mask is None else mask[:, sl]))
        i += n
    return torch.cat(outs, 1), st


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("lam", [3, 0])
@pytest.mark.parametrize("heads", [(4, 2), (14, 2)])
@pytest.mark.parametrize("padded", [False, True])
def test_feature_cache_equals_recomputation(backend, lam, heads, padded):
    HQ, HKV = heads
    B, D, F, window, chunk = 2, 16, 8, 6, 4
    P, steps = (13, 30) if backend == "torch" else (10, 12)  # the interpreter is slow; 12 steps: 3 evictions
    seq = _seq(B, HQ, HKV, P + steps, D, F, seed=HQ + lam)
    mask = None
    if padded:
        mask = torch.ones(B, P + steps, dtype=torch.bool)
        mask[1, :5] = False  # left padding of row 1 (no whole chunk: its own eviction grid)
    kw = dict(backend=backend, window=window, chunk=chunk, lam=lam, mask=mask)
    calls_new, calls_old = [], []
    got, st = _run(seq, [P] + [1] * steps, feature_cache=True, calls=calls_new, **kw)
    want, st_want = _run(seq, [P] + [1] * steps, feature_cache=False, calls=calls_old, **kw)
    real = slice(None) if mask is None else mask[:, :, None, None].expand_as(want)
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    for name in ("H", "s", "sp_k", "sp_v", "sp_score"):
        torch.testing.assert_close(getattr(st, name), getattr(st_want, name), atol=1e-5, rtol=1e-5)
    assert st.nb == st_want.nb and st.pos == st_want.pos == P + steps
    assert st_want.win_fk is None and st.win_fk is not None and st.win_fk.shape[2] == chunk
    nl = max(st.nb - window, 0)  # the cache holds phi of the buffered keys older than the window
    torch.testing.assert_close(st.win_fk[:, :, :nl], ref.hedgehog_feature_map(st.win_k[:, :, :nl], seq[-1]),
                               atol=1e-6, rtol=1e-6)
    # phi(k) of fewer keys: each key once in the decode steps (no recomputation of the linear keys)
    assert sum(calls_new) < sum(calls_old)


def test_feature_cache_decode_computes_phi_of_one_key_per_step():
    seq = _seq(1, 4, 2, 40, 16, 8)
    calls = []
    _run(seq, [16] + [1] * 24, feature_cache=True, backend="torch", window=6, chunk=4, lam=3, calls=calls)
    _, st = _run(seq, [16], feature_cache=True, backend="torch", window=6, chunk=4, lam=3)
    # after the prefill, per step: one key leaving the window, plus the sparse keys at an eviction (every 4th)
    decode = calls[-(24 + 24 // 4):]
    assert sorted(set(decode)) == [1, 3], decode


LOLA = {"window": 4, "chunk": 4, "sparse_cache": 4, "feature_dim": 8, "backend": "torch", "checkpoint": "none"}
LOLCATS = {k: v for k, v in LOLA.items() if k != "sparse_cache"}


def _generate(model, ids, mask, n):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores, 1), out.past_key_values


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("method,config", [("lola", LOLA), ("lolcats", LOLCATS)])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_generate_with_feature_cache_equals_without(method, config, backend, padded, monkeypatch):
    """generate(): feature cache on (replayed with the simulated graphs, no padding; eager, left padding) equals
    the recomputation, GQA 14 / 2 heads. Under the interpreter one decoder layer (every layer runs the same
    kernels on its own cache) and 10 new tokens."""
    monkeypatch.setenv("LONGCTX_DECODE_GRAPHS", "simulate")  # the models patched below replay on the CPU
    torch.manual_seed(0)
    model = tiny_model("llama", num_attention_heads=14, num_key_value_heads=2, hidden_size=224,
                       num_hidden_layers=3 if backend == "torch" else 1).eval()
    ids = torch.randint(3, 100, (2, 11))
    n = 30 if backend == "torch" else 10
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :3] = 0
    res = {}
    for fc in (True, False):
        lp.patch(model, method, **{**config, "backend": backend, "feature_cache": fc})
        res[fc] = _generate(model, ids, mask, n)
        lp.unpatch(model)
    (seq_a, sc_a, cache_a), (seq_b, sc_b, cache_b) = res[True], res[False]
    assert torch.equal(seq_a, seq_b)
    torch.testing.assert_close(sc_a, sc_b, atol=1e-5, rtol=0)
    st = dg.stats(cache_a)
    assert (st is None) == padded and (padded or st["replays"] > 0), st
    assert cache_a.layers[0].win_fk is not None and cache_b.layers[0].win_fk is None
    assert cache_a.nbytes() > cache_b.nbytes()
