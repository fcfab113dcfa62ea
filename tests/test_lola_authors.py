"""`lola` against a small model of the LoLA authors' rule (docs/lola.md, "Against the authors' code").

`authors_rule` restates, per query head, what the authors' sparse-window attention module does: the sequence in
chunks of C (= their window size); a query of chunk c attends exactly (softmax) to the sparse cache, the whole
previous chunk and its own chunk up to itself, and linearly to the state (H, s); when chunk c is done, chunk c - 1
leaves the window: its pairs and the sparse pairs are scored by self-recall error against the current (H, s), the G
highest stay exact and the rest is folded. The combination is theirs by default (exact term exp(q.k / sqrt d) with
no max subtracted, linear weight 1 - g, + 1e-6 in the normaliser); the keywords switch each point to ours, so one
model shows where the two agree (scoring, schedule, selection, fold: the same state) and which point moves the
outputs.
"""

import math

import pytest
import torch

from longctx_patch.kernels.lola import LolaRun, LolaState, StateSizes, lola_process
from longctx_patch.kernels.lola import reference as ref

HQ, HKV, D, F = 4, 2, 16, 8
EPS = 1e-6


def _seq(S, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HQ, S, D, generator=g)
    k = torch.randn(1, HKV, S, D, generator=g)
    v = torch.randn(1, HKV, S, D, generator=g)
    wq = torch.randn(HQ, D, F, generator=g) * D ** -0.25
    wk = torch.randn(HQ, D, F, generator=g) * D ** -0.25
    gate = torch.sigmoid(torch.randn(HQ, generator=g))
    return q, k, v, wq, wk, gate


def _self_recall_error(fk, v, H, s):
    """The authors' score: || v - phi(k)^T H / (phi(k)^T s + 1e-6) || (the norm, not its square)."""
    pred = (fk @ H) / (fk @ s + EPS)[:, None]
    return (v - pred).norm(dim=-1)


def authors_rule(q, k, v, fq, fk, gate, *, C, G, window="block", shift=False, lin=None, eps_out=EPS):
    """q/k/v [H, S, D] (kv heads repeated, as the authors' module repeats them), fq/fk [H, S, F2], gate [H].

    window: "block" (theirs: the previous chunk whole + the own chunk up to the query) or "sliding" (ours: the last
    C keys exact, older undecided keys linear by phi(q).phi(k)); shift: subtract the row max of the exact scores
    (ours, LoLCATs) or not (theirs); lin: the linear term's weight per head (theirs 1 - g; ours 1 as trained).
    Returns (out [H, S, D], H [H, F2, D], s [H, F2], the sparse positions and their scores per head)."""
    nh, S, d = q.shape
    f2 = fk.shape[-1]
    lin = 1 - gate if lin is None else lin
    scale = d ** -0.5
    Hs, ss = torch.zeros(nh, f2, d), torch.zeros(nh, f2)
    heap = [torch.zeros(0, dtype=torch.long) for _ in range(nh)]
    heap_score = [torch.zeros(0) for _ in range(nh)]
    out = torch.zeros(nh, S, d)
    for c in range(math.ceil(S / C)):
        lo, hi = c * C, min((c + 1) * C, S)
        first_undecided = max(c - 1, 0) * C
        for h in range(nh):
            for i in range(lo, hi):
                if window == "block":
                    exact, linear = torch.arange(first_undecided, i + 1), torch.arange(0)
                else:
                    exact = torch.arange(max(i - C + 1, 0), i + 1)
                    linear = torch.arange(first_undecided, max(i - C + 1, first_undecided))
                idx = torch.cat([heap[h], exact])
                sc = (k[h, idx] @ q[h, i]) * scale
                p = torch.exp(sc - (sc.max() if shift else 0.0))
                a = fk[h, linear] @ fq[h, i]
                num = gate[h] * (p @ v[h, idx]) + lin[h] * (fq[h, i] @ Hs[h] + a @ v[h, linear])
                den = gate[h] * p.sum() + lin[h] * (fq[h, i] @ ss[h] + a.sum())
                out[h, i] = num / (den + eps_out)
        if hi < (c + 1) * C or c == 0:
            continue  # only a full chunk pushes the previous one out of the window
        cand = torch.arange((c - 1) * C, c * C)
        for h in range(nh):
            sc_c = _self_recall_error(fk[h, cand], v[h, cand], Hs[h], ss[h])
            if heap[h].numel() == 0 and G >= C:  # the first chunk to leave fits: all of it stays exact
                heap[h], heap_score[h], folded = cand, sc_c, cand[:0]
            elif heap[h].numel() and heap[h].numel() + C <= G:  # room left: appended, nothing scored against it
                heap[h], heap_score[h], folded = torch.cat([heap[h], cand]), torch.cat([heap_score[h], sc_c]), cand[:0]
            else:  # the sparse pairs rescored against the current state, the G best of both stay
                sc_h = _self_recall_error(fk[h, heap[h]], v[h, heap[h]], Hs[h], ss[h])
                pos, score = torch.cat([heap[h], cand]), torch.cat([sc_h, sc_c])
                order = torch.sort(score, descending=True, stable=True).indices
                heap[h], heap_score[h], folded = pos[order[:G]], score[order[:G]], pos[order[G:]]
            Hs[h] += fk[h, folded].T @ v[h, folded]
            ss[h] += fk[h, folded].sum(0)
    return out, Hs, ss, heap, heap_score


