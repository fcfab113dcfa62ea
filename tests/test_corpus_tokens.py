"""The corpus builder's token counts (benchmarks/data/tokens.py) are those `longctx finetune --text` trains on:
the same ids as the trainer's tokenisation of each document, less the EOS it appends."""

from __future__ import annotations

import pytest

from benchmarks.data.tokens import Counter, tokenizer_json
from longctx_patch.errors import ConfigError
from longctx_patch.train.data import tokenize_documents


def bpe_tokenizer(folder):
    """A small byte-level BPE tokenizer (trained here on a few lines) saved as tokenizer.json, with an EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["def add(x, y):\n    return x + y\n", "The quick brown fox jumps over the lazy dog.\n" * 3,
            "class Graph:\n    def __init__(self):\n        self.nodes = {}\n"]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|eos|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_counts_are_the_trainers_ids_without_eos(tmp_path):
    from transformers import PreTrainedTokenizerFast

    folder = bpe_tokenizer(tmp_path / "tok")
    docs = ["def add(x, y):\n    return x + y\n" * 40, "The lazy dog sleeps.\n\nA fox, quick and brown.\n",
            "caf\u00e9 \u00fcber na\u00efve \u2014 \u4e2d\u6587\n", "class Graph:\n    pass\n"]
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|eos|>")
    ids = tokenize_documents(docs, hf, add_eos=True)
    c = Counter(folder, batch=3)  # batches of 3: the last batch is partial
    counts = c.counts(docs)
    assert ids.numel() == sum(counts) + len(docs)
    pos = 0
    for d, n in zip(docs, counts):
        assert ids[pos : pos + n].tolist() == c.ids(d)
        assert ids[pos + n].item() == hf.eos_token_id
        pos += n + 1
    assert [c.count(d) for d in docs] == counts


def test_tokenizer_path_forms(tmp_path):
    folder = bpe_tokenizer(tmp_path / "tok")
    assert tokenizer_json(folder) == folder / "tokenizer.json"
    assert tokenizer_json(folder / "tokenizer.json") == folder / "tokenizer.json"
    with pytest.raises(ConfigError, match="tokenizer.json"):
        tokenizer_json(tmp_path / "missing")
