"""The split-key attention kernels for few queries under a key mask (`kernels/decode/`) against the dense fp64
reference, through the Triton interpreter: batched decode with left padding, a padded tail of several queries,
windows, GQA and plain heads, several key splits, odd lengths, fp32 and bf16."""

import pytest
import torch

from longctx_patch.kernels.decode import decode_kernel_supported, masked_few_query_attention
from longctx_patch.kernels.decode.reference import masked_few_query_reference
from longctx_patch.kernels.softmax import softmax_attention


def _dense(q, k, v, scale, key_mask, q_offset, window):
    return masked_few_query_reference(q, k, v, scale=scale, key_mask=key_mask, q_offset=q_offset, window=window)


CASES = [  # B, Hq, Hkv, Sq, Sk, D, window, splits
    (3, 6, 2, 1, 203, 16, None, 3),   # decode, GQA 3, three splits, odd length
    (2, 4, 4, 1, 130, 32, None, 1),   # plain heads, one split
    (2, 8, 2, 5, 257, 16, None, 4),   # a padded tail of 5 queries: 20 stacked rows in one block of 32
    (1, 8, 2, 17, 200, 16, None, 2),  # 17 queries: 68 stacked rows, two blocks of 64 (the second mostly padding)
    (2, 6, 2, 3, 150, 16, 40, 2),     # a window
    (1, 4, 1, 1, 70, 64, 9, 5),       # a narrow window: most splits hold no key of the row
]


@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,window,splits", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_few_query_kernel_equals_reference(B, Hq, Hkv, Sq, Sk, D, window, splits, dtype):
    g = torch.Generator().manual_seed(Sk + Sq)
    q = torch.randn(B, Hq, Sq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Sk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Sk, D, generator=g).to(dtype)
    km = torch.ones(B, Sk, dtype=torch.bool)
    for b in range(1, B):  # left padding, row b starts b * Sk / 3 keys late; row 0 has none
        km[b, : b * Sk // 3] = False
    km[B - 1, Sk // 2] = False  # and a hole in the middle
    for key_mask in (km, None):
        if key_mask is None and window is None:
            continue  # no mask at all: the flash path, not this kernel
        out = masked_few_query_attention(q, k, v, scale=D ** -0.5, key_mask=key_mask, window=window, splits=splits)
        ref = _dense(q, k, v, D ** -0.5, key_mask, None, window)
        assert out.shape == (B, Sq, Hq, D) and out.dtype == dtype
        tol = 2e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
        # and the package's exact path (SDPA on the CPU) agrees
        exact = softmax_attention(q, k, v, scale=D ** -0.5, key_mask=key_mask, window=window)
        torch.testing.assert_close(out.double(), exact.double(), atol=tol, rtol=tol)


def test_queries_at_an_offset_and_default_splits():
    """q_offset other than the end (queries in the middle of the keys) and the automatic split count."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 2, 32, generator=g)
    k = torch.randn(2, 2, 300, 32, generator=g)
    v = torch.randn(2, 2, 300, 32, generator=g)
    km = torch.ones(2, 300, dtype=torch.bool)
    km[1, :77] = False
    out = masked_few_query_attention(q, k, v, scale=0.2, key_mask=km, q_offset=150)
    torch.testing.assert_close(out.double(), _dense(q, k, v, 0.2, km, 150, None), atol=2e-6, rtol=2e-6)


def test_supported_says_why_not():
    q = torch.randn(1, 2, 1, 24)
    assert "power of two" in decode_kernel_supported(q, q, q)
    q = torch.randn(1, 2, 1, 32, requires_grad=True)
    assert "backward" in decode_kernel_supported(q, q.detach(), q.detach())
    with pytest.raises(RuntimeError, match="cannot run"):
        masked_few_query_attention(torch.randn(1, 2, 1, 24), torch.randn(1, 2, 5, 24), torch.randn(1, 2, 5, 24),
                                   scale=0.2)


def test_decode_over_a_preallocated_buffer():
    """The call a `KVBufferLayer` decode step makes (methods/kv_layer.py): one query against the whole buffer,
    valid slots anywhere (a ring), zeroed empty slots, `q_offset` = capacity (no causal rule, no forced own slot):
    equal to attention over the valid keys alone, GQA with 7 query heads per kv head."""
    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, cap, D = 2, 14, 2, 96, 16
    q = torch.randn(B, Hq, 1, D, generator=g)
    k = torch.randn(B, Hkv, cap, D, generator=g)
    v = torch.randn(B, Hkv, cap, D, generator=g)
    km = torch.rand(B, cap, generator=g) < 0.6
    k[~km[:, None, :, None].expand_as(k)] = 0.0
    v[~km[:, None, :, None].expand_as(v)] = 0.0
    out = masked_few_query_attention(q, k, v, scale=D ** -0.5, key_mask=km, q_offset=cap, splits=3)
    torch.testing.assert_close(out.double(), _dense(q, k, v, D ** -0.5, km, cap, None), atol=2e-6, rtol=2e-6)
    exact = softmax_attention(q, k, v, scale=D ** -0.5, key_mask=km, q_offset=cap)
    torch.testing.assert_close(out, exact, atol=2e-6, rtol=2e-6)
    for b in range(B):  # the valid keys alone, in slot order (softmax does not depend on the keys' order)
        kb, vb = k[b:b + 1, :, km[b]], v[b:b + 1, :, km[b]]
        alone = _dense(q[b:b + 1], kb, vb, D ** -0.5, None, kb.shape[2], None)
        torch.testing.assert_close(out[b:b + 1].double(), alone, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
def test_rows_at_their_own_positions_per_head(dtype, splits):
    """`positions` [B, Hq, Sq]: each head's rows anywhere in the prompt (MuSe's guard samples them so), GQA 7:1, an
    odd length, left padding (rows at real positions), rows at the first real key and at the last; each row equals
    the dense reference of that one query at its position."""
    B, Hq, Hkv, Sq, Sk, D = 2, 14, 2, 5, 131, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, Hq, Sq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Sk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Sk, D, generator=g).to(dtype)
    km = torch.ones(B, Sk, dtype=torch.bool)
    km[1, :40] = False
    pos = torch.randint(40, Sk, (B, Hq, Sq), generator=g)
    pos[:, :, 0], pos[:, :, 1] = 40, Sk - 1
    pos[0, :, 2] = 0  # row 0 has no padding: its first key
    for key_mask in (km, None):
        out = masked_few_query_attention(q, k, v, scale=0.25, key_mask=key_mask, splits=splits, positions=pos)
        assert out.shape == (B, Sq, Hq, D) and out.dtype == dtype
        tol = 2e-6 if dtype == torch.float32 else 2e-2
        for b in range(B):
            for h in range(Hq):
                for i in range(Sq):
                    t = int(pos[b, h, i])
                    ref = _dense(q[b:b + 1, h:h + 1, i:i + 1], k[b:b + 1, h // 7:h // 7 + 1, :t + 1],
                                 v[b:b + 1, h // 7:h // 7 + 1, :t + 1], 0.25,
                                 None if key_mask is None else key_mask[b:b + 1, :t + 1], None, None)
                    torch.testing.assert_close(out[b, i, h].double(), ref[0, 0, 0], atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="positions"):
        masked_few_query_attention(q, k, v, scale=0.25, key_mask=km, positions=pos[:, :7])
    with pytest.raises(ValueError, match="window"):
        masked_few_query_attention(q, k, v, scale=0.25, key_mask=km, positions=pos, window=8)