def _inputs(S, seed=0):
    q, k, v, wq, wk, gate = _seq(S, seed)
    fq, fk = ref.hedgehog_feature_map(q, wq), ref.hedgehog_feature_map(k, wk)
    kx, vx = ref.expand_kv(k, HQ), ref.expand_kv(v, HQ)
    return q, k, v, fq, fk, gate, wk, kx, vx


def _ours(q, k, v, fq, gate, wk, *, C, G, lf, sparse_heads=HQ, splits=None, combine="shifted"):
    st = LolaState.empty(StateSizes(1, HQ, HKV, D, 2 * F, G, sparse_heads=sparse_heads), torch.float32, q.device)
    phi_k = lambda x: ref.hedgehog_feature_map(x, wk)  # noqa: E731
    run = LolaRun(phi_k=phi_k, window=C, chunk=C, lam=G, scale=D ** -0.5, backend="torch", combine=combine)
    outs, i = [], 0
    for n in splits or [q.shape[2]]:
        sl = slice(i, i + n)
        outs.append(lola_process(st, q[:, :, sl], k[:, :, sl], v[:, :, sl], fq[:, :, sl], gate, lf, run))
        i += n
    return torch.cat(outs, 1)[0].transpose(0, 1), st  # [HQ, S, D]


def _positions(sp_k, kx):
    """The positions of the sparse keys sp_k [H, L, D] in kx [H, S, D] (random keys are distinct)."""
    return [sorted(int((kx[h] == key).all(-1).nonzero()) for key in sp_k[h]) for h in range(sp_k.shape[0])]


@pytest.mark.parametrize("G", [5, 12])  # G < C: the first chunk's top G; G > C: appended, then rescored
def test_same_state_as_the_authors_rule(G):
    """Scoring, schedule, selection and fold agree: with window = chunk = C and one sparse cache per query head
    (their layout), the sparse sets, their scores (the norm) and (H, s) equal the authors' rule."""
    C, S = 8, 48
    q, k, v, fq, fk, gate, wk, kx, vx = _inputs(S)
    _, H, s, heap, heap_score = authors_rule(q[0], kx[0], vx[0], fq[0], fk[0], gate, C=C, G=G)
    _, st = _ours(q, k, v, fq, gate, wk, C=C, G=G, lf=torch.ones(HQ))
    torch.testing.assert_close(st.H[0], H, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st.s[0], s, atol=1e-5, rtol=1e-5)
    assert _positions(st.sp_k[0], kx[0]) == [sorted(p.tolist()) for p in heap]
    # the last eviction rescored every sparse pair: the stored scores are the authors' (sorted, ours keeps order)
    torch.testing.assert_close(st.sp_score[0], torch.stack([x.sort(descending=True).values for x in heap_score]),
                               atol=1e-5, rtol=1e-5)


