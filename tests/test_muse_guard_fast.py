"""The guard's estimate (longctx_patch/methods/muse/guard.py) computes what its first implementation computed
(tests/guard_reference.py) with a cheap per-call path: `exact_rows` equals the reference (odd lengths, 7 query heads
per kv head and 1, bf16 and fp32, left padding, rows at position 0 and at S - 1, keys in chunks merged as an online
softmax); the kept sample equals `sample_ranks` and `sampled_rows` the reference's rows and weights; `estimate_errors`
the reference's estimates to rounding, padded or not, some heads skipped; without a key mask a call reads nothing
back and copies nothing to the device once its length's sample is kept; the table of kept constants is bounded and
shared safely by threads."""

import os
import threading

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import guard_reference as old  # noqa: E402
from longctx_patch.methods.muse import guard as guard_mod  # noqa: E402
from longctx_patch.methods.muse.guard import estimate_errors, exact_rows, sample_ranks, sampled_rows  # noqa: E402


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def qkv(B, Hq, Hkv, S, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, S, D, generator=g) * torch.linspace(0.2, 1.5, Hq)[None, :, None, None]
    k, v = (torch.randn(B, Hkv, S, D, generator=g) for _ in range(2))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def left_padded(B, S, pads):
    km = torch.ones(B, S, dtype=torch.bool)
    for b, p in enumerate(pads):
        km[b, :p] = False
    return km


def positions(B, Hq, m, S, seed=0):
    """Random rows per (batch row, head), with position 0 and S - 1 among them."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, S, (B, Hq, m), generator=g)
    pos[:, :, 0], pos[:, :, 1] = 0, S - 1
    return pos


# ----------------------------------------------------------------------------------------------- exact_rows
@pytest.mark.parametrize("path", ["kernel", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hq, Hkv", [(14, 2), (3, 3)])
@pytest.mark.parametrize("padded", [False, True])
def test_exact_rows_equals_the_reference(path, dtype, Hq, Hkv, padded, monkeypatch):
    """Odd lengths, GQA 7:1 and 1:1, bf16 and fp32, left padding (a row at a padded position has no key: 0), on the
    split-key Triton kernel (TRITON_INTERPRET here) and on SDPA with a mask (where the kernel does not run)."""
    if path == "sdpa":
        monkeypatch.setattr(guard_mod, "decode_kernel_supported", lambda *a: "the SDPA path")
    B, S, D, m = 3, 97, 16, 9
    q, k, v = qkv(B, Hq, Hkv, S, D, dtype)
    km = left_padded(B, S, (0, 5, 40)) if padded else None
    pos = positions(B, Hq, m, S)
    got, want = exact_rows(q, k, v, pos, km, scale=D ** -0.5), old.exact_rows(q, k, v, pos, km, scale=D ** -0.5)
    assert got.dtype == torch.float32 and got.shape == (B, Hq, m, D)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # rounded to bf16 like the reference; the weights of the values may be bf16 too (as a head made exact:
        # flash attention's), so within a few bf16 steps of float64 attention
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
        f64 = old.exact_rows(q.double(), k.double(), v.double(), pos, km, scale=D ** -0.5)
        rel = lambda x: ((x - f64).norm() / f64.norm()).item()  # noqa: E731
        assert rel(got) < 2 ** -8
    if padded:  # row 2's positions 0 .. 39 are padding: no key
        dead = pos[2] < 40
        assert dead.any() and (got[2][dead] == 0).all()


def test_batch_rows_in_groups_equal_one_group(monkeypatch):
    """SDPA's path (head_dim 8: not the kernel's): masks over the bound go by groups of batch rows: groups of 1 and 2 of 3 rows (a last partial one), left
    padding, rows at 0 and S - 1, equal one group and the reference."""
    B, Hq, Hkv, S, D, m = 3, 6, 2, 131, 8, 7
    q, k, v = qkv(B, Hq, Hkv, S, D, torch.float32, seed=1)
    km = left_padded(B, S, (0, 37, 3))
    pos = positions(B, Hq, m, S, seed=1)
    whole = exact_rows(q, k, v, pos, km, scale=0.3)
    torch.testing.assert_close(whole, old.exact_rows(q, k, v, pos, km, scale=0.3), rtol=1e-5, atol=1e-6)
    one = Hkv * 3 * m * S  # one batch row's mask
    for rows in (1, 2):
        monkeypatch.setattr(guard_mod, "_MASK_BYTES", rows * one)
        torch.testing.assert_close(exact_rows(q, k, v, pos, km, scale=0.3), whole, rtol=0, atol=0)
    assert (whole[1][pos[1] < 37] == 0).all() and (pos[1] < 37).any()  # row 1's positions in its padding


# ----------------------------------------------------------------------------------------------- the sample
def test_the_kept_sample_is_sample_ranks():
    for n, first, rows in ((400, 80, 12), (97, 80, 16), (90, 80, 64), (5000, 37, 48), (81, 80, 3)):
        ranks, weights = guard_mod.kept_stratified(n, first, rows, torch.device("cpu"))
        r, w = sample_ranks(n, first, rows)
        assert ranks.tolist() == r and weights.tolist() == w
        assert ranks.dtype == torch.long and weights.dtype == torch.float32
        again = guard_mod.kept_stratified(n, first, rows, torch.device("cpu"))
        assert again[0] is ranks and again[1] is weights  # kept


@pytest.mark.parametrize("S, first, rows", [(400, 80, 16), (97, 80, 16), (97, 80, 17), (301, 13, 64),
                                            (80, 80, 16), (50, 80, 16), (203, 80, 3)])
@pytest.mark.parametrize("padded", [False, True])
def test_sampled_rows_equal_the_reference(S, first, rows, padded):
    """The same positions and weights, in the same order, and the same counts: every row sampled (A <= rows),
    the top rows and stratified ones (A > rows), none (A <= 0); padded rows of every kind in one batch."""
    B, Hq, D = 4, 3, 8
    o = torch.randn(B, S, Hq, D, generator=torch.Generator().manual_seed(S + rows))
    o[0, S - 1, 1] = 9.0  # a top row at S - 1
    km = left_padded(B, S, (0, 3, S // 2, S - 2)) if padded else None
    got, want = sampled_rows(o, km, first, rows), old.sampled_rows(o, km, first, rows)
    assert got[2] == want[2]
    if want[0] is None:
        assert got[0] is None and got[1] is None
        return
    assert torch.equal(got[0], want[0]) and got[0].dtype == torch.long
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------- the estimate
def muse_like(q, k, v, km, scale, seed=0):
    """An output with a different error per head: exact attention plus noise growing with the head."""
    from longctx_patch.kernels.softmax import softmax_attention

    o = softmax_attention(q.float(), k.float(), v.float(), scale=scale, key_mask=km)  # [B, S, Hq, D]
    g = torch.Generator().manual_seed(seed)
    Hq = q.shape[1]
    o = o + torch.randn(o.shape, generator=g) * torch.linspace(0.005, 0.3, Hq)[None, None, :, None] * o.std()
    return o.to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
def test_estimate_errors_equal_the_reference(dtype, padded):
    """GQA 7:1, odd length, 16 rows (4 top, 12 stratified); padded: a row with nothing approximated (NaN) among
    others; some heads skipped (NaN); the same decisions at a 10% budget."""
    B, Hq, Hkv, S, D = 3, 14, 2, 173, 16
    q, k, v = qkv(B, Hq, Hkv, S, D, dtype, seed=2)
    km = left_padded(B, S, (0, 11, 140)) if padded else None
    scale = D ** -0.5
    o = muse_like(q, k, v, km, scale)
    for heads in (None, [h for h in range(Hq) if h % 3]):
        got, gc = estimate_errors(o, q, k, v, km, scale=scale, first=40, rows=16, heads=heads)
        want, wc = old.estimate_errors(o, q, k, v, km, scale=scale, first=40, rows=16, heads=heads)
        assert gc == wc and got.shape == (B, Hq) and got.dtype == torch.float32
        assert torch.equal(got.isnan(), want.isnan())
        # bf16: the reference rows' own rounding (the weights of the values in bf16 on the kernel, as in flash
        # attention) moves an estimate by up to ~0.15 points (measured 0.14), against a budget of 10
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2.5e-3)
        torch.testing.assert_close(got, want, **tol, equal_nan=True)
        assert torch.equal(got > 0.1, want > 0.1)
        if padded:
            assert gc[2] == 0 and got[2].isnan().all()
        if heads is not None:
            assert got[:, [h for h in range(Hq) if h not in heads]].isnan().all()


class _Ops(TorchDispatchMode):
    """The ops run, and whether any read a host tensor into another device's."""

    def __init__(self):
        super().__init__()
        self.names, self.from_host = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        out = func(*args, **(kwargs or {}))
        ins = [a for a in args if isinstance(a, torch.Tensor)]
        outs = out if isinstance(out, (tuple, list)) else [out]
        if any(a.device.type == "cpu" and a.dim() > 0 for a in ins) and any(
                isinstance(x, torch.Tensor) and x.device.type != "cpu" for x in outs):
            self.from_host.append(str(func))
        return out


