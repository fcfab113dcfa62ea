"""ovq Triton kernels (run by the CPU interpreter, TRITON_INTERPRET=1) against the PyTorch reference."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from longctx_patch.kernels.ovq import OVQState, OvqKernelOptions, exact_causal_attention, ovq_attention  # noqa: E402
from longctx_patch.kernels.ovq.reference import chunk_attention_ref, select_and_assign  # noqa: E402
from longctx_patch.kernels.ovq.ops import chunk_attention_triton  # noqa: E402
from longctx_patch.kernels.ovq.triton_dict import chunk_stats_triton  # noqa: E402


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_dict,L,M,q_off", [(21, 19, 7, 12), (0, 33, 33, 0), (70, 1, 1, 0), (5, 9, 1, 8)])
def test_chunk_attention_forward_backward(dtype, n_dict, L, M, q_off):
    g = torch.Generator().manual_seed(n_dict * 100 + L)
    B, Hq, H, D = 2, 4, 2, 16
    q = (torch.randn(B, Hq, M, D, generator=g) * 2).to(dtype).requires_grad_()
    k = torch.randn(B, H, n_dict + L, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, H, n_dict + L, D, generator=g).to(dtype).requires_grad_()
    bias = torch.randn(B, H, n_dict + L, generator=g)
    bias[:, :, min(3, n_dict + L - 1)] = float("-inf")  # an empty dictionary row / a padded key
    bias[1, :, : n_dict + 1] = float("-inf")
    do = torch.randn(B, Hq, M, D, generator=g).to(dtype)
    ref = chunk_attention_ref(q.double(), k.double(), v.double(), bias, n_dict, q_off)
    g_ref = torch.autograd.grad(ref, (q, k, v), do.double())
    out = chunk_attention_triton(q, k, v, bias, n_dict, q_off)
    g_out = torch.autograd.grad(out, (q, k, v), do)
    tol_o, tol_g = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 2.5e-2)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert _rel(out, ref) < tol_o
    for a, b in zip(g_out, g_ref):
        assert _rel(a, b) < tol_g


def test_chunk_attention_row_without_keys_is_zero():
    q = torch.randn(1, 2, 3, 16)
    k = torch.randn(1, 1, 3, 16)
    v = torch.randn(1, 1, 3, 16)
    bias = torch.full((1, 1, 3), float("-inf"))
    out = chunk_attention_triton(q, k, v, bias, 0, 0)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("C,n_active", [(20, [0, 23]), (7, [64, 5])])
def test_chunk_stats_and_assignment(C, n_active):
    g = torch.Generator().manual_seed(C)
    B, H, N, D = 2, 2, 70, 16
    st = OVQState.empty(B, H, N, D)
    st.counts.copy_(torch.randint(1, 4, (B, H, N), generator=g).float())
    st.key_sums.copy_(torch.randn(B, H, N, D, generator=g) * st.counts[..., None])
    st.n_active = torch.tensor(n_active)
    k = torch.randn(B, H, C, D, generator=g)
    maxdot, best, idx = chunk_stats_triton(k, st.key_sums, st.counts, st.n_active)
    for b, n in enumerate(n_active):
        if n == 0:
            assert torch.isinf(maxdot[b]).all() and (maxdot[b] < 0).all()
            continue
        dots = k[b] @ st.keys[b, :, :n].transpose(-1, -2)
        torch.testing.assert_close(maxdot[b], dots.max(-1).values)
        score = dots - 0.5 * (st.keys[b, :, :n] ** 2).sum(-1)[:, None, :]
        torch.testing.assert_close(best[b], score.max(-1).values)
        assert torch.equal(idx[b], score.max(-1).indices)
    valid = torch.rand(B, C, generator=g) > 0.2
    n_new = torch.tensor([min(3, int(valid[0].sum())), 0])
    st.n_active = torch.tensor(n_active)
    a_ref = select_and_assign(st, k, valid, n_new)
    a_tri = select_and_assign(st, k, valid, n_new, old_stats=(maxdot, best, idx))
    assert torch.equal(a_ref, a_tri)


@pytest.mark.parametrize("S,C,N,growth", [(29, 8, 40, 0.0), (37, 8, 6, 4.0), (21, 16, 5, 2.0)])
def test_driver_triton_equals_torch(S, C, N, growth):
    g = torch.Generator().manual_seed(S)
    B, Hq, H, D = 2, 4, 2, 16
    q = (F.normalize(torch.randn(B, Hq, S, D, generator=g), dim=-1) * 5).requires_grad_()
    k = F.normalize(torch.randn(B, H, S, D, generator=g), dim=-1).requires_grad_()
    v = torch.randn(B, H, S, D, generator=g).requires_grad_()
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[1, :5] = False
    kw = dict(chunk_size=C, max_centroids=N, growth=growth)
    o_ref, st_ref, _, _ = ovq_attention(q, k, v, None, None, valid, backend="torch", **kw)
    # 4 rows per program: the assignment statistics span several row splits
    o_tri, st_tri, _, _ = ovq_attention(q, k, v, None, None, valid, backend="triton",
                                        options=OvqKernelOptions(split_rows=4), **kw)
    torch.testing.assert_close(o_tri, o_ref, atol=2e-5, rtol=1e-4)
    assert torch.equal(st_tri.counts, st_ref.counts)
    torch.testing.assert_close(st_tri.key_sums, st_ref.key_sums)
    do = torch.randn_like(o_ref)
    g_ref = torch.autograd.grad(o_ref, (q, k, v), do)
    g_tri = torch.autograd.grad(o_tri, (q, k, v), do)
    for a, b in zip(g_tri, g_ref):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)
    if growth == 0.0 and N >= S:
        ref = exact_causal_attention(q, k, v, valid)
        real = valid[:, None, :, None].expand_as(ref)
        torch.testing.assert_close(o_tri[real], ref[real], atol=2e-5, rtol=1e-4)


def test_driver_triton_bf16_decode_equals_prefill():
    g = torch.Generator().manual_seed(1)
    B, Hq, H, S, D = 1, 2, 1, 19, 16
    q = (F.normalize(torch.randn(B, Hq, S, D, generator=g), dim=-1) * 5).bfloat16()
    k = F.normalize(torch.randn(B, H, S, D, generator=g), dim=-1).bfloat16()
    v = torch.randn(B, H, S, D, generator=g).bfloat16()
    kw = dict(chunk_size=4, max_centroids=6, growth=3.0, backend="triton")
    full, *_ = ovq_attention(q, k, v, None, None, None, **kw)
    ref, *_ = ovq_attention(q, k, v, None, None, None, **{**kw, "backend": "torch"})
    assert _rel(full, ref) < 1e-2
    o, st, op, sb = ovq_attention(q[:, :, :6], k[:, :, :6], v[:, :, :6], None, None, None, **kw)
    outs = [o]
    for t in range(6, S):
        o, st, op, sb = ovq_attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], st, op, None,
                                      seen_bound=sb, **kw)
        outs.append(o)
    assert _rel(torch.cat(outs, 2), full) < 1e-2


@pytest.mark.parametrize("S,C,N,growth,dtype,split", [(37, 8, 6, 4.0, torch.float32, None),
                                                      (29, 8, 40, 0.0, torch.float32, 16),
                                                      (45, 16, 10, 4.0, torch.bfloat16, 4)])
def test_fused_no_grad_path_equals_reference(S, C, N, growth, dtype, split):
    g = torch.Generator().manual_seed(S + C)
    B, Hq, H, D = 2, 4, 2, 16
    q = (F.normalize(torch.randn(B, Hq, S, D, generator=g), dim=-1) * 5).to(dtype)
    k = F.normalize(torch.randn(B, H, S, D, generator=g), dim=-1).to(dtype)
    v = torch.randn(B, H, S, D, generator=g).to(dtype)
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[1, :5] = False
    valid[0, 20:23] = False
    kw = dict(chunk_size=C, max_centroids=N, growth=growth)
    with torch.no_grad():
        o_ref, st_ref, op_ref, _ = ovq_attention(q, k, v, None, None, valid, backend="torch", **kw)
        # split: several programs per chunk over the dictionary rows
        kw["options"] = OvqKernelOptions(split_rows=split)
        o_fast, st_fast, op_fast, sb = ovq_attention(q, k, v, None, None, valid, backend="triton",
                                                     exact_assign=True, **kw)
        # streamed through the same fused path: a prefill, then one token at a time
        P = S - 9
        o, st, op, sb2 = ovq_attention(q[:, :, :P], k[:, :, :P], v[:, :, :P], None, None, valid[:, :P],
                                       backend="triton", exact_assign=True, **kw)
        outs = [o]
        for t in range(P, S):
            o, st, op, sb2 = ovq_attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], st, op,
                                           valid[:, t:t + 1], backend="triton", exact_assign=True,
                                           seen_bound=sb2, **kw)
            outs.append(o)
        # two prefills split inside a chunk: the second starts with the open chunk's tail, then whole chunks
        P2 = C + 3
        o2a, st2, op2, sb3 = ovq_attention(q[:, :, :P2], k[:, :, :P2], v[:, :, :P2], None, None, valid[:, :P2],
                                           backend="triton", exact_assign=True, **kw)
        o2b, st2, op2, _ = ovq_attention(q[:, :, P2:], k[:, :, P2:], v[:, :, P2:], st2, op2, valid[:, P2:],
                                         backend="triton", exact_assign=True, seen_bound=sb3, **kw)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    real = valid[:, None, :, None].expand_as(o_ref)
    assert _rel(o_fast[real], o_ref[real]) < tol
    assert _rel(torch.cat(outs, 2)[real], o_fast[real]) < tol
    assert _rel(torch.cat([o2a, o2b], 2)[real], o_fast[real]) < tol
    assert torch.equal(st2.counts, st_ref.counts)
    assert torch.equal(st_fast.counts, st_ref.counts) and torch.equal(st.counts, st_ref.counts)
    assert st_fast.n_active.tolist() == st_ref.n_active.tolist() and st_fast.seen.tolist() == st_ref.seen.tolist()
    torch.testing.assert_close(st_fast.key_sums, st_ref.key_sums, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st_fast.value_sums, st_ref.value_sums, atol=1e-5, rtol=1e-5)
    assert op_fast.length == op_ref.length == S % C
    if growth == 0.0:
        ref = exact_causal_attention(q, k, v, valid)
        assert _rel(o_fast[real], ref[real]) < tol


def test_patched_model_triton_backend_prefill_then_decode():
    import longctx_patch as lp
    from conftest import tiny_model

    model = tiny_model("llama", num_hidden_layers=1)
    lp.patch(model, "ovq", chunk_size=4, max_centroids=6, growth=3.0, backend="triton")
    ids = torch.randint(3, 128, (2, 13), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :9], use_cache=True)
        cache, logits = out.past_key_values, [out.logits]
        for t in range(9, 13):
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits)
    torch.testing.assert_close(torch.cat(logits, 1), full, atol=1e-4, rtol=1e-4)
    ref_model = tiny_model("llama", num_hidden_layers=1)
    lp.patch(ref_model, "ovq", chunk_size=4, max_centroids=6, growth=3.0, backend="torch")
    with torch.no_grad():
        torch.testing.assert_close(ref_model(ids, use_cache=False).logits, full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("S,C,N,growth,dtype", [(45, 16, 12, 4.0, torch.float32), (48, 16, 40, 0.0, torch.float32),
                                                (40, 16, 12, 4.0, torch.bfloat16), (9, 16, 12, 4.0, torch.float32)])
def test_parallel_training_path_triton_equals_loop(S, C, N, growth, dtype):
    from test_ovq import _parallel_vs_loop

    _parallel_vs_loop("triton", S, C, N, growth, dtype=dtype)


def test_parallel_training_path_bf16_assignment_mean_form():
    """bf16 assignment dots: the parallel path's assignment pass (a run of chunks in the mean form, rows written
    per chunk) picks the same rows as the loop's per-chunk assignment (sum form)."""
    from test_ovq import _parallel_vs_loop

    _parallel_vs_loop("triton", 45, 8, 12, 4.0, exact_assign=False)


