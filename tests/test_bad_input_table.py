"""The bad inputs of issue 61, one row each, and the named error each gets (the class and what its message says).

Each input was once accepted and then broke (NaN logits and an empty answer, a raw allocator or overflow error, a
hang), or failed with a raw error naming neither the input nor what to do. Tiny random models; every row runs in well
under a second.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import tiny_model

import longctx_patch as lp
from longctx_patch.errors import MemoryBudgetError, NumericalError

BIG = 2**31 - 1  # the largest int an option takes (methods.base.INT_OPTION_MAX)
FRESH = {"checkpoint": "none"}  # lolcats / lola without the packaged weights (a tiny model has none)


def _patch(method, **config):
    return lambda tmp_path: lp.patch(tiny_model(), method, **config)


@pytest.fixture(scope="module")
def tokenizer():
    return lp.models.load_tokenizer("smollm2-135m")


# ------------------------------------------------------------------------------------- options that passed, then broke
OPTIONS = [
    # (id, call, error, what the message says)
    ("lolcats linear_scale=1e300", _patch("lolcats", linear_scale=1e300, **FRESH), lp.ConfigError,
     r"LolcatsConfig: bad value 1e\+300 for linear_scale; allowed: float in 0.0..1000000.0"),
    ("lola linear_scale=1e300", _patch("lola", linear_scale=1e300, **FRESH), lp.ConfigError,
     r"LolaConfig: bad value 1e\+300 for linear_scale; allowed: float in 0.0..1000000.0"),
    ("ovq beta=1e39 qk_norm", _patch("ovq", beta=1e39, qk_norm=True), lp.ConfigError,
     r"OVQConfig: bad value 1e\+39 for beta; allowed: float in 0.001..10000.0"),
    ("lolcats init_window_factor=1e39", _patch("lolcats", init_window_factor=1e39, **FRESH), lp.ConfigError,
     r"bad value 1e\+39 for init_window_factor; allowed: float in -100.0..100.0"),
    ("lola init_window_factor=-1e39", _patch("lola", init_window_factor=-1e39, **FRESH), lp.ConfigError,
     r"bad value -1e\+39 for init_window_factor; allowed: float in -100.0..100.0"),
    ("lolcats feature_dim=100000", _patch("lolcats", feature_dim=100000, **FRESH), lp.ConfigError,
     r"bad value 100000 for feature_dim; allowed: int in 1..1024"),
    ("lolcats lora_alpha=1e300", _patch("lolcats", lora_alpha=1e300, **FRESH), lp.ConfigError,
     r"bad value 1e\+300 for lora_alpha; allowed: float in 0.0..10000.0"),
    ("lola window=2**31-1", _patch("lola", window=BIG, **FRESH), MemoryBudgetError,
     r"lola: the decode state of one sequence, allocated from its first token, would take [\d.]+ GiB over 3 layers, "
     r"more than the [\d.]+ [GM]iB available on cpu; at most window=\d+ \(now 2147483647\)"),
    ("lolcats window=2**31-1", _patch("lolcats", window=BIG, **FRESH), MemoryBudgetError, r"at most window=\d+"),
    ("lola chunk=2**31-1", _patch("lola", chunk=BIG, **FRESH), MemoryBudgetError, r"at most chunk=\d+"),
    ("lolcats chunk=2**31-1", _patch("lolcats", chunk=BIG, **FRESH), MemoryBudgetError, r"at most chunk=\d+"),
    ("lola sparse_cache=2**31-1", _patch("lola", sparse_cache=BIG, **FRESH), MemoryBudgetError,
     r"at most .*sparse_cache=\d+ \(now 2147483647\)"),
    ("ovq chunk_size=2**31-1", _patch("ovq", chunk_size=BIG), MemoryBudgetError, r"ovq: .*at most .*chunk_size=\d+"),
    ("ovq max_centroids=2**31-1", _patch("ovq", max_centroids=BIG), MemoryBudgetError,
     r"ovq: .*at most max_centroids=\d+ \(now 2147483647\)"),
    ("sliding-window window=b'7'", _patch("sliding-window", window=b"7"), lp.ConfigError,
     r"SlidingWindowConfig: window=b'7' is bytes, not a value; allowed: int >= 1"),
    ("lola window=bytearray", _patch("lola", window=bytearray(b"7"), **FRESH), lp.ConfigError, r"window=b'7' is bytes"),
    ("ovq backend=b'torch'", _patch("ovq", backend=b"torch"), lp.ConfigError, r"backend=b'torch' is bytes"),
]


@pytest.mark.parametrize("call,error,phrase", [c[1:] for c in OPTIONS], ids=[c[0] for c in OPTIONS])
def test_option_values_that_cannot_work_are_refused_by_name(call, error, phrase, tmp_path):
    with pytest.raises(error, match=phrase) as e:
        call(tmp_path)
    assert "\n" not in str(e.value)


def test_a_refused_state_leaves_the_model_unpatched():
    model = tiny_model()
    with pytest.raises(MemoryBudgetError):
        lp.patch(model, "ovq", max_centroids=BIG)
    assert not lp.is_patched(model)
    lp.patch(model, "exact", layers=[0])  # and onto a model patched elsewhere: the other layers count too
    with pytest.raises(MemoryBudgetError):
        lp.patch(model, "lola", layers=[1, 2], window=BIG, **FRESH)
    assert lp.patched_layers(model) == {0: "exact"}


@pytest.mark.parametrize("method,key,config", [
    ("lola", "window", dict(chunk=8, sparse_cache=4, **FRESH)),
    ("lola", "sparse_cache", dict(window=8, chunk=8, **FRESH)),
    ("ovq", "max_centroids", dict(chunk_size=16)),
])
def test_the_value_said_to_fit_fits(method, key, config, monkeypatch):
    """The refusal's "at most KEY=N fits" is exact: N patches on a device with that much memory, N + 1 does not."""
    from longctx_patch import patcher

    monkeypatch.setattr(patcher, "available_memory", lambda device: 8 * 2**20)  # 8 MiB left on the device
    with pytest.raises(MemoryBudgetError, match=rf"more than the 8.0 MiB available on cpu; at most .*{key}=(\d+)") as e:
        lp.patch(tiny_model(), method, **{key: BIG}, **config)
    n = int(re.search(rf"{key}=(\d+) \(now", str(e.value)).group(1))
    assert n > 1000
    lp.patch(tiny_model(), method, **{key: n}, **config)
    with pytest.raises(MemoryBudgetError):
        lp.patch(tiny_model(), method, **{key: n + 1}, **config)


