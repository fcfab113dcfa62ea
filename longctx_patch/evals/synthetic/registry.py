"""The mixer registry and mixer specs.

A mixer registers itself with ``@register_mixer``; its options are a ``MixerConfig`` dataclass of ``option(...)``
fields, validated as the methods' configs are (``methods.base.MethodConfig``: unknown keys and bad values are a
``ConfigError`` naming the allowed ones). On the command line a mixer is ``NAME`` or ``NAME(KEY=VALUE,...)``, the
methods' ``--method`` syntax (``methods.split_method_spec``), e.g. ``ovq(max_centroids=128,growth=64)``; the old
``NAME:KEY=VALUE,...`` form is still read, with a ``FutureWarning``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from ...errors import ConfigError
from ...methods import split_method_spec
from ...methods.base import MethodConfig

if TYPE_CHECKING:
    from .mixers import Mixer

EXAMPLE = "ovq(max_centroids=128,growth=64)"


@dataclass
class MixerConfig(MethodConfig):
    """Base of every mixer's options: dataclass fields made with ``option(...)``."""


MIXERS: dict[str, type["Mixer"]] = {}
DEFAULT_MIXERS = ("softmax", "sliding", "linear", "hedgehog", "vq", "ovq", "lolcats", "lola")


def register_mixer(cls: type["Mixer"]) -> type["Mixer"]:
    if not cls.name or not (isinstance(cls.config_cls, type) and issubclass(cls.config_cls, MixerConfig)):
        raise ValueError(f"{cls.__name__} needs a name and a MixerConfig subclass as config_cls")
    MIXERS[cls.name] = cls
    return cls


def mixer_class(name: str) -> type["Mixer"]:
    if name not in MIXERS:
        raise ConfigError(f"unknown mixer {name!r}; choose from: {', '.join(MIXERS)}")
    return MIXERS[name]


@dataclass(frozen=True)
class MixerSpec:
    """A mixer by name and the options given explicitly, validated and typed on construction (the others keep
    their defaults). ``label`` (``NAME`` or ``NAME(KEY=VALUE,...)``) names its runs in the results."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        name = str(self.name).strip().lower()
        keys = [k for k, _ in self.options]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise ConfigError(f"mixer {name!r}: {', '.join(twice)} given twice")
        cfg = _config(mixer_class(name), dict(self.options), name)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "options", tuple((k, getattr(cfg, k)) for k in keys))

    @property
    def config(self) -> MixerConfig:
        """Every option of the mixer: the defaults and those given."""
        return _config(MIXERS[self.name], dict(self.options), self.name)

    @property
    def label(self) -> str:
        if not self.options:
            return self.name
        return self.name + "(" + ",".join(f"{k}={v}" for k, v in self.options) + ")"

    def build(self, d_model: int, n_heads: int) -> "Mixer":
        return MIXERS[self.name](d_model, n_heads, self.config)


def _config(cls: type["Mixer"], values: dict[str, Any], name: str) -> MixerConfig:
    try:
        return cls.config_cls.from_dict(values)
    except ConfigError as e:
        raise ConfigError(f"mixer {name!r}: {e}") from None


def parse_mixer(text: str) -> MixerSpec:
    """``"ovq"`` or ``"ovq(max_centroids=128,growth=64)"`` -> :class:`MixerSpec` (values typed and checked by the
    mixer's config). The old form ``"ovq:max_centroids=128,growth=64"`` gives the same spec and a FutureWarning."""
    raw = str(text).strip()
    if ":" in raw and "(" not in raw:
        name, _, rest = raw.partition(":")
        items = [s.strip() for s in rest.split(",") if s.strip()]
        new = name.strip() + (f"({','.join(items)})" if items else "")
        warnings.warn(f"mixer {raw!r}: the NAME:KEY=VALUE form is deprecated and will be removed; write {new!r} "
                      f"(NAME(KEY=VALUE,...), as --method takes)", FutureWarning, stacklevel=2)
    else:
        try:
            name, items = split_method_spec(raw)
        except ConfigError:
            raise ConfigError(f"bad mixer {raw!r}: write NAME or NAME(KEY=VALUE,...), e.g. {EXAMPLE!r}") from None
    opts = []
    for item in items:
        key, eq, val = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"bad mixer {raw!r}: {item!r} is not KEY=VALUE; write NAME or NAME(KEY=VALUE,...), "
                              f"e.g. {EXAMPLE!r}")
        opts.append((key.strip(), val.strip()))
    return MixerSpec(name, tuple(opts))


def split_mixer_list(text: str) -> list[str]:
    """``"softmax,ovq(max_centroids=128,growth=64)"`` -> ``["softmax", "ovq(max_centroids=128,growth=64)"]``: commas
    separate mixers outside parentheses, and in the old form also unless they continue an option list
    (``"softmax,ovq:max_centroids=128,growth=64"`` is two mixers)."""
    pieces, depth, cur = [], 0, []
    for ch in str(text):
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth <= 0:
            pieces.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    pieces.append("".join(cur))
    parts: list[str] = []
    for piece in (p.strip() for p in pieces):
        if not piece:
            continue
        old_options = parts and ":" in parts[-1] and "(" not in parts[-1]
        if old_options and "=" in piece and ":" not in piece and "(" not in piece:
            parts[-1] += "," + piece
        else:
            parts.append(piece)
    return parts


def parse_mixers(items: str | Sequence[str]) -> list[MixerSpec]:
    """Comma-separated mixer specs (a string or several) -> specs; a mixer given twice is an error."""
    if isinstance(items, str):
        items = [items]
    out = [parse_mixer(p) for it in items for p in split_mixer_list(it)]
    labels = [s.label for s in out]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"a mixer is given twice: {', '.join(labels)}")
    if not out:
        raise ConfigError(f"no mixer given; choose from: {', '.join(MIXERS)}")
    return out


__all__ = ["MIXERS", "DEFAULT_MIXERS", "MixerConfig", "MixerSpec", "mixer_class", "parse_mixer", "parse_mixers",
           "register_mixer", "split_mixer_list"]
