"""Bad inputs to the Python API raise named errors whose message says what to do: damaged or malformed
checkpoints, bad `layers`/`method` arguments, models on the meta device. Sequences past the trained context warn."""

import json
import warnings

import numpy as np
import pytest
import torch

import longctx_patch as lp
from longctx_patch.checkpoint import PATCH_JSON, PATCH_WEIGHTS, read_patch_record
from longctx_patch.patcher import apply_patch_record, parse_layers

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


# ------------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_damaged_weights_file(saved, damage):
    path = saved / PATCH_WEIGHTS
    data = path.read_bytes()
    path.write_bytes({"truncated": data[:-7], "garbage": b"not a safetensors file at all" * 4, "empty": b""}[damage])
    with pytest.raises(lp.CheckpointError, match="cannot be read as safetensors.*truncated or corrupt"):
        lp.load_patched(saved)
    model = tiny_model()
    with pytest.raises(lp.CheckpointError, match="truncated or corrupt"):
        apply_patch_record(model, saved)
    assert not lp.is_patched(model)


@pytest.mark.parametrize("content,phrase", [
    ("[1, 2]", r"holds \[1, 2\], not the object save_patched\(\) writes"),
    ("null", r"holds null, not the object save_patched\(\) writes"),
    ('"ovq"', r"holds \"ovq\", not the object"),
    ("{not json", "not valid JSON"),
])
def test_record_that_is_not_an_object(saved, content, phrase):
    (saved / PATCH_JSON).write_text(content)
    with pytest.raises(lp.CheckpointError, match=phrase):
        lp.load_patched(saved)


def test_record_that_is_not_text(saved):
    (saved / PATCH_JSON).write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(lp.CheckpointError, match="not valid JSON"):
        read_patch_record(saved)


@pytest.mark.parametrize("changes,phrase", [
    ({"method": 123}, r"\"method\" of the record is 123, not a method name"),
    ({"method": None}, r"\"method\" of the record is None, not a method name"),
    ({"config": [1, 2]}, r"\"config\" of the record is \[1, 2\], not an object of method options"),
    ({"config": "beta=2"}, r"\"config\" of the record is 'beta=2', not an object"),
    ({"layers": "0-2"}, r"\"layers\" of the record is '0-2', not a non-empty list of 0-based layer indices"),
    ({"layers": 2}, r"\"layers\" of the record is 2, not a non-empty list"),
    ({"layers": [0.5]}, r"\"layers\" of the record is \[0.5\], not a non-empty list"),
    ({"layers": [True]}, r"\"layers\" of the record is \[True\], not a non-empty list"),
    ({"layers": []}, r"\"layers\" of the record is \[\], not a non-empty list"),
    ({"layers": None}, r"\"layers\" of the record is None"),
    ({"format": "1"}, r"\"format\" is '1', not a record format number"),
    ({"format": True}, r"\"format\" is True, not a record format number"),
    ({"format": 0}, r"\"format\" is 0, not a record format number"),
    ({"patches": []}, r"\"patches\" is \[\], not a non-empty list"),
    ({"patches": [{"method": "exact", "config": {}, "layers": [0]}, 5]}, r"patches\[1\] is int, not an object"),
    ({"patches": [{"method": "exact", "layers": [0]}]}, r"lacks config in patches\[0\]"),
])
def test_malformed_record(saved, changes, phrase):
    _edit_record(saved, **changes)
    with pytest.raises(lp.CheckpointError, match=phrase):
        lp.load_patched(saved)
    model = tiny_model()
    with pytest.raises(lp.CheckpointError, match=phrase):
        apply_patch_record(model, saved)
    assert not lp.is_patched(model)


def test_record_lacking_keys(saved):
    (saved / PATCH_JSON).write_text(json.dumps({"format": 1, "method": "ovq"}))
    with pytest.raises(lp.CheckpointError, match="lacks config/layers; write it again with save_patched"):
        lp.load_patched(saved)


def test_newer_record_format_is_refused_naming_the_release(saved):
    _edit_record(saved, format=999, version="7.2.0")
    with pytest.raises(lp.CheckpointError, match=r"written by longctx-patch 7.2.0 in record format 999; longctx-patch "
                                                 r"0.1.0 reads formats up to 1: upgrade longctx-patch to 7.2.0 or later"):
        lp.load_patched(saved)
    _edit_record(saved, format=2, version=None)
    with pytest.raises(lp.CheckpointError, match="a newer longctx-patch in record format 2.*upgrade longctx-patch to "
                                                 "the release that wrote it"):
        lp.load_patched(saved)