def test_more_query_clusters_than_queries_run_as_one_per_query():
    """muse's q_clusters=2**31-1 (tilted-cells) once allocated 16 GiB at 20 tokens: clusters beyond the number of
    queries only repeat queries, which never win a member, so they are left out, and the output is that of as many
    clusters as queries."""
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    kw = dict(far_field="tilted-cells", block_size=8, k_clusters=2, min_seq_len=16, backend="torch")
    out = {}
    for qc in (40, BIG):
        model = lp.patch(tiny_model(), "muse", q_clusters=qc, **kw)
        with torch.no_grad():
            out[qc] = model(ids).logits
    assert torch.equal(out[BIG], out[40])


# ------------------------------------------------------------------------------------- generate()'s own arguments
GENERATE = [
    ("max_new_tokens=nan", dict(max_new_tokens=float("nan")), r"max_new_tokens=nan \(float\) is not a whole number"),
    ("max_new_tokens=0", dict(max_new_tokens=0), r"max_new_tokens=0 is out of range; pass an int in 1..2147483647"),
    ("max_new_tokens=-1", dict(max_new_tokens=-1), r"max_new_tokens=-1 is out of range"),
    ("max_new_tokens='5'", dict(max_new_tokens="5"), r"max_new_tokens='5' \(str\) is not a whole number"),
    ("max_new_tokens=True", dict(max_new_tokens=True), r"max_new_tokens=True \(bool\) is not a whole number"),
    ("max_new_tokens=2**40", dict(max_new_tokens=2**40), r"max_new_tokens=1099511627776 is out of range"),
    ("temperature=-1", dict(temperature=-1.0, do_sample=True), r"temperature=-1.0 \(float\) is not allowed; pass a "
                                                               r"finite number > 0"),
    ("top_p=nan", dict(top_p=float("nan"), do_sample=True), r"top_p=nan \(float\) is not allowed; pass a number in "
                                                            r"\(0, 1\]"),
    ("num_beams=0", dict(num_beams=0), r"num_beams=0 is out of range"),
    ("do_sample='yes'", dict(do_sample="yes"), r"do_sample='yes' \(str\) is not True or False"),
    ("stream=1", dict(stream=1), r"stream=1 \(int\) is not True or False"),
]