def test_parallel_training_path_triton_from_a_state():
    from test_ovq import _parallel_vs_loop

    _parallel_vs_loop("triton", 37, 16, 24, 4.0, with_state=True, seed=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mean_form_equals_sum_form(dtype):
    """Runs of chunks with bf16 assignment read row means kept beside the sums (mean_form): same rows, same
    output as reading the sums; batch with padding, GQA, growth, a second call that starts inside a chunk."""
    g = torch.Generator().manual_seed(5)
    B, Hq, H, S, C, D = 2, 4, 2, 61, 8, 16
    q = (F.normalize(torch.randn(B, Hq, S, D, generator=g), dim=-1) * 5).to(dtype)
    k = F.normalize(torch.randn(B, H, S, D, generator=g), dim=-1).to(dtype)
    v = torch.randn(B, H, S, D, generator=g).to(dtype)
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[1, :6] = False
    kw = dict(chunk_size=C, max_centroids=20, growth=6.0, backend="triton", exact_assign=False)
    runs = {}
    for mean in (True, False):
        kw["options"] = OvqKernelOptions(mean_form=mean)
        with torch.no_grad():
            o1, st, op, sb = ovq_attention(q[:, :, :21], k[:, :, :21], v[:, :, :21], None, None, valid[:, :21], **kw)
            o2, st, op, _ = ovq_attention(q[:, :, 21:], k[:, :, 21:], v[:, :, 21:], st, op, valid[:, 21:],
                                          seen_bound=sb, **kw)
        runs[mean] = (torch.cat([o1, o2], 2), st)
    (o_m, st_m), (o_s, st_s) = runs[True], runs[False]
    assert torch.equal(st_m.counts, st_s.counts)
    torch.testing.assert_close(st_m.key_sums, st_s.key_sums, atol=1e-5, rtol=1e-5)
    real = valid[:, None, :, None].expand_as(o_m)
    assert _rel(o_m[real].float(), o_s[real].float()) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("options", [OvqKernelOptions(block_m=64), OvqKernelOptions(block_n=128),
                                     OvqKernelOptions(split_rows=48), OvqKernelOptions(block_n=16, split_rows=256),
                                     OvqKernelOptions(graph_runs=False, mean_form=False)],
                         ids=["block_m64", "block_n128", "split48", "block_n16_split256", "no_graph_sum_form"])
def test_kernel_options_change_no_result(options):
    """Other launch tiles (OvqKernelOptions, passed as `options=`) give the defaults' outputs and dictionary: a
    prefill of whole 128-token chunks (a run: bf16 assignment, mean form) and a tail, a decode step, an open-chunk
    attention. block_m 64 splits each chunk's queries over two programs, block_n and split_rows retile the rows."""
    from longctx_patch.kernels.ovq import OpenChunk, ovq_open_attention

    g = torch.Generator().manual_seed(11)
    B, Hq, H, S, C, D = 1, 2, 1, 3 * 128 + 21, 128, 16
    q = (F.normalize(torch.randn(B, Hq, S, D, generator=g), dim=-1) * 5).bfloat16()
    k = F.normalize(torch.randn(B, H, S, D, generator=g), dim=-1).bfloat16()
    v = torch.randn(B, H, S, D, generator=g).bfloat16()
    kw = dict(chunk_size=C, max_centroids=200, growth=64.0, backend="triton", exact_assign=False)
    runs = []
    for opts in (OvqKernelOptions(), options):
        with torch.no_grad():
            o, st, op, sb = ovq_attention(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], None, None, None, options=opts,
                                          **kw)
            o1, st1, op1, _ = ovq_attention(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], st, op, None, seen_bound=sb,
                                            options=opts, **kw)
            n_dict = int(st1.n_active.max())
            oo = ovq_open_attention(q[:, :, -1:], st1, OpenChunk(op1.keys, op1.values, op1.valid), n_dict,
                                    backend="triton", options=opts)
        runs.append((torch.cat([o, o1], 2), oo, st1))
    (o_d, oo_d, st_d), (o_x, oo_x, st_x) = runs
    assert torch.equal(st_x.counts, st_d.counts)
    torch.testing.assert_close(st_x.key_sums, st_d.key_sums, atol=1e-5, rtol=1e-5)
    assert _rel(o_x.float(), o_d.float()) < 1e-2 and _rel(oo_x.float(), oo_d.float()) < 1e-2