def test_current_format_and_a_record_without_format_still_load(saved):
    assert read_patch_record(saved) == [{"method": "ovq", "config": read_patch_record(saved)[0]["config"],
                                         "layers": [0, 2]}]
    rec = json.loads((saved / PATCH_JSON).read_text())
    assert rec["format"] == 1
    del rec["format"]
    (saved / PATCH_JSON).write_text(json.dumps(rec))
    assert lp.patched_layers(lp.load_patched(saved)) == {0: "ovq", 2: "ovq"}


@pytest.mark.parametrize("changes,phrase", [
    ({"method": "nope"}, "unknown method 'nope'"),
    ({"layers": [0, 7]}, r"out of range; this model has layers 0-2"),
    ({"config": {"bogus": 1}}, "unknown key.*bogus"),
])
def test_record_that_does_not_fit_the_model_or_the_methods(saved, changes, phrase):
    _edit_record(saved, **changes)
    with pytest.raises(lp.CheckpointError, match=f"{PATCH_JSON}: .*{phrase}"):
        lp.load_patched(saved)


def test_failed_hybrid_record_leaves_the_model_as_it_was(tmp_path):
    d = tmp_path / "rec"
    d.mkdir()
    (d / PATCH_JSON).write_text(json.dumps({"format": 1, "patches": [
        {"method": "exact", "config": {}, "layers": [0]},
        {"method": "sliding-window", "config": {"window": 4}, "layers": [9]}]}))
    model = tiny_model()
    with pytest.raises(lp.CheckpointError, match=r"\(patch 2 of 2\): layers: \[9\] out of range"):
        apply_patch_record(model, d)
    assert not lp.is_patched(model)
    assert type(model.model.layers[0].self_attn).__name__ == "LlamaAttention"
    # onto a model already patched elsewhere: only the record's own patches are undone
    lp.patch(model, "exact", layers=[2])
    with pytest.raises(lp.CheckpointError, match="patch 2 of 2"):
        apply_patch_record(model, d)
    assert lp.patched_layers(model) == {2: "exact"}


def test_hybrid_record_round_trip(tmp_path):
    model = tiny_model()
    lp.patch(model, "ovq", layers=[0])
    lp.patch(model, "sliding-window", layers=[1, 2], window=5)
    with torch.no_grad():
        model.model.layers[0].self_attn.ovq_log_beta.add_(0.25)
        ref = model(_ids(20)).logits
    lp.save_patched(model, tmp_path)
    assert [g["method"] for g in read_patch_record(tmp_path)] == ["ovq", "sliding-window"]
    loaded = lp.load_patched(tmp_path)
    assert lp.patched_layers(loaded) == {0: "ovq", 1: "sliding-window", 2: "sliding-window"}
    with torch.no_grad():
        assert torch.equal(loaded(_ids(20)).logits, ref)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_method_weights_are_refused(saved, value):
    from safetensors.torch import load_file, save_file

    sd = load_file(str(saved / PATCH_WEIGHTS))
    sd["layers.2.ovq_log_beta"][1] = value
    save_file(sd, str(saved / PATCH_WEIGHTS))
    with pytest.raises(lp.CheckpointError, match=r"\['layers.2.ovq_log_beta'\] hold NaN or inf values.*earlier "
                                                 "checkpoint"):
        lp.load_patched(saved)
    model = tiny_model()
    with pytest.raises(lp.CheckpointError, match="NaN or inf"):
        apply_patch_record(model, saved)
    assert not lp.is_patched(model)


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


# ------------------------------------------------------------------------------------------- trained context
def _context_warnings(record):
    return [w for w in record if issubclass(w.category, lp.LongctxWarning)]