@pytest.mark.parametrize("kwargs,phrase", [c[1:] for c in GENERATE], ids=[c[0] for c in GENERATE])
def test_generate_refuses_its_bad_arguments_by_name(kwargs, phrase, tokenizer):
    model = lp.patch(tiny_model(vocab_size=len(tokenizer)), "sliding-window", window=8)
    with pytest.raises(lp.ConfigError, match=rf"^generate: {phrase}"):
        lp.generate(model, tokenizer, "hi", chat=False, **kwargs)


# ------------------------------------------------------------------------------------- a NaN after the prefill
@pytest.mark.parametrize("method,config,poison", [
    ("lolcats", dict(window=8, chunk=8, **FRESH), "window_factors"),
    ("ovq", dict(chunk_size=16, max_centroids=16, qk_norm=True), "ovq_log_beta"),
])
def test_non_finite_logits_after_the_prefill_raise_a_named_error(method, config, poison, tokenizer):
    """A patch whose numbers go wrong (here a parameter holding NaN, as a damaged or foreign checkpoint might) once
    answered with an empty string and exit code 0; now generate() says so, naming the method."""
    model = lp.patch(tiny_model(vocab_size=len(tokenizer)), method, **config)
    with torch.no_grad():
        getattr(model.model.layers[1].self_attn, poison).fill_(float("nan"))
    with pytest.raises(NumericalError, match=rf"generate: the logits after the prefill hold NaN or inf \(row 0 of the "
                                             rf"batch\).*patch: {method} on layers 0-2"):
        lp.generate(model, tokenizer, "hi", chat=False, max_new_tokens=3)
    ids = torch.randint(3, 128, (2, 12))
    with pytest.raises(NumericalError, match=r"rows 0, 1 of the batch"), torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0)


# ------------------------------------------------------------------------------------- records and their weights
@pytest.fixture(scope="module")
def saved_lola(tmp_path_factory, tokenizer):
    """A folder save_patched() wrote: lola (feature maps and window factors, the keys and shapes of lolcats')."""
    d = tmp_path_factory.mktemp("saved") / "lola"
    lp.save_patched(lp.patch(tiny_model(), "lola", window=8, chunk=8, sparse_cache=4, **FRESH), d, tokenizer=tokenizer)
    return d


def _edit_json(path, change):
    import json

    rec = json.loads(path.read_text())
    change(rec)
    path.write_text(json.dumps(rec))


def _renamed(d):  # lola -> lolcats, the lola-only options dropped: a record lolcats reads without complaint
    def change(rec):
        rec["method"] = "lolcats"
        rec["config"].pop("sparse_cache")
        rec["config"].pop("sparse_heads")
    _edit_json(d / "longctx_patch.json", change)


def _moved(d):  # the same method on other layers
    _edit_json(d / "longctx_patch.json", lambda rec: rec.update(layers=[0, 1]))


def _cut_without_files(d):
    _edit_json(d / "longctx_patch.json", lambda rec: rec.pop("files"))
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-1000])


def _grown(d):  # a whole header, its tensors whole, bytes added: only the recorded size tells
    with open(d / "model.safetensors", "ab") as f:
        f.write(b"\0" * 16)


def _garbage_weights_without_files(d):
    _edit_json(d / "longctx_patch.json", lambda rec: rec.pop("files"))
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")


