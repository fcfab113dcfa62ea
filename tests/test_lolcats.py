"""`lolcats` / `lola` methods on tiny models: training, generate(), padding, cache size, checkpoints."""

import contextlib
import os

import pytest
import torch

import longctx_patch as lp
from longctx_patch.errors import CheckpointError, ConfigError, NotPatchedError
from longctx_patch.methods.lola import LolaLayer, export_lolcats_checkpoint

from conftest import assert_left_padded_batch_matches_single, get_peft_model, tiny_model

KW = dict(window=5, feature_dim=8, chunk=4, backend="torch")


def _ids(B, S, seed=0):
    return torch.randint(3, 128, (B, S), generator=torch.Generator().manual_seed(seed))


def _greedy_recompute(model, x, n):
    seq = x
    for _ in range(n):
        nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    return seq


def test_config_validation():
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match="window"):
        lp.patch(model, "lolcats", window=0)
    with pytest.raises(ConfigError, match="sparse_cache"):
        lp.patch(model, "lola", sparse_cache=-1)
    with pytest.raises(ConfigError, match="unknown"):
        lp.patch(model, "lolcats", sparse_cache=3)


def test_feature_maps_are_trainable_and_get_gradients():
    model = tiny_model("llama")
    lp.patch(model, "lolcats", **KW)
    model.train()
    x = _ids(2, 23)
    out = model(x, labels=x, use_cache=False)
    out.loss.backward()
    attn = model.model.layers[1].self_attn
    assert attn.feature_map_q.mlp.layer.shape == (4, 16, 8)
    for p in (attn.feature_map_q.mlp.layer, attn.feature_map_k.mlp.layer, attn.window_factors):
        assert p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0
    # the feature maps are new parameters of the module; q/k/v/o stay the original objects
    names = set(attn.method_parameters())
    assert names == {"feature_map_q.mlp.layer", "feature_map_k.mlp.layer", "window_factors"}