def test_sequence_past_the_trained_context_warns_once_per_patch():
    assert issubclass(lp.LongctxWarning, UserWarning)
    model = tiny_model(max_position_embeddings=32)
    lp.patch(model, "sliding-window", window=8)
    with warnings.catch_warnings(record=True) as rec, torch.no_grad():
        warnings.simplefilter("always")
        model(_ids(32))  # exactly the trained context: no warning
        assert _context_warnings(rec) == []
        model(_ids(40))
        model(_ids(50))
    got = _context_warnings(rec)
    assert len(got) == 1, [str(w.message) for w in got]
    msg = str(got[0].message)
    assert "reaches 40 tokens (40 new after 0 cached)" in msg
    assert "trained context of 32 tokens" in msg and "method sliding-window" in msg
    assert "rotary extrapolation" in msg and "\n" not in msg
    assert got[0].filename == __file__  # points at the caller's forward, not at torch or the package

    lp.unpatch(model)  # a new patch warns again
    lp.patch(model, "exact", layers=[0])
    lp.patch(model, "sliding-window", layers=[1, 2], window=8)
    with pytest.warns(lp.LongctxWarning, match="methods exact, sliding-window run there"), torch.no_grad():
        model(_ids(33))


def test_generation_crossing_the_trained_context_warns_with_the_cached_length():
    model = tiny_model(max_position_embeddings=32)
    lp.patch(model, "exact")
    x = _ids(30)
    with warnings.catch_warnings(record=True) as rec, torch.no_grad():
        warnings.simplefilter("always")
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = _context_warnings(rec)
    assert len(got) == 1, [str(w.message) for w in got]
    assert "reaches 33 tokens (1 new after 32 cached)" in str(got[0].message)


def test_no_warning_within_the_trained_context(tiny_llama):
    lp.patch(tiny_llama, "exact")
    x = _ids(40)
    with warnings.catch_warnings():
        warnings.simplefilter("error", lp.LongctxWarning)
        with torch.no_grad():
            tiny_llama.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=3, do_sample=False,
                                pad_token_id=0)
            tiny_llama(inputs_embeds=tiny_llama.get_input_embeddings()(x))


def test_inputs_embeds_past_the_trained_context_warn():
    model = tiny_model(max_position_embeddings=16)
    lp.patch(model, "exact")
    with pytest.warns(lp.LongctxWarning, match=r"reaches 20 tokens \(20 new after 0 cached\)"), torch.no_grad():
        model(inputs_embeds=model.get_input_embeddings()(_ids(20)))


@pytest.mark.parametrize("bad", [None, 123, ["dir"]])
def test_directory_arguments_that_are_not_paths(bad, tiny_llama):
    from longctx_patch.errors import ConfigError, ModelLoadError

    with pytest.raises(ModelLoadError, match="load_patched: pass the directory"):
        lp.load_patched(bad)
    model = lp.patch(tiny_llama, "exact")
    with pytest.raises(ConfigError, match="save_patched: pass the directory"):
        lp.save_patched(model, bad)


# ------------------------------------------------------------------------------------------- option values
def _numeric_options():
    """(method, key, kind) of every int and float option of every registered method."""
    import dataclasses

    from longctx_patch.methods import get_method, list_methods
    from longctx_patch.methods.base import _base_type

    return [(name, f.name, _base_type(f)) for name in list_methods()
            for f in dataclasses.fields(get_method(name).config_cls) if _base_type(f) in (int, float)]


@pytest.mark.parametrize("method,key,kind", _numeric_options())
def test_non_finite_and_overflowing_option_values_are_refused(method, key, kind):
    """Every numeric option of every method refuses NaN and the infinities (as floats and as the strings the CLI
    passes), and an int option refuses a size past what the kernels' 32-bit offsets hold, naming the key, the allowed
    range and the value."""
    meth = lp.get_method(method)
    bad = [float("nan"), float("inf"), float("-inf"), "nan", "inf", "-Infinity"]
    if kind is int:
        bad += [10**20, -10**20, 2**31, "1e30"]
    for value in bad:
        with pytest.raises(lp.ConfigError, match=rf"{key}\b.*allowed: {kind.__name__}") as e:
            meth.parse_config({key: value})
        assert "\n" not in str(e.value)
        if isinstance(value, float) or value in ("nan", "inf"):
            assert "nan" in str(e.value) or "inf" in str(e.value), str(e.value)


def test_nan_beta_and_infinite_alpha_are_refused_by_patch(tiny_llama):
    with pytest.raises(lp.ConfigError, match=r"OVQConfig: beta=nan is not a finite number; allowed: float in 0.001..10000.0"):
        lp.patch(tiny_llama, "ovq", beta=float("nan"), qk_norm=True)
    with pytest.raises(lp.ConfigError, match=r"lora_alpha=inf is not a finite number; allowed: float in 0.0..10000.0"):
        lp.patch(tiny_llama, "lolcats", lora_alpha=float("inf"), checkpoint="none")
    assert not lp.is_patched(tiny_llama)