RECORDS = [
    ("method renamed lola -> lolcats", _renamed, lp.CheckpointError,
     r"lola/longctx_patch.json says lolcats on layers 0-2, but \S+lola/longctx_patch.safetensors holds the weights of "
     r"lola on layers 0-2: the record was edited"),
    ("layers moved", _moved, lp.CheckpointError, r"says lola on layers 0-1, but .* holds the weights of lola on "
                                                 r"layers 0-2"),
    ("no files list, model.safetensors cut", _cut_without_files, lp.CheckpointError,
     r"lola is incomplete \(model.safetensors is cut short or corrupt \(\d+ bytes where its header says \d+\)\)"),
    ("recorded size differs", _grown, lp.CheckpointError,
     r"lola is incomplete \(model.safetensors is cut short or changed \(\d+ bytes, \d+ written\)\)"),
    ("no files list, model.safetensors garbage", _garbage_weights_without_files, lp.CheckpointError,
     r"model.safetensors is cut short or corrupt \(its header is not a safetensors header"),
]


@pytest.mark.parametrize("damage,error,phrase", [c[1:] for c in RECORDS], ids=[c[0] for c in RECORDS])
def test_a_record_that_does_not_match_its_files_is_refused_naming_them(saved_lola, damage, error, phrase, tmp_path):
    import shutil

    d = tmp_path / "lola"
    shutil.copytree(saved_lola, d)
    damage(d)
    for load in (lp.load_patched, lambda d: lp.load_model(str(d))):
        with pytest.raises(error, match=phrase) as e:
            load(d)
        assert "\n" not in str(e.value)


def test_a_plain_folder_with_a_cut_weights_file_names_it(saved_lola, tmp_path):
    import shutil

    d = tmp_path / "plain"
    shutil.copytree(saved_lola, d)
    (d / "longctx_patch.json").unlink()
    (d / "longctx_patch.safetensors").unlink()
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-1000])
    with pytest.raises(lp.ModelLoadError, match=rf"{d}/model.safetensors is cut short or corrupt \(\d+ bytes where "
                                                r"its header says \d+\)"):
        lp.load_model(str(d))