def test_kernel_options_are_checked():
    from longctx_patch.errors import ConfigError

    for bad, allowed in ((dict(block_m=96), "64 or 128"), (dict(block_n=48), "16, 32, 64, 128, 256"),
                         (dict(split_rows=0), "positive int"), (dict(graph_runs=1), "True or False"),
                         (dict(block_m=True), "64 or 128")):
        with pytest.raises(ValueError, match=allowed):
            OvqKernelOptions(**bad)
    with pytest.raises(ValueError, match="not OVQ kernel options: block"):
        OvqKernelOptions().replace(block=64)
    assert OvqKernelOptions().replace(block_n=128) == OvqKernelOptions(block_n=128)
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ConfigError, match="OvqKernelOptions"):
        ovq_attention(q, q[:, :1], q[:, :1], None, None, None, chunk_size=4, max_centroids=8, growth=0.0,
                      backend="torch", options={"block_m": 64})


def test_kernel_options_reach_the_launch_choices():
    from longctx_patch.kernels.ovq.triton_fast import _blk, _rows_per_split

    assert _blk(512) == (128, 8) == _blk(512, OvqKernelOptions())
    assert _blk(512, OvqKernelOptions(block_m=64)) == (64, 4) and _blk(16, OvqKernelOptions(block_m=64)) == (16, 4)
    assert (_rows_per_split(512, attention=True), _rows_per_split(512), _rows_per_split(1)) == (1024, 512, 256)
    opts = OvqKernelOptions(split_rows=128)
    assert _rows_per_split(512, True, opts) == _rows_per_split(512, options=opts) == _rows_per_split(1, options=opts)
