"""Bad inputs to the Python API raise named errors whose message says what to do: damaged or malformed
checkpoints, bad `layers`/`method` arguments, models on the meta device. Sequences past the trained context warn."""

import json
import warnings

import numpy as np
import pytest
import torch

import longctx_patch as lp
from longctx_patch.patcher import PATCH_JSON, PATCH_WEIGHTS, apply_patch_record, parse_layers, read_patch_record

from conftest import tiny_config, tiny_model

FORMS = r"allowed: None \(all layers\), an int, a list of ints, or a string like '0-7,12'"


def _ids(length, batch=1, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=g)


@pytest.fixture
def saved(tmp_path):
    """A directory save_patched() wrote: ovq (one parameter per layer) on layers 0 and 2."""
    model = tiny_model()
    lp.patch(model, "ovq", layers=[0, 2])
    lp.save_patched(model, tmp_path)
    return tmp_path


def _edit_record(directory, **changes):
    path = directory / PATCH_JSON
    rec = json.loads(path.read_text())
    rec.update(changes)
    path.write_text(json.dumps(rec))


# ------------------------------------------------------------------------------------------- patch() arguments
@pytest.mark.parametrize("layers", [1.5, 1.0, {"a": 1}, {0: 1}, True, False, [0.7], [True], [0, "1"], [[0]],
                                    b"0-1", object(), torch.tensor([0, 1])])
def test_bad_layers_name_the_allowed_forms(tiny_llama, layers):
    with pytest.raises(lp.ConfigError, match=f"layers: got .*; {FORMS}"):
        lp.patch(tiny_llama, "exact", layers=layers)
    assert not lp.is_patched(tiny_llama)


def test_bad_layer_strings(tiny_llama):
    with pytest.raises(lp.ConfigError, match=f"cannot read '1.5'; {FORMS}"):
        lp.patch(tiny_llama, "exact", layers="0,1.5")
    with pytest.raises(lp.ConfigError, match="'2-1' is a reversed range; write it as '1-2'"):
        lp.patch(tiny_llama, "exact", layers="2-1")
    assert not lp.is_patched(tiny_llama)


def test_good_layer_forms():
    assert parse_layers(2, 4) == [2]
    assert parse_layers(-1, 4) == [3]
    assert parse_layers([0, -1], 4) == [0, 3]
    assert parse_layers((1, 2), 4) == [1, 2]
    assert parse_layers(range(2), 4) == [0, 1]
    assert parse_layers(np.int64(1), 4) == [1]
    assert parse_layers([np.int32(-2)], 4) == [2]
    assert parse_layers("0-1, 3", 4) == [0, 1, 3]
    assert parse_layers("-1", 4) == [3]
    assert parse_layers(None, 2) == [0, 1]


@pytest.mark.parametrize("method", [None, 3, ["exact"]])
def test_method_that_is_not_a_name(tiny_llama, method):
    with pytest.raises(lp.ConfigError, match=r"method: got .*; pass a method name, one of .*exact.*sliding-window"):
        lp.patch(tiny_llama, method)
    assert not lp.is_patched(tiny_llama)


# ------------------------------------------------------------------------------------------- meta device
def _meta_model():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config()).eval()


@pytest.mark.parametrize("method,config,names", [
    ("ovq", {}, "ovq_log_beta"),
    ("lolcats", {"checkpoint": "none", "window": 4, "chunk": 4}, "feature_map_k.mlp.layer, feature_map_q.mlp.layer, "
                                                                 "window_factors"),
])
def test_method_with_parameters_refuses_a_meta_model(method, config, names):
    model = _meta_model()
    with pytest.raises(lp.DeviceError, match=rf"layer 0's attention weights are on the meta device.*{method}'s own "
                                             rf"parameters \({names}\).*materialise the model first"):
        lp.patch(model, method, **config)
    assert not lp.is_patched(model)
    assert type(model.model.layers[0].self_attn).__name__ == "LlamaAttention"


def test_meta_refusal_keeps_an_existing_patch_and_applies_to_records(saved):
    model = _meta_model()
    lp.patch(model, "exact", layers=[1])
    with pytest.raises(lp.DeviceError, match="meta device"):
        lp.patch(model, "ovq", layers=[0, 2])
    assert lp.patched_layers(model) == {1: "exact"}
    with pytest.raises(lp.DeviceError, match="meta device"):
        apply_patch_record(_meta_model(), saved)


def test_parameter_free_method_on_a_meta_model_then_materialised():
    """exact has no parameters of its own: a meta model can be patched, then materialised and loaded."""
    real = tiny_model()
    model = _meta_model()
    lp.patch(model, "exact")
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.is_meta and attn.method_parameters() == {}
    model.to_empty(device="cpu")
    model.load_state_dict(real.state_dict())
    buffers = dict(real.named_buffers())  # non-persistent (rotary inv_freq): not in the state dict
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name])
    lp.patch(real, "exact")
    x = _ids(17, batch=2)
    with torch.no_grad():
        assert torch.equal(model(x).logits, real(x).logits)
    assert lp.patched_layers(model) == {0: "exact", 1: "exact", 2: "exact"}