def test_records_edited_within_their_method_and_weights_without_the_method_still_load(saved_lola, tmp_path):
    """What the check leaves alone: a training-free option changed by hand (lola's sparse cache), and weights
    written without the metadata that says their method (before it existed)."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "lola"
    shutil.copytree(saved_lola, d)
    _edit_json(d / "longctx_patch.json", lambda rec: rec["config"].update(sparse_cache=6))
    assert lp.load_patched(d).model.layers[0].self_attn.sparse_cache == 6
    save_file(load_file(str(d / "longctx_patch.safetensors")), str(d / "longctx_patch.safetensors"))
    _edit_json(d / "longctx_patch.json", lambda rec: rec.pop("files"))  # the weights file has another size now
    assert lp.patched_layers(lp.load_patched(d)) == {0: "lola", 1: "lola", 2: "lola"}


# ------------------------------------------------------------------------------------- model files, recipes, saves
@pytest.mark.parametrize("content,phrase", [
    (b"hello", r"is not a GGUF model file \(5 bytes\)"),
    (b"\x81\x00" * 64, r"is not a GGUF model file \(it begins with b'\\x81\\x00\\x81\\x00', not b'GGUF'\)"),
    (b"GGUF\x03\x00\x00\x00" + b"\xff" * 16 + b"junk" * 10, r"cannot be read as a GGUF model \(error: unpack_from"),
], ids=["5 bytes", "not GGUF", "a GGUF header, then garbage"])
def test_a_garbage_gguf_is_named_and_leaves_no_lock(content, phrase, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("LONGCTX_CACHE", str(cache))
    f = tmp_path / "x.gguf"
    f.write_bytes(content)
    with pytest.raises(lp.ModelLoadError, match=rf"^{re.escape(str(f))} {phrase}"):
        lp.load_model(str(f))
    assert not cache.exists() or list(cache.iterdir()) == []  # no lock, no half-made folder


def test_a_binary_recipe_is_named(tmp_path):
    from longctx_patch.train import load_recipe

    f = tmp_path / "r.yaml"
    f.write_bytes(b"stages:\n  - \x81\x82 binary")
    with pytest.raises(lp.ConfigError, match=rf"recipe '{re.escape(str(f))}' is not text \(bytes that are not UTF-8 at "
                                             r"offset 12\); pass a YAML recipe"):
        load_recipe(f)


def test_save_patched_under_a_file_or_where_it_cannot_write_names_the_path(tmp_path, monkeypatch):
    from longctx_patch import checkpoint

    model = lp.patch(tiny_model(), "exact")
    (tmp_path / "notes.txt").write_text("x")
    target = tmp_path / "notes.txt" / "out"
    with pytest.raises(lp.ConfigError, match=rf"save_patched: {re.escape(str(target))} lies under "
                                             rf"{re.escape(str(tmp_path / 'notes.txt'))}, which is a file, not a folder"):
        lp.save_patched(model, target)

    def denied(*args, **kwargs):  # what a read-only folder answers (the tests may run as root, whom chmod lets by)
        raise PermissionError(13, "Permission denied", kwargs.get("dir"))

    monkeypatch.setattr(checkpoint.tempfile, "mkdtemp", denied)
    with pytest.raises(lp.CheckpointError, match=rf"save_patched: could not write {re.escape(str(tmp_path / 'out'))} "
                                                 r"\(Permission denied\); no \S+ was made$") as e:
        lp.save_patched(model, tmp_path / "out")
    assert ".partial-" not in str(e.value)  # the user's path, not the staging folder's
    monkeypatch.setattr(checkpoint.os, "access", lambda path, mode: False)
    with pytest.raises(lp.ConfigError, match=rf"cannot write {re.escape(str(tmp_path / 'out'))}: {re.escape(str(tmp_path))} "
                                             r"is not writable \(permission denied\)"):
        lp.save_patched(model, tmp_path / "out")


# ------------------------------------------------------------------------------------- assisted decoding
@pytest.mark.parametrize("method,config,why", [
    ("lola", dict(window=8, chunk=8, sparse_cache=4, **FRESH), "its linear state sums every token older than the "
                                                               "window"),
    ("lolcats", dict(window=8, chunk=8, **FRESH), "its linear state sums"),
    ("ovq", dict(chunk_size=16, max_centroids=16), "its dictionaries absorb every chunk"),
    ("moba", dict(block_size=8, top_k=2, gating="block"), "with gating='block' it holds the sum of the current "
                                                          "block's queries"),
])
@pytest.mark.parametrize("how", ["prompt lookup", "assistant model"])
def test_assisted_decoding_with_a_cache_that_cannot_crop_names_the_method(method, config, why, how):
    model = lp.patch(tiny_model(), method, **config)
    kw = dict(prompt_lookup_num_tokens=3) if how == "prompt lookup" else dict(assistant_model=tiny_model(seed=1))
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    with pytest.raises(lp.ConfigError, match=rf"generate: assisted decoding .* takes drafted tokens back out of the "
                                             rf"cache, which this patch's cache cannot do \({method} on layers 0-2: "
                                             rf"{re.escape(why)}"), torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, **kw)


@pytest.mark.parametrize("method,config", [("sliding-window", dict(window=8)), ("exact", {}),
                                           ("moba", dict(block_size=8, top_k=2, gating="token"))])
def test_assisted_decoding_where_the_cache_can_crop_gives_the_greedy_tokens(method, config):
    """The K/V buffers (a window's ring included) take drafted tokens back: assisted decoding runs, and greedy
    decoding's tokens come out."""
    model = lp.patch(tiny_model(), method, **config)
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=3, **gen), model.generate(ids, **gen))


# ------------------------------------------------------------------------------------- the command line's exit codes
def _binary(path):
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00" + bytes(range(256)) * 4)
    return str(path)


def _under_a_file(path):
    (path / "notes.txt").write_text("x")
    return str(path / "notes.txt" / "out")


