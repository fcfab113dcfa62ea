"""The synthetic long-context suite (`longctx eval icr`, `longctx eval icl`): small models trained from scratch,
one per sequence mixer, with the same budget, then compared on in-context recall / regression against their
decode-state bytes.

Layout (docs/synthetic.md):

* ``icr``, ``icl``: the tasks (generators, losses, metrics);
* ``attention``: the attention forms the mixers without a kernel of their own use, with their references;
* ``mixers``: the mixer classes, ``MIXERS`` and ``DEFAULT_MIXERS``;
* ``registry``: ``MixerSpec`` and the parsing of mixer specs;
* ``model``: ``SyntheticLM`` and ``ModelConfig``;
* ``train``: ``TrainConfig``, ``train_one``, ``run_sweep``;
* ``report``: ``summarize``, ``tables``, ``plot``, ``write_report``.
"""

from __future__ import annotations

from .attention import causal_linear_attention, linear_attention_ref, vq_attention, vq_attention_ref
from .mixers import DEFAULT_MIXERS, MIXERS, Mixer
from .model import ModelConfig, SyntheticLM
from .registry import MixerSpec, parse_mixer, parse_mixers
from .report import plot, summarize, tables, write_report
from .train import TrainConfig, evaluate, parse_curriculum, run_sweep, train_one

__all__ = ["MIXERS", "DEFAULT_MIXERS", "Mixer", "MixerSpec", "parse_mixer", "parse_mixers", "SyntheticLM",
           "ModelConfig", "TrainConfig", "train_one", "run_sweep", "evaluate", "parse_curriculum", "summarize",
           "tables", "plot", "write_report", "causal_linear_attention", "linear_attention_ref", "vq_attention",
           "vq_attention_ref"]
