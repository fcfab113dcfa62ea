"""The dtype rule of a method's own parameters: float32 whatever the model's dtype (PatchedAttention._apply).

`patch` then `.to(bf16)` and `.to(bf16)` then `patch` give the same parameters and the same logits, casts lose
nothing of the method's parameters, and save_patched / load_patched keep them in float32."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import tiny_model
from torch import nn

import longctx_patch as lp
from longctx_patch.patcher import method_state_dict, patched_modules

# every method with parameters, small enough for a tiny model; ovq's beta = 3 has a log that bf16 rounds visibly
WITH_PARAMETERS = {
    "lolcats": dict(checkpoint="none", window=5, feature_dim=8, chunk=4, backend="torch"),
    "lola": dict(checkpoint="none", window=5, feature_dim=8, chunk=4, sparse_cache=3, backend="torch"),
    "ovq": dict(qk_norm=True, beta=3.0, chunk_size=8, max_centroids=4, growth=2.0, backend="torch"),
}


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one intra-op thread


def _ids(seed=0):
    return torch.randint(3, 128, (2, 37), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _method_dtypes(model) -> dict[str, torch.dtype]:
    return {k: v.dtype for k, v in method_state_dict(model).items()}


def test_every_method_with_parameters_is_covered():
    """A method that gains parameters joins WITH_PARAMETERS (and so the tests below)."""
    from longctx_patch.methods import base, list_methods

    list_methods()
    have = set()
    for name in sorted(base._REGISTRY):
        if name.startswith("test-"):
            continue
        model = tiny_model("llama", num_hidden_layers=1)
        lp.patch(model, name, **WITH_PARAMETERS.get(name, {"backend": "torch"} if name == "muse" else {}))
        if method_state_dict(model):
            have.add(name)
    assert have == set(WITH_PARAMETERS)


@pytest.mark.parametrize("method", sorted(WITH_PARAMETERS))
def test_patch_then_cast_equals_cast_then_patch(method):
    kw = WITH_PARAMETERS[method]
    ids = _ids()
    ref = tiny_model("llama")
    lp.patch(ref, method, **kw)
    ref_sd = {k: v.clone() for k, v in method_state_dict(ref).items()}
    assert ref_sd and set(_method_dtypes(ref).values()) == {torch.float32}

    a = tiny_model("llama")
    lp.patch(a, method, **kw)
    a = a.to(torch.bfloat16)
    b = tiny_model("llama").to(torch.bfloat16)
    lp.patch(b, method, **kw)
    for m in (a, b):
        assert set(_method_dtypes(m).values()) == {torch.float32}, method
        assert m.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16  # the rest did follow the cast
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for n in pa:
        assert pa[n].dtype == pb[n].dtype and torch.equal(pa[n], pb[n]), n
    sa, sb = method_state_dict(a), method_state_dict(b)
    for k in ref_sd:  # the cast rounded nothing of the method's parameters
        assert torch.equal(sa[k], ref_sd[k]) and torch.equal(sb[k], ref_sd[k]), k
    la, lb = _logits(a, ids), _logits(b, ids)
    assert la.dtype == torch.bfloat16 and torch.equal(la, lb)

    # .half() and back to float32: nothing lost, and the model is the fp32 one again
    a = a.half().float()
    assert all(torch.equal(v, ref_sd[k]) for k, v in method_state_dict(a).items())
    # a device move still moves them
    a.to("meta")
    assert {p.device.type for p in a.parameters()} == {"meta"}
    assert set(_method_dtypes(a).values()) == {torch.float32}


@pytest.mark.parametrize("method", sorted(WITH_PARAMETERS))
def test_trained_parameters_survive_bf16_casts_and_save_load(method, tmp_path):
    """Values bf16 cannot hold (as training leaves them) stay exact through save/load and casts."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    kw = WITH_PARAMETERS[method]
    ids = _ids(1)
    tiny_model("llama").save_pretrained(tmp_path / "base")
    # loaded as load_patched loads (from_pretrained keeps the rotary buffers in float32, a cast would not)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.bfloat16).eval()
    lp.patch(model, method, **kw)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for mod in patched_modules(model).values():
            for name, p in mod.named_parameters():
                if not name.startswith(("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")):
                    p.add_(1e-3 * torch.randn(p.shape, generator=g))
    sd = {k: v.clone() for k, v in method_state_dict(model).items()}
    assert any(not torch.equal(v, v.bfloat16().float()) for v in sd.values())  # not representable in bf16
    before = _logits(model, ids)

    lp.save_patched(model, tmp_path / "saved")
    assert {t.dtype for t in load_file(str(tmp_path / "saved" / "longctx_patch.safetensors")).values()} == {torch.float32}
    for dtype in ("bfloat16", "float32"):
        loaded = lp.load_patched(tmp_path / "saved", dtype=dtype, device="cpu")
        got = method_state_dict(loaded)
        assert got.keys() == sd.keys() and all(v.dtype == torch.float32 and torch.equal(v, sd[k]) for k, v in got.items())
        if dtype == "bfloat16":
            assert torch.equal(_logits(loaded, ids), before)

    model.to(torch.float32).to(torch.bfloat16)
    assert all(v.dtype == torch.float32 and torch.equal(v, sd[k]) for k, v in method_state_dict(model).items())