def test_ours_is_the_authors_rule_with_the_three_combination_points_switched():
    """The outputs: the authors' rule with a sliding window, the max subtracted and the linear weight 1 (and no
    1e-6 in the normaliser) is ours exactly; each of the three points alone moves the outputs."""
    C, G, S = 8, 6, 40
    q, k, v, fq, fk, gate, wk, kx, vx = _inputs(S, seed=1)
    ours, _ = _ours(q, k, v, fq, gate, wk, C=C, G=G, lf=torch.ones(HQ))
    args = (q[0], kx[0], vx[0], fq[0], fk[0], gate)
    mine = dict(C=C, G=G, window="sliding", shift=True, lin=torch.ones(HQ), eps_out=0.0)
    torch.testing.assert_close(authors_rule(*args, **mine)[0], ours, atol=1e-5, rtol=1e-5)
    for point in ({"window": "block"}, {"shift": False}, {"lin": 1 - gate}):
        other = authors_rule(*args, **{**mine, **point})[0]
        assert (other - ours).abs().max() > 1e-2, point
    theirs = authors_rule(*args, C=C, G=G)[0]
    assert (theirs - ours).abs().max() > 1e-2
    # the first chunk sees no state and no sparse pair: plain softmax on both sides, whatever the combination
    torch.testing.assert_close(theirs[:, :C], ours[:, :C], atol=1e-5, rtol=1e-5)


def test_affine_factors_give_the_authors_linear_weight():
    """Their linear weight 1 - g is our `affine_factors=true` (LoLCATs' checkpoints were trained without it)."""
    C, G, S = 8, 6, 40
    q, k, v, fq, fk, gate, wk, kx, vx = _inputs(S, seed=2)
    ours, _ = _ours(q, k, v, fq, gate, wk, C=C, G=G, lf=1 - gate)
    want = authors_rule(q[0], kx[0], vx[0], fq[0], fk[0], gate, C=C, G=G, window="sliding", shift=True,
                        eps_out=0.0)[0]
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)


