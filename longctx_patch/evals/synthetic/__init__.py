"""The synthetic long-context suite (`longctx eval icr`, `longctx eval icl`): small models trained from scratch,
one per sequence mixer, with the same budget, then compared on in-context recall / regression against their
decode-state bytes.

Layout (docs/synthetic.md):

* ``icr``, ``icl``: the tasks (generators, losses, metrics);
* ``attention``: the attention forms the mixers without a kernel of their own use, with their references;
* ``registry``: ``MIXERS``, ``register_mixer``, ``MixerConfig`` (a ``methods.base.MethodConfig``), ``MixerSpec`` and
  the parsing of mixer specs ``NAME(KEY=VALUE,...)``;
* ``mixers``: the mixer classes and their option dataclasses;
* ``model``: ``SyntheticLM`` and ``ModelConfig``;
* ``train``: ``TrainConfig``, ``train_one``, ``run_sweep``;
* ``report``: ``summarize``, ``tables``, ``plot``, ``write_report``.
"""

from __future__ import annotations

from .attention import causal_linear_attention, linear_attention_ref, vq_attention, vq_attention_ref
from .mixers import Mixer
from .model import ModelConfig, SyntheticLM
from .registry import DEFAULT_MIXERS, MIXERS, MixerConfig, MixerSpec, parse_mixer, parse_mixers, register_mixer
from .report import plot, summarize, tables, write_report
from .train import TrainConfig, evaluate, parse_curriculum, run_sweep, train_one

__all__ = ["MIXERS", "DEFAULT_MIXERS", "Mixer", "MixerConfig", "MixerSpec", "parse_mixer", "parse_mixers",
           "register_mixer", "SyntheticLM", "ModelConfig", "TrainConfig", "train_one", "run_sweep", "evaluate",
           "parse_curriculum", "summarize", "tables", "plot", "write_report", "causal_linear_attention",
           "linear_attention_ref", "vq_attention", "vq_attention_ref"]