@pytest.mark.parametrize("method", ["lolcats", "lola"])
def test_float32_feature_maps_on_a_bf16_model_run_the_triton_kernels(method):
    """The Triton kernels take float32 feature maps with bf16 activations (projection in float32), as the
    PyTorch path does: a bf16 model gives the same logits on both (interpreted on the CPU)."""
    ids = _ids(2)[:, :21]
    model = tiny_model("llama", num_hidden_layers=1).to(torch.bfloat16)
    lp.patch(model, method, **WITH_PARAMETERS[method])
    attn = model.model.layers[0].self_attn
    assert attn.feature_map_q.mlp.layer.dtype == torch.float32
    want = _logits(model, ids)
    attn.method_config.backend = "triton"
    got = _logits(model, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_build_makes_a_methods_low_precision_parameters_float32():
    """A method that declares its parameters in the model's dtype still gets float32 ones."""
    from longctx_patch.methods import base, list_methods
    from longctx_patch.methods.base import Method, MethodConfig, PatchedAttention, register_method
    from longctx_patch.kernels.softmax import key_mask_for, softmax_attention

    name = "test-bf16-parameter"

    class Attn(PatchedAttention):
        method_name = name

        def __init__(self, orig, spec, config, adapter):
            super().__init__(orig, spec, config, adapter)
            self.gain = nn.Parameter(torch.full((spec.num_heads,), 1.0 + 2**-10, dtype=torch.bfloat16))
            self.register_buffer("bias_table", torch.zeros(3, dtype=torch.float16))
            self.register_buffer("steps", torch.zeros(2, dtype=torch.int64))

        def attend(self, q, k, v, cache_layer, padding):
            if cache_layer is not None:
                k, v = cache_layer.update(k, v)
            q = q * self.gain.to(q.dtype)[None, :, None, None]
            return softmax_attention(q, k, v, scale=self.scaling, key_mask=key_mask_for(padding, k.shape[2]))

    @dataclass
    class Cfg(MethodConfig):
        pass

    class M(Method):
        config_cls = Cfg
        module_cls = Attn

    M.name = name
    list_methods()
    register_method(M)
    try:
        model = tiny_model("llama")
        lp.patch(model, name)
        attn = model.model.layers[0].self_attn
        assert attn.gain.dtype == attn.bias_table.dtype == torch.float32 and attn.steps.dtype == torch.int64
        model.to(torch.bfloat16)
        assert attn.gain.dtype == attn.bias_table.dtype == torch.float32 and attn.steps.dtype == torch.int64
        assert attn.q_proj.weight.dtype == torch.bfloat16
    finally:
        base._REGISTRY.pop(name, None)
