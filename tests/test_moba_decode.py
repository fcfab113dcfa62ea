"""MoBA's decode steps with block gating (kernels/moba `moba_decode`, methods/moba/cache.py `MobaLayer`): a step is
gated from the block state the cache keeps incrementally (key sums, block first slots, real counts, the query sum)
and attends to its selected blocks only. Against `moba_reference` (the rule over the whole cache: the step is the
last query of a one-call prefill ending at it) op by op, the decode kernel against its reference under the Triton
interpreter, and through a patched model: tokens and logits of the reference rule with left padding, the state after
the buffer regrows, and decode graphs' simulated replay equal to eager steps."""

from __future__ import annotations

import pytest
import torch

import longctx_patch as lp
from longctx_patch import decode_graphs as dg
from longctx_patch.kernels.moba import moba_attention, moba_decode, moba_reference
from longctx_patch.kernels.moba.reference import key_positions
from longctx_patch.kernels.moba.reference_decode import decode_gate, ranges_attention_reference
from longctx_patch.kernels.softmax import softmax_attention
from longctx_patch.methods.moba import MobaLayer

from conftest import greedy_with_scores, left_padded_prompts, tiny_model


def qkv(B, Hq, Hkv, S, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(B, h, S, D, generator=g).to(dtype)  # noqa: E731
    return mk(Hq), mk(Hkv), mk(Hkv)


def prefill_then_steps(q, k, v, km, P, kw, backend="torch", splits=None):
    """A prefill of P tokens through a MobaLayer (key mask km[:, :P]), then one step per token (km's last entry says
    whether it is real): the steps' outputs `[B, S - P, Hq, D]` and the layer."""
    layer = MobaLayer(block_size=kw["block_size"], backend=backend)
    qs = layer.query_sum_like(q)
    kv = layer.extend(k[:, :, :P], v[:, :, :P], km[:, :P])
    moba_attention(q[:, :, :P], kv.keys, kv.values, key_mask=kv.key_mask, q_offset=kv.q_offset, query_sum=qs, **kw)
    outs = []
    for t in range(P, q.shape[2]):
        st = layer.decode_step(k[:, :, t:t + 1], v[:, :, t:t + 1], km[:, :t + 1])
        outs.append(moba_decode(q[:, :, t:t + 1], st, query_sum=qs, backend=backend, splits=splits, **kw))
    return torch.cat(outs, 1), layer


def recomputed_state(layer):
    """(key sums, first slots, real counts) of the layer's stored keys, recomputed from the buffer."""
    B, H, cap, D = layer.keys.shape
    bs = layer.block_size
    nb = layer.key_sums.shape[2]
    kpos, valid = key_positions(layer.mask, B, cap, layer.keys.device)
    sums = torch.zeros(B, H, nb, D, dtype=layer.key_sums.dtype)
    first = torch.zeros(B, nb, dtype=torch.long)
    for b in range(B):
        for s in range(layer.seen):
            if valid[b, s]:
                n = int(kpos[b, s]) // bs
                sums[b, :, n] += layer.keys[b, :, s].to(sums.dtype)
                if kpos[b, s] % bs == 0:
                    first[b, n] = s
    return sums, first, valid.sum(1)


CASES = [  # GQA 7 and 2 per kv head, odd lengths, left-padded rows, a padded token amid the decode, min_seq_len
    dict(B=2, Hq=14, Hkv=2, S=61, P=23, D=16, bs=8, top_k=3, pads=[0, 7], hole=None, min_seq_len=0),
    dict(B=3, Hq=4, Hkv=2, S=57, P=9, D=8, bs=5, top_k=2, pads=[3, 0, 12], hole=(1, 30), min_seq_len=0),
    dict(B=2, Hq=7, Hkv=1, S=70, P=31, D=16, bs=6, top_k=4, pads=[0, 5], hole=None, min_seq_len=40),
    dict(B=1, Hq=4, Hkv=1, S=40, P=2, D=8, bs=16, top_k=3, pads=[0], hole=None, min_seq_len=0),  # exact throughout
    # a buffer of top_k - 1 blocks (512 slots of 256): exact throughout, its steps past the first block too
    dict(B=2, Hq=4, Hkv=2, S=300, P=250, D=8, bs=256, top_k=3, pads=[0, 9], hole=None, min_seq_len=0),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_decode_steps_equal_the_reference_rule(case, dtype):
    """Every step equals the last query of `moba_reference` over the sequence up to it (with query_sum carried from
    the prefill: the gate is the mean of the block's queries so far), and the kept block state equals the one
    recomputed from the buffer."""
    c = CASES[case]
    q, k, v = qkv(c["B"], c["Hq"], c["Hkv"], c["S"], c["D"], dtype, seed=case)
    km = torch.ones(c["B"], c["S"], dtype=torch.bool)
    for r, p in enumerate(c["pads"]):
        km[r, :p] = False
    if c["hole"] is not None:
        km[c["hole"]] = False
    kw = dict(scale=c["D"] ** -0.5, block_size=c["bs"], top_k=c["top_k"], min_seq_len=c["min_seq_len"],
              gating="block")
    got, layer = prefill_then_steps(q, k, v, km, c["P"], kw)
    want = torch.cat([moba_reference(q[:, :, :t + 1], k[:, :, :t + 1], v[:, :, :t + 1], key_mask=km[:, :t + 1],
                                     **kw)[:, -1:] for t in range(c["P"], c["S"])], 1)
    exact = softmax_attention(q, k, v, scale=kw["scale"], key_mask=km)[:, c["P"]:]
    tol = {torch.float64: dict(atol=1e-12, rtol=1e-10), torch.float32: dict(atol=1e-5, rtol=1e-5),
           torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}[dtype]
    torch.testing.assert_close(got, want, **tol)  # the torch path: the reference's arithmetic on fewer keys
    gap = (want.double() - exact.double()).abs().max()
    # sparse, except where no row has top_k blocks yet
    assert gap < 3 * tol["atol"] if c["top_k"] * c["bs"] >= c["S"] else gap > 0.1
    sums, first, n_real = recomputed_state(layer)
    torch.testing.assert_close(layer.key_sums, sums, **(tol if dtype == torch.float64 else dict(atol=1e-5, rtol=0)))
    assert torch.equal(layer.block_start, first) and torch.equal(layer.n_real, n_real)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_equals_its_reference(dtype):
    """The Triton kernel (interpreter) against `ranges_attention_reference`: GQA 7 per kv head, ranges of odd
    lengths, empty ones, one holding only the own slot of a padded query, padding holes, one and several pieces."""
    B, Hq, Hkv, cap, D = 2, 7, 1, 72, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, Hq, 1, D, generator=g).to(dtype)
    keys, values = (torch.randn(B, Hkv, cap, D, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(B, cap, generator=g) > 0.2
    starts = torch.randint(0, 10, (B, Hq, 3), generator=g) + torch.tensor([0, 20, 0])  # disjoint: in [0, 20), [20, 40)
    ends = starts + torch.randint(0, 11, (B, Hq, 3), generator=g)
    slot = torch.tensor([61, 50])
    starts[:, :, 2], ends[:, :, 2] = 40, slot[:, None] + 1  # the own block, up to the own slot
    starts[0, 3, :2], ends[0, 3, :2] = 0, 0  # a head with no earlier range
    mask[0, 61] = False  # row 0's own token is padding: its own slot is seen anyway
    starts[1, 2, :2] = ends[1, 2, :2]  # empty ranges
    ref = ranges_attention_reference(q, keys, values, mask, starts.int(), ends.int(), slot, scale=0.3)
    from longctx_patch.kernels.moba.triton_decode import ranges_attention

    for splits in (1, 3):
        o = ranges_attention(q, keys, values, mask, starts.int(), ends.int(), slot, scale=0.3, longest=8,
                             splits=splits)
        assert o.dtype == dtype and o.shape == (B, 1, Hq, D)
        tol = dict(atol=2e-6, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(o.float(), ref.float(), **tol)


@pytest.mark.parametrize("gating,top_k,min_seq_len", [("block", 3, 0), ("block", 4, 30), ("token", 2, 20),
                                                      ("block", 40, 0)])
def test_store_and_gate_kernels_equal_their_references(gating, top_k, min_seq_len):
    """The store kernel leaves the state the reference store leaves, and the gate kernel gives the reference gate's
    ranges and query sums (interpreter): GQA 7, left padding, a padded step, a row that takes every earlier key,
    top_k past the number of blocks."""
    from longctx_patch.kernels.moba.reference_decode import store_step_reference
    from longctx_patch.kernels.moba.triton_decode import gate_ranges, store_step

    B, Hq, Hkv, S, D, bs = 3, 7, 1, 84, 16, 6
    q, k, v = qkv(B, Hq, Hkv, S + 1, D, torch.float32, seed=11)
    km = torch.ones(B, S + 1, dtype=torch.bool)
    km[1, :19], km[2, :72] = False, False  # row 2's step starts a block (position 12)
    km[0, S] = False  # row 0's step is padding, at a block's first position (84)
    layer = MobaLayer(block_size=bs)
    layer.extend(k[:, :, :S], v[:, :, :S], km[:, :S])
    layer._reserve(S + 1, k)
    real = km[:, S]
    states = []
    for store in (store_step_reference, store_step):
        st = {n: t.clone() for n, t in layer.state_tensors().items()}
        slot = store(k[:, :, S:], v[:, :, S:], st["keys"], st["values"], st["mask"], st["pos"], st["key_sums"],
                     st["block_start"], st["n_real"], real, block_size=bs)
        states.append((slot, st))
    (slot, want), (slot_t, got) = states
    assert torch.equal(slot_t, slot) and torch.equal(slot, torch.full((B,), S))
    for n in want:
        assert torch.equal(got[n], want[n]), n
    qs = torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(2)) if gating == "block" else None
    kw = dict(block_size=bs, top_k=top_k, min_seq_len=min_seq_len, gating=gating)
    ranges = []
    for fn in (decode_gate, gate_ranges):
        sums = None if qs is None else qs.clone()
        ranges.append((*fn(q[:, :, S:], want["key_sums"], want["block_start"], want["n_real"], slot, real,
                           query_sum=sums, **kw), sums))
    (st, en, sums), (st_t, en_t, sums_t) = ranges
    assert torch.equal(st_t, st) and torch.equal(en_t, en)
    assert (en - st).sum() > 0 and st.shape[2] == top_k
    if qs is not None:
        torch.testing.assert_close(sums_t, sums, atol=0, rtol=0)
        assert not torch.equal(sums, qs)


class LaunchRecorder:
    """Stands for a Triton kernel: records the keyword arguments of each launch (the constexprs and launch options,
    which pick the compiled variant; the sizes that vary are passed positionally), then launches the kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(tuple(sorted(kwargs.items())))
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_decode_kernels_are_one_variant_for_every_buffer_size(monkeypatch):
    """A decode step's four kernels are launched with the same constexprs whatever the buffer's size (a tile width
    that followed the block count, or fewer gate ranges for a buffer of at most top_k - 1 blocks, compiled other
    kernels at the first step of a longer context than any before: ~0.4 s a kernel on a GPU); the gate equals its
    reference and the step the torch path's at 2 blocks (top_k - 1: no earlier range), 3, 6, 10 and 68 (two tiles
    of the gate's scan)."""
    from longctx_patch.kernels.moba import triton_decode

    recs = {}
    for name in ("_store_kernel", "_gate_kernel", "_ranges_kernel", "_combine_kernel"):
        recs[name] = LaunchRecorder(getattr(triton_decode, name))
        monkeypatch.setattr(triton_decode, name, recs[name])
    B, Hq, Hkv, D, bs, top_k = 2, 4, 2, 16, 256, 3
    kw = dict(block_size=bs, top_k=top_k, min_seq_len=0, gating="block")
    blocks = []
    for P in (20, 300, 1100, 2100, 17000):  # capacities 512, 768, 1536, 2560, 17408
        q, k, v = qkv(B, Hq, Hkv, P + 1, D, torch.float32, seed=P)
        layer = MobaLayer(block_size=bs, backend="triton")
        layer.extend(k[:, :, :P], v[:, :, :P], None)
        step = layer.decode_step(k[:, :, P:], v[:, :, P:], None)
        qs = torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(P))
        state = (step.key_sums, step.block_start, step.n_real, step.slot, None)
        want = decode_gate(q[:, :, P:], *state, query_sum=qs.clone(), **kw)
        got = triton_decode.gate_ranges(q[:, :, P:], *state, query_sum=qs.clone(), **kw)
        assert want[0].shape == (B, Hq, top_k) and all(torch.equal(g, w) for g, w in zip(got, want)), P
        o_t = moba_decode(q[:, :, P:], step, scale=0.25, query_sum=qs.clone(), backend="triton", **kw)
        o_r = moba_decode(q[:, :, P:], step, scale=0.25, query_sum=qs.clone(), backend="torch", **kw)
        torch.testing.assert_close(o_t, o_r, atol=2e-6, rtol=2e-5)
        blocks.append(step.key_sums.shape[2])
    assert blocks == [2, 3, 6, 10, 68]
    for name, rec in recs.items():
        assert len(rec.launches) >= 5 and len(set(rec.launches)) == 1, (name, set(rec.launches))


@pytest.mark.parametrize("S,P,bs", [(44, 40, 8), (264, 252, 256)])
def test_decode_triton_backend_equals_torch(S, P, bs):
    """`moba_decode(backend="triton")` (the kernel, interpreter) gives the torch path's steps: GQA 7, a padded row;
    blocks of 8, and a buffer of top_k - 1 blocks of 256 (one gate range), where the steps past the first block
    attend to every earlier key (`moba_reference`'s rule)."""
    q, k, v = qkv(2, 7, 1, S, 16, torch.float32, seed=5)
    km = torch.ones(2, S, dtype=torch.bool)
    km[1, :9] = False
    kw = dict(scale=0.25, block_size=bs, top_k=3, min_seq_len=0, gating="block")
    torch_out, _ = prefill_then_steps(q, k, v, km, P, kw)
    tri, _ = prefill_then_steps(q, k, v, km, P, kw, backend="triton", splits=2)
    torch.testing.assert_close(tri, torch_out, atol=2e-6, rtol=2e-5)
    want = torch.cat([moba_reference(q[:, :, :t + 1], k[:, :, :t + 1], v[:, :, :t + 1], key_mask=km[:, :t + 1],
                                     **kw)[:, -1:] for t in range(P, S)], 1)
    torch.testing.assert_close(tri, want, atol=2e-6, rtol=2e-5)


def whole_buffer_rule(q, step, *, scale, block_size, top_k, min_seq_len, gating, query_sum, backend, splits=None):
    """The rule a decode step followed before the block state: `moba_reference` over the whole buffer (block means
    recomputed from the keys, dense logits), the query after every key and its own key seen."""
    km = step.key_mask.clone().scatter_(1, step.slot[:, None], True)
    return moba_reference(q, step.keys, step.values, scale=scale, block_size=block_size, top_k=top_k, key_mask=km,
                          q_offset=step.keys.shape[2], min_seq_len=min_seq_len, gating=gating, query_sum=query_sum)


def generate_scores(model, ids, am, n):
    out = model.generate(ids, attention_mask=am, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores, 1), out.past_key_values


def test_patched_model_decode_equals_the_reference_rule(monkeypatch, one_thread):
    """A left-padded batch: the greedy tokens and every step's logits of the block-state decode are those of the
    whole-buffer rule, the decode really took the new path, and it is not exact attention."""
    from longctx_patch.methods.moba import attention

    model = tiny_model("llama")
    lp.patch(model, "moba", block_size=4, top_k=2)
    _, ids, am = left_padded_prompts([27, 20, 9])
    calls = []
    new_path = attention.moba_decode
    monkeypatch.setattr(attention, "moba_decode", lambda *a, **kw: calls.append(1) or new_path(*a, **kw))
    with torch.no_grad():
        seq, sc, cache = generate_scores(model, ids, am, 14)
    assert len(calls) == 13 * len(lp.patched_layers(model))
    monkeypatch.setattr(attention, "moba_decode", whole_buffer_rule)
    with torch.no_grad():
        seq_r, sc_r, _ = generate_scores(model, ids, am, 14)
    assert torch.equal(seq, seq_r)
    torch.testing.assert_close(sc, sc_r, atol=1e-5, rtol=0)
    for layer in cache.layers:
        sums, first, n_real = recomputed_state(layer)
        torch.testing.assert_close(layer.key_sums, sums, atol=1e-5, rtol=1e-5)
        assert torch.equal(layer.block_start, first) and torch.equal(layer.n_real, n_real)
    exact = tiny_model("llama")
    lp.patch(exact, "exact")
    with torch.no_grad():
        _, sc_e, _ = generate_scores(exact, ids, am, 14)
    finite = torch.isfinite(sc)  # min_new_tokens masks the eos logit
    assert (sc_e - sc)[finite].abs().max() > 1e-3


def test_state_grows_with_the_buffer_and_replays(simulate, monkeypatch):
    """A buffer that regrows during the decode (the block state grows with it, the graphs are captured again at
    the new capacity): replayed steps equal eager ones and the whole-buffer rule, and the state equals the one
    recomputed from the buffer."""
    from longctx_patch.methods import kv_layer
    from longctx_patch.methods.moba import attention

    monkeypatch.setattr(kv_layer, "ALIGN", 8)
    monkeypatch.setattr(kv_layer, "HEADROOM", 2)
    monkeypatch.setattr(kv_layer, "GROW", 8)
    torch.manual_seed(0)
    model = tiny_model("llama")
    lp.patch(model, "moba", block_size=4, top_k=2)
    ids = torch.randint(3, 100, (2, 13))
    lp.set_decode_graphs(model, False)
    seq_e, sc_e, cache_e = greedy_with_scores(model, ids, 21)
    lp.set_decode_graphs(model, True)
    seq_g, sc_g, cache_g = greedy_with_scores(model, ids, 21)
    layer = cache_g.layers[0]
    assert layer.capacity == 40 and layer.key_sums.shape[2] == 10  # 16 slots after the prefill, then 24, 32, 40
    st = dg.stats(cache_g)
    assert st == {"eager_steps": 1, "captures": 1, "replays": 6, "graphs": 1}, st  # since the last regrow, as exact
    assert torch.equal(seq_g, seq_e)
    torch.testing.assert_close(sc_g, sc_e, atol=1e-5, rtol=0)
    for le, lg in zip(cache_e.layers, cache_g.layers):
        for n, t in le.state_tensors().items():
            torch.testing.assert_close(lg.state_tensors()[n], t, atol=1e-5, rtol=0)
        sums, first, n_real = recomputed_state(lg)
        torch.testing.assert_close(lg.key_sums, sums, atol=1e-5, rtol=1e-5)
        assert torch.equal(lg.block_start, first) and torch.equal(lg.n_real, n_real)
    lp.set_decode_graphs(model, False)
    monkeypatch.setattr(attention, "moba_decode", whole_buffer_rule)
    seq_r, sc_r, _ = greedy_with_scores(model, ids, 21)
    assert torch.equal(seq_g, seq_r)
    torch.testing.assert_close(sc_g, sc_r, atol=1e-5, rtol=0)