def test_an_unpadded_call_reads_nothing_back_and_copies_nothing_once_kept():
    """On the meta device (no data: a read back would fail), an unpadded call's estimate runs; its first call at a
    length copies the kept sample to the device, the next ones copy nothing, and none reads a value back."""
    B, Hq, Hkv, S, D = 2, 14, 2, 203, 16
    q, k, v = (torch.empty(B, h, S, D, device="meta", dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
    o = torch.empty(B, S, Hq, D, device="meta", dtype=torch.bfloat16)
    with _Ops() as first:
        err, counts = estimate_errors(o, q, k, v, None, scale=0.25, first=40, rows=16)
    assert counts == [16, 16] and err.shape == (B, Hq) and err.device.type == "meta"
    assert first.from_host  # the sample, made once for this length
    for heads in (None, list(range(1, Hq))):
        estimate_errors(o, q, k, v, None, scale=0.25, first=40, rows=16, heads=heads)
        with _Ops() as again:
            estimate_errors(o, q, k, v, None, scale=0.25, first=40, rows=16, heads=heads)
        assert again.names and not again.from_host, again.from_host
        assert not any("_local_scalar_dense" in n or "item" in n for n in again.names)


def test_the_kept_constants_are_bounded_and_shared_by_threads():
    dev = torch.device("cpu")
    results, errors = {}, []

    def run(t):
        try:
            for n in range(200, 200 + 3 * guard_mod._CONSTANTS_KEPT):
                ranks, weights = guard_mod.kept_stratified(n, 40, 16, dev)
                if (ranks.tolist(), weights.tolist()) != sample_ranks(n, 40, 16):
                    errors.append(n)
            results[t] = True
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 4
    assert len(guard_mod._constants) <= guard_mod._CONSTANTS_KEPT