@pytest.mark.parametrize("method,extra", [("lolcats", {}), ("lola", {"sparse_cache": 3})])
def test_gradients_flow_with_the_default_use_cache(method, extra):
    """A training forward outside Trainer leaves `use_cache` on (the config's default). The attention must stay
    in the autograd graph there: same loss and gradients as use_cache=False, the cache it fills continues like
    a no-grad prefill's, and continuing a cached sequence with gradients gives the no-grad values and gradients
    for the new tokens."""
    from longctx_patch.methods.lola import attention as lolcats_module

    lolcats_module._WARNED_CACHE_IN_TRAINING.discard(method)  # warned once per process
    model = tiny_model("llama")
    lp.patch(model, method, **KW, **extra)
    model.train()
    attn = model.model.layers[0].self_attn
    x = _ids(2, 23)
    grads = []
    for use_cache in (None, False):  # None: the config's default (True)
        model.zero_grad()
        kw = {} if use_cache is None else {"use_cache": use_cache}
        with pytest.warns(UserWarning, match="use_cache=False") if use_cache is None else contextlib.nullcontext():
            out = model(x, labels=x, **kw)
        out.loss.backward()
        assert attn.q_proj.weight.grad is not None and attn.feature_map_k.mlp.layer.grad is not None
        grads.append((out.loss.detach(), attn.q_proj.weight.grad.clone(), attn.feature_map_k.mlp.layer.grad.clone()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        pre = model(x[:, :17], use_cache=True)
        want = model(x[:, 17:], past_key_values=pre.past_key_values).logits
    pre = model(x[:, :17], use_cache=True)  # with gradients
    with torch.no_grad():
        got = model(x[:, 17:], past_key_values=pre.past_key_values).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    model.zero_grad()
    with torch.no_grad():
        pre = model(x[:, :17], use_cache=True)
    cont = model(x[:, 17:], past_key_values=pre.past_key_values).logits  # with gradients, from a cached state
    torch.testing.assert_close(cont, want, atol=1e-5, rtol=1e-5)
    cont.sum().backward()
    assert attn.q_proj.weight.grad is not None and attn.q_proj.weight.grad.abs().sum() > 0


def test_lola_trains_with_its_sparse_cache():
    """With gradients and no cache, lola runs its differentiable path with the sparse cache in place (an
    attention transfer or fine-tune with method lola trains the maps for the model that runs at inference):
    same logits as the no-grad inference path, gradients reach the maps, and they differ from lolcats'."""
    model = tiny_model("llama")
    lp.patch(model, "lola", **KW, sparse_cache=3)
    x = _ids(2, 41)
    with torch.no_grad():
        infer = model(x, use_cache=False).logits
    out = model(x, labels=x, use_cache=False)
    torch.testing.assert_close(out.logits.detach(), infer, atol=1e-5, rtol=1e-5)
    out.loss.backward()
    attn = model.model.layers[1].self_attn
    g_lola = attn.feature_map_k.mlp.layer.grad.clone()
    assert g_lola.abs().sum() > 0
    plain = tiny_model("llama")
    lp.patch(plain, "lolcats", **KW)  # same seed: the same fresh maps
    torch.testing.assert_close(plain.model.layers[1].self_attn.feature_map_k.mlp.layer, attn.feature_map_k.mlp.layer)
    out_p = plain(x, labels=x, use_cache=False)
    assert not torch.allclose(out_p.logits.detach(), infer, atol=1e-4)
    out_p.loss.backward()
    assert not torch.allclose(plain.model.layers[1].self_attn.feature_map_k.mlp.layer.grad, g_lola, atol=1e-7)


def _freeze_all_but_the_maps(model):
    for name, p in model.named_parameters():
        p.requires_grad_("feature_map" in name or "window_factors" in name)


def test_lola_transfer_takes_the_differentiable_path_where_triton_would_run(monkeypatch):
    """In an attention transfer the base model is frozen: q, k and v need no gradient, only the feature maps and
    window factors do. On CUDA `backend=auto` runs the Triton kernels (no backward) when nothing needs a
    gradient; the layer must see that the maps do (it looked at q, k only: outputs without a gradient, and the
    transfer stopped with 'element 0 of tensors does not require grad'). The CUDA decision is made here on the
    CPU, where the interpreter runs the kernels."""
    from longctx_patch.kernels.lola import ops
    from longctx_patch.patch_state import patched_modules

    real = ops.use_triton

    def as_on_cuda(backend, *tensors):
        if backend == "auto":
            return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors if t is not None))
        return real(backend, *tensors)

    x = _ids(2, 41)
    grads = {}
    for name in ("cuda decision", "reference"):
        model = tiny_model("llama")
        lp.patch(model, "lola", **{**KW, "backend": "auto"}, sparse_cache=3)
        for m in patched_modules(model).values():
            m.train_with_sets = False  # the chunk loop's own dispatch
        _freeze_all_but_the_maps(model)
        if name == "cuda decision":
            monkeypatch.setattr(ops, "use_triton", as_on_cuda)
        else:
            monkeypatch.setattr(ops, "use_triton", real)
        model(x, labels=x, use_cache=False).loss.backward()
        attn = model.model.layers[1].self_attn
        grads[name] = [attn.feature_map_q.mlp.layer.grad, attn.feature_map_k.mlp.layer.grad, attn.window_factors.grad]
    for got, want in zip(grads["cuda decision"], grads["reference"]):
        assert got is not None and got.abs().sum() > 0
        torch.testing.assert_close(got, want)


def test_triton_backend_under_grad_is_refused():
    model = tiny_model("llama")
    lp.patch(model, "lola", **{**KW, "backend": "triton"}, sparse_cache=3)
    _freeze_all_but_the_maps(model)
    x = _ids(1, 17)
    with pytest.raises(ConfigError, match="no backward"):
        model(x, labels=x, use_cache=False)
    with torch.no_grad():  # inference with the forced backend still runs
        assert torch.isfinite(model(x, use_cache=False).logits).all()


