"""The Triton forward of sliding-window attention (kernels/window/triton_window.py through `window_attention_triton`)
against a float64 dense-mask reference, through the Triton interpreter: odd lengths, windows below and above a
key tile, queries after a past (q_offset), left padding and a row whose own key is masked, GQA 14/2 (G = 7) and
4/4, fp32 and bf16, every output written; and the routing of `softmax_attention` (the kernel only without a
gradient)."""

import pytest
import torch

import longctx_patch.kernels.softmax.ops as sm
from longctx_patch.kernels.softmax import attention_mask, softmax_attention
from longctx_patch.kernels.window import (WindowTiles, banded_window_attention, window_attention_triton,
                                          window_kernel_supported)


def _dense(q, k, v, scale, window, key_mask=None, q_offset=None):
    G = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = q.double() @ kk.transpose(-1, -2) * scale
    ok = attention_mask(q.shape[2], k.shape[2], device="cpu", key_mask=key_mask, q_offset=q_offset, window=window)
    return (s.masked_fill(~ok, float("-inf")).softmax(-1) @ vv).transpose(1, 2)


def _inputs(B, Hq, Hkv, Sq, Sk, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, s, D, generator=g).to(dtype) for h, s in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk))]


def _rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}

CASES = [  # B, Hq, Hkv, Sq, Sk, D, window, q_offset, tiles (WindowTiles' block_rows, block_keys; None: the defaults)
    (2, 14, 2, 37, 37, 16, 5, None, None),        # G = 7, odd length, one row block of the default tiles
    (1, 14, 2, 130, 130, 16, 1, None, (32, 16)),  # window 1: each query its own key only
    (2, 4, 4, 130, 130, 32, 64, None, (16, 16)),  # window of 4 tiles, many row blocks
    (1, 14, 2, 61, 150, 16, 100, None, (64, 32)),  # queries = the last 61 of 150 keys, window above a tile
    (2, 4, 4, 40, 150, 16, 5, 70, (16, 16)),      # queries in the middle of the keys (q_offset 70)
    (1, 4, 4, 50, 50, 16, 500, None, (16, 16)),   # a window past every key: full causal
]


@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,W,q_offset,tiles", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_the_dense_reference(B, Hq, Hkv, Sq, Sk, D, W, q_offset, tiles, dtype):
    q, k, v = _inputs(B, Hq, Hkv, Sq, Sk, D, dtype, seed=Sq + Sk + W)
    out = window_attention_triton(q, k, v, scale=D ** -0.5, window=W, q_offset=q_offset,
                                  tiles=WindowTiles(*tiles) if tiles else None)
    ref = _dense(q, k, v, D ** -0.5, W, q_offset=q_offset)
    assert out.shape == (B, Sq, Hq, D) and out.dtype == dtype
    assert _rel(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv,tiles", [(14, 2, (32, 16)), (4, 4, None)])
def test_key_padding(dtype, Hq, Hkv, tiles):
    """Left-padded rows (one padded past the first queries), a hole whose rows see only their own key, and a
    query whose own key is masked (it still sees it)."""
    B, Sq, Sk, D, W = 3, 45, 77, 16, 9
    q, k, v = _inputs(B, Hq, Hkv, Sq, Sk, D, dtype, seed=5)
    km = torch.ones(B, Sk, dtype=torch.bool)
    km[1, :13] = False
    km[2, :50] = False  # padding reaching into the queries (the last 45 keys start at 32)
    km[0, 40:52] = False  # a hole longer than the window: queries 49..51 see only their own (masked) key
    for q_offset in (None, 20):
        out = window_attention_triton(q, k, v, scale=0.3, window=W, key_mask=km, q_offset=q_offset,
                                      tiles=WindowTiles(*tiles) if tiles else None)
        ref = _dense(q, k, v, 0.3, W, key_mask=km, q_offset=q_offset)
        assert _rel(out, ref) < TOL[dtype]


def test_every_output_is_written(monkeypatch):
    """The output buffer poisoned with NaN before the launch: every row of every head and batch is written."""
    real = torch.empty

    def poisoned(*a, **kw):
        return real(*a, **kw).fill_(float("nan"))

    q, k, v = _inputs(2, 14, 2, 53, 53, 16, torch.float32, seed=7)
    monkeypatch.setattr(torch, "empty", poisoned)
    out = window_attention_triton(q, k, v, scale=0.25, window=7, tiles=WindowTiles(64, 16))
    monkeypatch.undo()
    assert not out.isnan().any()
    assert _rel(out, _dense(q, k, v, 0.25, 7)) < 1e-5


def test_equals_the_banded_path_on_a_transposed_layout():
    """q/k/v as a model hands them over ([B, S, H, D] transposed to [B, H, S, D]): strides, not copies."""
    B, S, D = 1, 150, 32
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, S, 4, D, generator=g).transpose(1, 2)
    k = torch.randn(B, S, 2, D, generator=g).transpose(1, 2)
    v = torch.randn(B, S, 2, D, generator=g).transpose(1, 2)
    out = window_attention_triton(q, k, v, scale=0.2, window=20, tiles=WindowTiles(32, 16))
    torch.testing.assert_close(out, banded_window_attention(q, k, v, scale=0.2, window=20), atol=2e-6, rtol=1e-5)