EXITS = [
    # (id, argv given tmp_path, exit code, what the one error line says): 2 = the command line is wrong (found
    # before any model loads or any training starts), 1 = the run failed (README.md, "Command line")
    ("generate, binary --prompt-file", lambda t: ["generate", "--prompt-file", _binary(t / "p.txt")], 2, "is not text"),
    ("eval ppl, binary --text", lambda t: ["eval", "ppl", "--text", _binary(t / "p.txt")], 2, "is not text"),
    ("eval niah, binary --haystack", lambda t: ["eval", "niah", "--haystack", _binary(t / "p.txt")], 2, "is not text"),
    ("finetune, binary --text", lambda t: ["finetune", "recipes/linearize.yaml", "--text", _binary(t / "p.txt")], 2,
     "--text .* is not text"),
    ("calibrate, binary --text", lambda t: ["calibrate", "--text", _binary(t / "p.txt")], 2, "is not text"),
    ("eval ppl, missing --text", lambda t: ["eval", "ppl", "--text", str(t / "none.txt")], 2,
     "no such file or directory"),
    ("finetune, missing --text", lambda t: ["finetune", "recipes/linearize.yaml", "--text", str(t / "none.txt")], 2,
     "does not exist"),
    ("calibrate, missing --text", lambda t: ["calibrate", "--text", str(t / "none.txt")], 2, "does not exist"),
    ("generate, missing --prompt-file", lambda t: ["generate", "--prompt-file", str(t / "none.txt")], 2,
     "does not exist"),
    ("finetune, binary recipe", lambda t: ["finetune", _binary(t / "r.yaml")], 2, "recipe .* is not text"),
    ("finetune, missing recipe", lambda t: ["finetune", str(t / "r.yaml")], 2, "recipe file .* not found"),
    ("generate, unknown method", lambda t: ["generate", "--method", "nope", "--prompt", "hi"], 2,
     "unknown method 'nope'"),
    ("patch, bad --set value", lambda t: ["patch", "--method", "sliding-window", "--set", "window=b7"], 2,
     "bad value 'b7' for window"),
    ("patch, option past its range", lambda t: ["patch", "--method", "lolcats", "--set", "linear_scale=1e300"], 2,
     "allowed: float in 0.0..1000000.0"),
    ("patch, --output under a file", lambda t: ["patch", "--method", "exact", "--output", _under_a_file(t)], 2,
     "which is a file, not a folder"),
    ("generate, garbage .gguf", lambda t: ["generate", "--model", _binary(t / "m.gguf"), "--prompt", "hi"], 1,
     r"m.gguf is not a GGUF model file"),
    ("generate, a missing model", lambda t: ["generate", "--model", str(t / "none"), "--prompt", "hi"], 1,
     "no such directory or file"),
]


@pytest.mark.parametrize("argv,code,phrase", [c[1:] for c in EXITS], ids=[c[0] for c in EXITS])
def test_the_command_line_exit_codes(argv, code, phrase, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from longctx_patch.cli.main import main

    monkeypatch.setenv("LONGCTX_CACHE", str(tmp_path / "cache"))
    args = argv(tmp_path)
    if "--model" not in args:  # a model that does not exist: a command-line fault is found before it would load
        args += ["--model", str(tmp_path / "no-model")]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == code, r.output
    errors = [line for line in r.output.splitlines() if line.startswith(("error:", "Error:"))]
    assert len(errors) == 1 and re.search(phrase, errors[0]), r.output
    assert "Traceback" not in r.output
    if code == 2:
        assert "loading" not in r.output, r.output


def test_a_record_that_does_not_match_its_weights_fails_the_run(saved_lola, tmp_path):
    """A saved model is loaded before its record is checked against the weights: the run's failure, exit 1."""
    import shutil

    from click.testing import CliRunner

    from longctx_patch.cli.main import main

    d = tmp_path / "lola"
    shutil.copytree(saved_lola, d)
    _renamed(d)
    r = CliRunner().invoke(main, ["generate", "--model", str(d), "--prompt", "hi", "--max-new-tokens", "2"])
    assert r.exit_code == 1 and f"{d}/longctx_patch.json says lolcats on layers 0-2" in r.output, r.output