# llama: every method in tests/test_method_contract.py
@pytest.mark.parametrize("family,method,extra", [("qwen3", "lola", {"sparse_cache": 3})])
def test_generate_with_cache_equals_recompute(family, method, extra):
    model = tiny_model(family)
    lp.patch(model, method, **KW, **extra)
    x = _ids(1, 18, seed=3)
    with torch.no_grad():
        got = model.generate(x, max_new_tokens=10, do_sample=False, pad_token_id=0)
        want = _greedy_recompute(model, x, 10)
    assert torch.equal(got, want)


def test_lola_lambda_zero_is_lolcats_exactly():
    a, b = tiny_model("llama"), tiny_model("llama")
    lp.patch(a, "lolcats", **KW)
    lp.patch(b, "lola", sparse_cache=0, **KW)
    x = _ids(2, 21, seed=5)
    with torch.no_grad():
        assert torch.equal(a(x, use_cache=False).logits, b(x, use_cache=False).logits)
        ga = a.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                        return_dict_in_generate=True)
        gb = b.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                        return_dict_in_generate=True)
    assert torch.equal(ga.sequences, gb.sequences)
    for la, lb in zip(ga.logits, gb.logits):
        assert torch.equal(la, lb)


def test_linear_scale_weighs_the_linear_term():
    """linear_scale=0 leaves exact softmax over the window (the sliding-window method's output), in the full
    forward and in cached decoding; linear_scale=s equals scaling every layer's window factor g by 1/s."""
    base, zero, scaled = tiny_model("llama"), tiny_model("llama"), tiny_model("llama")
    lp.patch(base, "sliding-window", window=KW["window"])
    lp.patch(zero, "lolcats", linear_scale=0.0, **KW)
    lp.patch(scaled, "lolcats", linear_scale=0.25, init_window_factor=-2.197, **KW)  # g = 0.1
    x = _ids(2, 21, seed=7)
    with torch.no_grad():
        want = base(x, use_cache=False).logits
        torch.testing.assert_close(zero(x, use_cache=False).logits, want, rtol=1e-4, atol=1e-4)
        got = zero.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(got, base.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0))
        ref = tiny_model("llama")
        lp.patch(ref, "lolcats", init_window_factor=-2.197, **KW)
        for a, b in zip(ref.model.layers, scaled.model.layers):  # same fresh maps (seeded); g -> g / 0.25
            g = torch.sigmoid(b.self_attn.window_factors) / 0.25
            a.self_attn.window_factors.copy_(torch.logit(g))
        torch.testing.assert_close(scaled(x, use_cache=False).logits, ref(x, use_cache=False).logits,
                                   rtol=1e-4, atol=1e-4)
        assert not torch.allclose(scaled(x, use_cache=False).logits, want, atol=1e-3)
    with pytest.raises(ConfigError, match="linear_scale"):
        lp.patch(tiny_model("llama"), "lolcats", linear_scale=-1.0)


@pytest.mark.parametrize("method,extra,lens", [("lolcats", {}, (11, 4, 8)), ("lola", {"sparse_cache": 2}, (12, 4, 8))])
def test_left_padded_batch_equals_single_prompts(method, extra, lens):
    """lola decides evictions at absolute multiples of `chunk` (padding included), so its batch test uses
    pad lengths that are multiples of chunk; lolcats does not depend on that."""
    model = tiny_model("llama")
    lp.patch(model, method, **KW, **extra)
    assert_left_padded_batch_matches_single(model, lens, max_new_tokens=8)