def test_supported_says_why_not():
    q = torch.randn(1, 2, 4, 24)
    assert "power of two" in window_kernel_supported(q, q, q)
    q = torch.randn(1, 2, 4, 32, requires_grad=True)
    assert "backward" in window_kernel_supported(q, q.detach(), q.detach())
    with torch.no_grad():
        assert window_kernel_supported(q, q.detach(), q.detach()) is None
    x = torch.randn(1, 2, 4, 32, dtype=torch.float64)
    assert "dtypes" in window_kernel_supported(x, x, x)
    with pytest.raises(RuntimeError, match="cannot run"):
        window_attention_triton(torch.randn(1, 2, 5, 24), torch.randn(1, 2, 5, 24), torch.randn(1, 2, 5, 24),
                                scale=0.2, window=3)
    x = torch.randn(1, 2, 10, 16)
    with pytest.raises(ValueError, match="do not lie within"):
        window_attention_triton(x, x[:, :, :8], x[:, :, :8], scale=1.0, window=4)


def test_softmax_attention_takes_the_kernel_only_without_gradient(monkeypatch):
    """The route as on CUDA (forced on the CPU: the interpreter) and the support check as it is: the kernel without
    a gradient, the banded path (with its backward) when one is required."""
    calls = []
    real = sm.window_attention_triton
    monkeypatch.setattr(sm, "window_kernel_route", lambda q, k, v: window_kernel_supported(q, k, v) is None)
    monkeypatch.setattr(sm, "window_attention_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    B, Hq, Hkv, S, D, W = 1, 4, 2, 200, 16, 8
    q, k, v = _inputs(B, Hq, Hkv, S, S, D, torch.float32, seed=11)
    assert sm.use_banded(S, S, W)
    ref = _dense(q, k, v, 0.25, W)
    out = softmax_attention(q, k, v, scale=0.25, window=W)
    assert calls == [1] and _rel(out, ref) < 1e-5
    qq = q.clone().requires_grad_()
    out = softmax_attention(qq, k, v, scale=0.25, window=W)
    assert calls == [1], "the kernel has no backward: a call that needs a gradient takes the bands"
    out.sum().backward()
    assert qq.grad is not None and _rel(out.detach(), ref) < 1e-5
    with torch.no_grad():
        softmax_attention(qq, k, v, scale=0.25, window=W)
    assert calls == [1, 1]


def test_cpu_tensors_keep_the_banded_path(monkeypatch):
    """Without the forced route, CPU tensors (even under the interpreter) take the banded path."""
    monkeypatch.setattr(sm, "window_attention_triton", lambda *a, **kw: pytest.fail("kernel taken on the CPU"))
    q, k, v = _inputs(1, 4, 2, 200, 200, 16, torch.float32, seed=12)
    with torch.no_grad():
        softmax_attention(q, k, v, scale=0.25, window=8)


def test_patched_model_through_the_kernel_equals_the_bands(monkeypatch):
    """A sliding-window tiny Llama's padded prefill with the kernel's route forced (the interpreter): the same
    logits as through the banded path, and the kernel was taken."""
    import longctx_patch as lp
    from conftest import tiny_model

    model = lp.patch(tiny_model("llama"), "sliding-window", window=16)
    ids = torch.randint(3, 128, (2, 300), generator=torch.Generator().manual_seed(0))
    am = torch.ones(2, 300, dtype=torch.long)
    am[1, :37] = 0  # left padding
    with torch.no_grad():
        want = model(ids, attention_mask=am, use_cache=False).logits
        calls = []
        real = sm.window_attention_triton
        monkeypatch.setattr(sm, "window_kernel_route", lambda q, k, v: window_kernel_supported(q, k, v) is None)
        monkeypatch.setattr(sm, "window_attention_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        got = model(ids, attention_mask=am, use_cache=False).logits
    assert calls, "the 300-token prefill did not take the kernel"
    keep = am.bool()
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)


def test_the_tiles_reach_the_launch(monkeypatch):
    """`tiles=WindowTiles(...)`: rows, keys, warps and stages are the launch's; a tile left None keeps its default
    (`window_tiles`), and no environment variable changes them."""
    import longctx_patch.kernels.window.triton_window as tw

    launches = []
    real = tw._window_fwd_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append({k: kw[k] for k in ("BR", "BN", "num_warps", "num_stages")})
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(tw, "_window_fwd_kernel", Recorder())
    monkeypatch.setenv("LONGCTX_WINDOW_WARPS", "1")  # the former override: read no more
    q, k, v = _inputs(1, 4, 2, 40, 40, 16, torch.float32, seed=11)
    ref = _dense(q, k, v, 0.25, 9)
    out = window_attention_triton(q, k, v, scale=0.25, window=9, tiles=WindowTiles(32, 16, warps=2, stages=3))
    assert _rel(out, ref) < 1e-5
    out = window_attention_triton(q, k, v, scale=0.25, window=9, tiles=WindowTiles(stages=1))
    assert _rel(out, ref) < 1e-5
    BR, BN, warps, _ = tw.window_tiles(16, torch.float32)
    assert launches == [{"BR": 32, "BN": 16, "num_warps": 2, "num_stages": 3},
                        {"BR": BR, "BN": BN, "num_warps": warps, "num_stages": 1}]
    assert tw.window_tiles(16, torch.float32, WindowTiles(warps=16)) == (BR, BN, 16, 2)


@pytest.mark.parametrize("field,value", [("block_rows", 24), ("block_keys", 8), ("warps", 64), ("warps", 3),
                                         ("stages", 0), ("stages", True), ("block_rows", 32.0)])
def test_bad_tiles_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=rf"WindowTiles\.{field}={value!r}: allowed None"):
        WindowTiles(**{field: value})
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(TypeError, match="a WindowTiles"):
        window_attention_triton(q, q, q, scale=0.25, window=2, tiles=(32, 16))


def test_the_benchmark_passes_its_tiles():
    """bench_window's `--tiles BR,BN,WARPS,STAGES` (the way to try other tiles, now that no environment variable sets
    them): an empty entry keeps that default; a bad one is refused naming the option."""
    from benchmarks.ops.bench_window import parse_tiles

    assert parse_tiles(None) is None
    assert parse_tiles("64,,4,3") == WindowTiles(64, None, 4, 3)
    for bad in ("64,64", "64,64,3,2"):
        with pytest.raises(SystemExit, match="--tiles"):
            parse_tiles(bad)