def test_a_window_past_the_kernels_offsets_is_refused_before_the_forward(tiny_llama):
    with pytest.raises(lp.ConfigError, match=r"SlidingWindowConfig: window=100000000000000000000 is too large; allowed: "
                                             r"int >= 1, at most 2147483647 \(2\*\*31 - 1"):
        lp.patch(tiny_llama, "sliding-window", window=10**20)
    assert not lp.is_patched(tiny_llama)
    lp.patch(tiny_llama, "sliding-window", window=2**31 - 1)  # the largest allowed is a working window
    with torch.no_grad():
        out = tiny_llama(_ids(9)).logits
    assert torch.isfinite(out).all()


# ------------------------------------------------------------------------------------------- generate()'s prompt
@pytest.fixture(scope="module")
def tiny_and_tokenizer():
    """A tiny llama with the embedded model's tokenizer (which has a chat template)."""
    tok = lp.models.load_tokenizer("smollm2-135m")
    return tiny_model("llama", vocab_size=len(tok)), tok


ACCEPTED = "pass a string, or a non-empty list of strings \\(a left-padded batch\\)"


@pytest.mark.parametrize("prompt,chat,phrase", [
    ("", False, f"generate: the prompt is empty; {ACCEPTED}"),
    ("", None, "generate: the prompt is empty"),
    (None, None, f"generate: prompt: got None \\(NoneType\\); {ACCEPTED}"),
    (123, None, f"generate: prompt: got 123 \\(int\\); {ACCEPTED}"),
    (b"hello", None, "generate: prompt: got b'hello' \\(bytes\\)"),
    ({"text": "hi"}, None, "got \\{'text': 'hi'\\} \\(dict\\)"),
    ([], None, f"generate: prompt: got an empty list; {ACCEPTED}"),
    (["hi", 3], None, f"generate: prompt 1 of the list is 3 \\(int\\), not a string; {ACCEPTED}"),
    (["hi", None], False, "prompt 1 of the list is None \\(NoneType\\)"),
    (["hi", ""], False, "generate: prompt 1 of the list is empty"),
    ([["hi"]], None, "prompt 0 of the list is \\['hi'\\] \\(list\\)"),
])
@pytest.mark.parametrize("patched", [False, True])
def test_generate_checks_its_prompt(tiny_and_tokenizer, prompt, chat, phrase, patched):
    model, tok = tiny_and_tokenizer
    if patched:
        lp.patch(model, "sliding-window", window=8)
    try:
        with pytest.raises(lp.ConfigError, match=phrase) as e:
            lp.generate(model, tok, prompt, chat=chat, max_new_tokens=2)
        assert "\n" not in str(e.value)
    finally:
        if patched:
            lp.unpatch(model)


def test_generate_refusals_of_its_options_are_named(tiny_and_tokenizer):
    from transformers import AutoTokenizer

    model, tok = tiny_and_tokenizer
    with pytest.raises(lp.ConfigError, match="stream=True takes a single prompt"):
        lp.generate(model, tok, ["a", "b"], stream=True)
    plain = AutoTokenizer.from_pretrained(lp.models._resolve_path("smollm2-135m"))
    plain.chat_template = None
    with pytest.raises(lp.ConfigError, match="chat=True but this tokenizer has no chat template"):
        lp.generate(model, plain, "hi", chat=True)


def test_generate_accepts_strings_and_lists_of_them(tiny_and_tokenizer):
    model, tok = tiny_and_tokenizer
    one = lp.generate(model, tok, "hi", chat=False, max_new_tokens=2)
    batch = lp.generate(model, tok, ["hi", "a longer prompt here"], chat=False, max_new_tokens=2)
    assert isinstance(one, str) and isinstance(batch, list) and len(batch) == 2 and batch[0] == one
    assert lp.generate(model, tok, ("hi",), chat=False, max_new_tokens=2) == [one]  # a tuple is a list
    assert isinstance(lp.generate(model, tok, " ", chat=False, max_new_tokens=2), str)  # a space is a prompt