def test_cache_bytes_do_not_grow_with_length():
    model = tiny_model("llama", num_hidden_layers=2)
    lp.patch(model, "lola", window=64, feature_dim=8, chunk=256, sparse_cache=16, backend="torch")
    sizes = {}
    with torch.no_grad():
        for S in (1024, 8192):
            out = model(_ids(1, S, seed=S), use_cache=True)
            cache = out.past_key_values
            assert all(isinstance(layer, LolaLayer) for layer in cache.layers)
            sizes[S] = cache.nbytes()
            # what the module reports is what the cache holds
            attn = model.model.layers[0].self_attn
            assert cache.layers[0].nbytes() == attn.state_bytes(S, batch=1, dtype=torch.float32)
    assert sizes[1024] == sizes[8192] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lola_cache_is_under_a_quarter_of_the_full_kv_cache_at_4k(dtype):
    """SmolLM2's attention shape (9 query / 3 kv heads, head_dim 64, feature_dim 64), eta = lambda = 256: the
    cache after a 4096-token prefill is under 1/4 of a full KV cache of the same dtype (keys and values only,
    one sparse cache per kv head, fp32 linear state), and the module's state_bytes() says so ahead of time.
    One sparse cache per query head (sparse_heads=query) costs three times the sparse part. The feature cache
    (feature_cache=True, opt-in: phi(k) of `chunk` keys, 2F per query head) adds 0.047 of the full cache (fp32
    or bf16; bf16 0.284 in all): its size checked, then the default layout measured."""
    model = tiny_model("llama", num_hidden_layers=1, hidden_size=576, intermediate_size=64, num_attention_heads=9,
                       num_key_value_heads=3, max_position_embeddings=8192).to(dtype)
    lp.patch(model, "lola", window=256, sparse_cache=256, feature_dim=64, chunk=64, backend="torch",
             feature_cache=True)
    with torch.no_grad():
        cache = model(_ids(1, 512, seed=3), use_cache=True).past_key_values
    elt = torch.tensor([], dtype=dtype).element_size()
    attn = model.model.layers[0].self_attn
    assert cache.layers[0].win_fk.shape == (1, 9, 64, 128)
    assert cache.layers[0].nbytes() == attn.state_bytes(512, dtype=dtype)
    lp.unpatch(model)
    lp.patch(model, "lola", window=256, sparse_cache=256, feature_dim=64, chunk=64, backend="torch",
             feature_cache=False)
    assert attn.state_bytes(512, dtype=dtype) - model.model.layers[0].self_attn.state_bytes(512, dtype=dtype) == (
        64 * 9 * 128 * elt)
    attn = model.model.layers[0].self_attn
    S = 4096
    with torch.no_grad():
        cache = model(_ids(1, S, seed=3), use_cache=True).past_key_values
    layer = cache.layers[0]
    full = 2 * 3 * S * 64 * elt
    assert layer.sp_k.shape == (1, 3, 256, 64) and bool(torch.isfinite(layer.sp_score).all())  # slots all used
    assert layer.nbytes() == attn.state_bytes(S, dtype=dtype) < full / 4
    lp.unpatch(model)
    lp.patch(model, "lola", window=256, sparse_cache=256, feature_dim=64, chunk=64, sparse_heads="query")
    attn = model.model.layers[0].self_attn
    assert attn.state_bytes(S, dtype=dtype) > full / 4


def test_save_load_round_trip_of_feature_maps(tmp_path):
    model = tiny_model("llama")
    lp.patch(model, "lola", sparse_cache=2, **KW)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "window_factors"):
                m.window_factors.add_(torch.randn_like(m.window_factors))
                m.feature_map_q.mlp.layer.mul_(1.5)
    lp.save_patched(model, tmp_path / "saved")
    loaded = lp.load_patched(tmp_path / "saved", dtype="float32", device="cpu")
    x = _ids(1, 15, seed=7)
    with torch.no_grad():
        assert torch.equal(model(x, use_cache=False).logits, loaded(x, use_cache=False).logits)
    # our safetensors also loads through checkpoint=, into a lolcats model
    fresh = tiny_model("llama")
    lp.patch(fresh, "lolcats", checkpoint=str(tmp_path / "saved"), **KW)
    a, b = model.model.layers[2].self_attn, fresh.model.layers[2].self_attn
    assert torch.equal(a.feature_map_q.mlp.layer, b.feature_map_q.mlp.layer)
    assert torch.equal(a.window_factors, b.window_factors)