def test_unshifted_exact_term_is_the_linear_term_weighed_down_by_exp_of_minus_the_row_max():
    """Without the max subtracted, the exact term weighs exp(m) more against the linear one than in LoLCATs'
    convention: the authors' rule equals ours with the linear weight of each query scaled by exp(-m)."""
    C, G, S = 8, 6, 32
    q, k, v, fq, fk, gate, wk, kx, vx = _inputs(S, seed=3)
    q = q * 3  # sharper scores: m of several units, as in trained models
    args = (q[0], kx[0], vx[0], fq[0], fk[0], gate)
    unshifted = authors_rule(*args, C=C, G=G, window="sliding", shift=False, lin=torch.ones(HQ), eps_out=0.0)[0]
    shifted = authors_rule(*args, C=C, G=G, window="sliding", shift=True, lin=torch.ones(HQ), eps_out=0.0)[0]
    assert (unshifted - shifted).abs().max() > 0.1
    # the same queries, one by one, with lin = exp(-m_i) and the max subtracted
    _, _, _, heap, _ = authors_rule(*args, C=C, G=G, window="sliding", shift=True, lin=torch.ones(HQ), eps_out=0.0)
    h, i = 0, S - 1  # the last query: sparse pairs, a window and a state
    c = i // C
    idx = torch.cat([heap[h], torch.arange(i - C + 1, i + 1)])
    m = ((kx[0, h, idx] @ q[0, h, i]) * D ** -0.5).max()
    lin = torch.ones(HQ)
    lin[h] = torch.exp(-m)
    rescaled = authors_rule(*args, C=C, G=G, window="sliding", shift=True, lin=lin, eps_out=0.0)[0]
    assert c >= 2 and m > 1
    torch.testing.assert_close(rescaled[h, i], unshifted[h, i], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("affine", [False, True])
def test_combine_unshifted_is_the_authors_exact_term(affine):
    """`combine="unshifted"` switches point (d)'s exact term to theirs: with the sliding window and no 1e-6, ours
    equals the authors' rule with no max subtracted, for the linear weight 1 (as trained) and theirs, 1 - g
    (`affine_factors=true`). Prefill and token-by-token decode alike; the default stays the shifted rule."""
    C, G, S = 8, 6, 40
    q, k, v, fq, fk, gate, wk, kx, vx = _inputs(S, seed=5)
    q = q * 3  # m of several units: the two combinations far apart
    lin = 1 - gate if affine else torch.ones(HQ)
    args = (q[0], kx[0], vx[0], fq[0], fk[0], gate)
    theirs = authors_rule(*args, C=C, G=G, window="sliding", shift=False, lin=lin, eps_out=0.0)[0]
    for splits in (None, [13] + [1] * (S - 13)):
        ours, _ = _ours(q, k, v, fq, gate, wk, C=C, G=G, lf=lin, splits=splits, combine="unshifted")
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    shifted, _ = _ours(q, k, v, fq, gate, wk, C=C, G=G, lf=lin)
    torch.testing.assert_close(shifted, authors_rule(*args, C=C, G=G, window="sliding", shift=True, lin=lin,
                                                     eps_out=0.0)[0], atol=1e-5, rtol=1e-5)
    assert (shifted - theirs).abs().max() > 0.1


def test_a_prompt_cut_off_the_chunk_grid_pads_the_authors_window():
    """Their prefill pads the last chunk with zero keys and values that stay in the window: a decode step after a
    prompt of 20 tokens (C = 8) attends 4 zero keys at exp(0) each, and their grid restarts at the prompt's end.
    Ours evicts on the positions' grid, and a prompt decoded after any cut equals one unbroken prefill."""
    C, G, S, P = 8, 6, 32, 20
    q, k, v, fq, fk, gate, wk, kx, vx = _inputs(S, seed=4)
    pad = (C - P % C) % C

    def padded(x):  # [H, S, *] with `pad` zero rows after the prompt
        return torch.cat([x[:, :P], x.new_zeros(x.shape[0], pad, x.shape[2]), x[:, P:]], 1)

    keep = torch.cat([torch.arange(P), torch.arange(P + pad, S + pad)])
    theirs_cut = authors_rule(padded(q[0]), padded(kx[0]), padded(vx[0]), padded(fq[0]), padded(fk[0]), gate,
                              C=C, G=G)[0][:, keep]
    theirs_whole = authors_rule(q[0], kx[0], vx[0], fq[0], fk[0], gate, C=C, G=G)[0]
    torch.testing.assert_close(theirs_cut[:, :P], theirs_whole[:, :P])
    assert (theirs_cut[:, P:] - theirs_whole[:, P:]).abs().max() > 1e-2
    ours_cut, _ = _ours(q, k, v, fq, gate, wk, C=C, G=G, lf=torch.ones(HQ), splits=[P] + [1] * (S - P))
    ours_whole, _ = _ours(q, k, v, fq, gate, wk, C=C, G=G, lf=torch.ones(HQ))
    torch.testing.assert_close(ours_cut, ours_whole, atol=1e-5, rtol=1e-5)


def test_kv_sparse_heads_sum_the_authors_score_over_the_query_heads():
    """One sparse cache per kv head (ours; the authors keep one per query head) ranks a candidate by the sum of
    the authors' score (the norm) over the query heads that read it. Pair A has errors (3, 0) in the two query
    heads, pair B (2, 2): the sum of norms keeps B (4 > 3), a sum of squares would keep A (9 > 8)."""
    fk = torch.tensor([1.0, 0.0]).expand(1, 2, 2, 2)  # [B, Hq, Nc, F2]: one feature, every candidate
    H = torch.zeros(1, 2, 2, 2)
    H[0, 1, 0] = torch.tensor([3.0, 0.0])  # query head 1 predicts (3, 0) for every key; head 0 predicts 0
    s = torch.zeros(1, 2, 2)
    s[:, :, 0] = 1.0
    b = torch.tensor([1.5, math.sqrt(4 - 1.5 ** 2)])
    cand_v = torch.stack([torch.tensor([3.0, 0.0]), b])[None, None]  # [B, Hs=1, Nc=2, D]
    cand_k = torch.randn(1, 1, 2, 2)
    per_head = ref.sre_scores(fk, cand_v, H, s)
    torch.testing.assert_close(per_head[0], torch.tensor([[3.0, 2.0], [0.0, 2.0]]), atol=1e-5, rtol=1e-5)
    sp_k, _, sp_score, H2, s2 = ref.select_and_fold(cand_k, cand_v, fk, torch.ones(1, 1, 2, dtype=torch.bool),
                                                    H, s, lam=1)
    torch.testing.assert_close(sp_k[0, 0, 0], cand_k[0, 0, 1])  # B stays exact, A is folded
    torch.testing.assert_close(sp_score[0, 0], torch.tensor([4.0]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(H2[0, :, 0], H[0, :, 0] + cand_v[0, 0, 0])