def _lolcats_state_dict(model, prefix="model.", layers=range(3), H=4, D=16, F=8, seed=0, lora_rank=0):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in layers:
        base = f"{prefix}layers.{i}.self_attn."
        sd[base + "feature_map_q.mlp.layer"] = torch.randn(H, D, F, generator=g)
        sd[base + "feature_map_k.mlp.layer"] = torch.randn(H, D, F, generator=g)
        sd[base + "window_factors"] = torch.randn(1, H, 1, 1, generator=g)
        if lora_rank:
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                w = getattr(model.model.layers[i].self_attn, proj).weight
                sd[base + f"{proj}.lora_A.default.weight"] = torch.randn(lora_rank, w.shape[1], generator=g) * 0.1
                sd[base + f"{proj}.lora_B.default.weight"] = torch.randn(w.shape[0], lora_rank, generator=g) * 0.1
    return sd


@pytest.mark.parametrize("prefix", ["model.", "base_model.model.model.", ""])
def test_loads_lolcats_checkpoint_format(tmp_path, prefix):
    model = tiny_model("llama")
    sd = _lolcats_state_dict(model, prefix=prefix, lora_rank=2)
    path = tmp_path / "model.pt"
    torch.save({"model_state_dict": sd} if prefix == "" else sd, path)
    q_before = model.model.layers[1].self_attn.q_proj.weight.detach().clone()
    lp.patch(model, "lolcats", checkpoint=str(path), lora_alpha=4.0, **KW)
    attn = model.model.layers[1].self_attn
    base = f"{prefix}layers.1.self_attn."
    assert torch.equal(attn.feature_map_q.mlp.layer, sd[base + "feature_map_q.mlp.layer"])
    assert torch.equal(attn.feature_map_k.mlp.layer, sd[base + "feature_map_k.mlp.layer"])
    assert torch.equal(attn.window_factors, sd[base + "window_factors"])
    delta = sd[base + "q_proj.lora_B.default.weight"] @ sd[base + "q_proj.lora_A.default.weight"] * (4.0 / 2)
    torch.testing.assert_close(attn.q_proj.weight, q_before + delta)


def test_export_then_load_lolcats_checkpoint(tmp_path):
    model = tiny_model("llama")
    lp.patch(model, "lolcats", **KW)
    with torch.no_grad():
        model.model.layers[0].self_attn.window_factors.fill_(0.7)
    path = export_lolcats_checkpoint(model, str(tmp_path / "out" / "model.pt"))
    sd = torch.load(path, weights_only=True)
    assert "model.layers.0.self_attn.feature_map_q.mlp.layer" in sd and len(sd) == 9
    fresh = tiny_model("llama")
    lp.patch(fresh, "lola", checkpoint=path, sparse_cache=2, seed=99, **KW)
    for i in range(3):
        a, b = model.model.layers[i].self_attn, fresh.model.layers[i].self_attn
        assert torch.equal(a.feature_map_k.mlp.layer, b.feature_map_k.mlp.layer)
        assert torch.equal(a.window_factors, b.window_factors)


def test_export_and_load_of_a_hybrid_take_the_lolcats_layers_only(tmp_path):
    from longctx_patch.methods.lola import load_lolcats_checkpoint

    model = tiny_model("llama")
    lp.patch(model, "lolcats", layers="0-1", **KW)
    lp.patch(model, "ovq", layers=[2])
    path = export_lolcats_checkpoint(model, str(tmp_path / "model.pt"))
    sd = torch.load(path, weights_only=True)
    assert sorted({k.split(".")[2] for k in sd}) == ["0", "1"] and len(sd) == 6
    with torch.no_grad():
        model.model.layers[1].self_attn.window_factors.fill_(0.0)
    assert load_lolcats_checkpoint(model, path) == {"layers": 2, "lora_pairs": 0}
    assert torch.equal(model.model.layers[1].self_attn.window_factors, sd["model.layers.1.self_attn.window_factors"])
    lp.unpatch(model)
    with pytest.raises(NotPatchedError):
        export_lolcats_checkpoint(model, str(tmp_path / "again.pt"))


def test_export_writes_peft_lora_layout(tmp_path):
    peft = pytest.importorskip("peft")
    model = tiny_model("llama")
    lp.patch(model, "lolcats", **KW)
    pm = get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    path = export_lolcats_checkpoint(pm, str(tmp_path / "ft.pt"))
    sd = torch.load(path, weights_only=True)
    assert "base_model.model.model.layers.2.self_attn.q_proj.lora_A.default.weight" in sd
    assert "base_model.model.model.layers.2.self_attn.window_factors" in sd
    # and it loads back into a plain model, merging the adapters
    fresh = tiny_model("llama")
    lp.patch(fresh, "lolcats", checkpoint=path, lora_alpha=4.0, **KW)


def test_checkpoint_errors_list_the_keys(tmp_path):
    model = tiny_model("llama")
    sd = _lolcats_state_dict(model)
    del sd["model.layers.2.self_attn.window_factors"]
    sd["model.layers.0.self_attn.mystery"] = torch.zeros(1)
    sd["model.layers.1.self_attn.feature_map_k.mlp.layer"] = torch.zeros(4, 16, 5)
    path = tmp_path / "bad.pt"
    torch.save(sd, path)
    with pytest.raises(CheckpointError) as e:
        lp.patch(model, "lolcats", checkpoint=str(path), **KW)
    msg = str(e.value)
    assert "missing keys [layers.2.self_attn.window_factors]" in msg
    assert "unexpected keys [model.layers.0.self_attn.mystery]" in msg
    assert "model.layers.1.self_attn.feature_map_k.mlp.layer: expected (4, 16, 8), got (4, 16, 5)" in msg
    assert not lp.patcher.is_patched(model)  # a failed load leaves the model unpatched
    # a layer that is not patched
    sd = _lolcats_state_dict(model)
    torch.save(sd, path)
    with pytest.raises(CheckpointError, match="layer 2 is not patched"):
        lp.patch(model, "lolcats", layers="0-1", checkpoint=str(path), **KW)
    with pytest.raises(CheckpointError, match="not found"):
        lp.patch(model, "lolcats", checkpoint=str(tmp_path / "nope.pt"), **KW)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="weights_only"):
        lp.patch(model, "lolcats", checkpoint=str(tmp_path / "junk.pt"), **KW)
    assert not os.path.exists(tmp_path / "saved")


def test_damaged_or_diverged_safetensors_checkpoints_are_refused(tmp_path):
    """checkpoint= reads our safetensors (a file, or a folder with an adapter/) with the checked reader of
    longctx_patch.checkpoint: a damaged file or NaN/inf values are a CheckpointError, and the model stays unpatched."""
    from safetensors.torch import load_file, save_file

    model = tiny_model("llama")
    lp.patch(model, "lolcats", **KW)
    lp.save_patched(model, tmp_path / "saved")
    weights = tmp_path / "saved" / "longctx_patch.safetensors"
    good = load_file(str(weights))
    fresh = tiny_model("llama")
    for target in (weights, tmp_path / "saved"):  # the file itself, and the folder holding it
        weights.write_bytes(weights.read_bytes()[:-9])
        with pytest.raises(CheckpointError, match="cannot be read as safetensors.*truncated or corrupt"):
            lp.patch(fresh, "lolcats", checkpoint=str(target), **KW)
        assert not lp.is_patched(fresh)
        save_file({**good, "layers.1.window_factors": torch.full_like(good["layers.1.window_factors"], float("nan"))},
                  str(weights))
        with pytest.raises(CheckpointError, match=r"\['layers.1.window_factors'\] hold NaN or inf values"):
            lp.patch(fresh, "lolcats", checkpoint=str(target), **KW)
        assert not lp.is_patched(fresh)
        save_file(good, str(weights))
    lp.patch(fresh, "lolcats", checkpoint=str(weights), **KW)  # the intact file loads
    assert torch.equal(fresh.model.layers[1].self_attn.window_factors, good["layers.1.window_factors"])
    lp.unpatch(fresh)
    # a diverged PEFT adapter beside the weights is refused too (its LoRA would be merged into the projections)
    peft = pytest.importorskip("peft")
    pm = get_peft_model(tiny_model("llama"), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    pm.save_pretrained(str(tmp_path / "saved" / "adapter"))
    adapter = tmp_path / "saved" / "adapter" / "adapter_model.safetensors"
    sd = load_file(str(adapter))
    key = sorted(k for k in sd if "lora_B" in k)[0]
    save_file({**sd, key: torch.full_like(sd[key], float("inf"))}, str(adapter))
    before = fresh.model.layers[0].self_attn.q_proj.weight.clone()
    with pytest.raises(CheckpointError, match=rf"adapter_model.safetensors: \['{key}'\] hold NaN or inf values"):
        lp.patch(fresh, "lolcats", checkpoint=str(tmp_path / "saved"), **KW)
    assert not lp.is_patched(fresh) and torch.equal(fresh.model.layers[0].self_attn.q_proj.weight, before)


def test_convert_lolcats_model_to_lola():
    from longctx_patch.methods.lola import LolaAttention

    model = tiny_model("llama")
    lp.patch(model, "lolcats", layers="0-1", **KW)
    with torch.no_grad():
        model.model.layers[1].self_attn.feature_map_k.mlp.layer.mul_(2.0)
        model.model.layers[0].self_attn.window_factors.fill_(1.3)
    x = _ids(1, 19, seed=9)
    with torch.no_grad():
        before = model(x, use_cache=False).logits
        lp.convert_to_lola(model, sparse_cache=0)
        assert isinstance(model.model.layers[1].self_attn, LolaAttention)
        assert lp.patched_layers(model) == {0: "lola", 1: "lola"}
        assert torch.equal(model(x, use_cache=False).logits, before)  # lambda = 0 is lolcats
        w = model.model.layers[1].self_attn.feature_map_k.mlp.layer.clone()
    lp.unpatch(model)
    lp.patch(model, "lolcats", layers="0-1", **KW)
    with torch.no_grad():
        model.model.layers[1].self_attn.feature_map_k.mlp.layer.copy_(w)
    lp.convert_to_lola(model, sparse_cache=3, window=4)
    attn = model.model.layers[1].self_attn
    assert attn.method_config.sparse_cache == 3 and attn.method_config.window == 4
    assert torch.equal(attn.feature_map_k.mlp.layer, w)
    with pytest.raises(NotPatchedError, match="patched with lolcats"):
        lp.convert_to_lola(tiny_model("llama"))


def test_lola_triton_two_pass_prefill_equals_torch_backend_through_a_model(monkeypatch):
    """Through a patched model (the path `generate()` and training evals take): the Triton backend's two-pass
    prefill against the torch backend's chunk loop, fp32, with a left-padded row. Layer 0 sees repeated
    tokens, i.e. equal values, while its linear state is still 0, so equal SRE scores occur (lambda holds two
    evictions' pairs before the first fold); a difference in tie-breaking or a state that is not exactly 0
    there shows up in the logits (both happened: 4e-2 relative before the fix)."""
    from longctx_patch.kernels.lola import prefill

    ids = _ids(2, 240, seed=3)
    am = torch.ones_like(ids)
    am[1, :37] = 0
    cfg = dict(window=32, feature_dim=8, sparse_cache=32, chunk=16)
    calls = []
    real = prefill.lola_parallel
    monkeypatch.setattr(prefill, "lola_parallel", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    logits = {}
    for backend in ("torch", "triton"):
        model = tiny_model("llama", num_hidden_layers=2)
        lp.patch(model, "lola", **cfg, backend=backend)
        with torch.no_grad():
            logits[backend] = model(ids, attention_mask=am, use_cache=False).logits
    # the two layers of the Triton model took the two-pass prefill, once per phase group (row 1's padding of 37
    # is no whole chunk: rows 0 and 1 run apart, each on its own eviction grid)
    assert len(calls) == 2 * 2
    m = am.bool()[:, :, None].expand_as(logits["torch"])
    torch.testing.assert_close(logits["triton"][m], logits["torch"][m], atol=1e-4, rtol=1e-4)
