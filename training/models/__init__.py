"""The trainer's models, by architecture name.

=============  ==========================================  ===========================
architecture   module                                      feature converters (cache features)
=============  ==========================================  ===========================
``decoder``    ``seqcache.training.models.decoder``        ``lm`` (targets),
                                                           ``prefix_lm`` (inputs, targets)
``t5``         ``seqcache.training.models.t5``             ``encdec`` (inputs, targets)
=============  ==========================================  ===========================

``ModelConfig.architecture`` names the entry. Every model module defines
``MODEL``, an ``nnx.Module`` class built as ``MODEL(cfg, rngs=rngs)`` whose
parameters carry logical axis names, with a method ``batch_logits(batch, *,
dropout_key)`` that returns ``(logits, targets, loss_weights)`` for a batch of the
converter's fields (see ``seqcache.training.step.batch_fields``). The functions
shared by all models (initialisation, abstract shapes, logical axes) are in
``seqcache.training.models.common``.

A third model: write its module, then add an ``Architecture`` to ``ARCHITECTURES``.

This module imports no JAX until a model is asked for, so that
``seqcache.training.config`` can validate architecture names without it.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Iterable


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One model family: the import path of the module defining ``MODEL``, and
    its converters (``seqcache.feeders.converters`` names; "lm" reads the
    feeder's own ``targets`` fields) with the cache features each reads."""

    module: str
    converters: tuple[tuple[str, tuple[str, ...]], ...]


ARCHITECTURES: dict[str, Architecture] = {
    "decoder": Architecture(
        module="seqcache.training.models.decoder",
        converters=(("prefix_lm", ("inputs", "targets")), ("lm", ("targets",))),
    ),
    "t5": Architecture(module="seqcache.training.models.t5", converters=(("encdec", ("inputs", "targets")),)),
}


class ModelDataMismatch(ValueError):
    """A model cannot read a cache (the message names both and what is missing)."""


def architecture(name: str) -> Architecture:
    """The registry entry ``name``.

    Raises:
      KeyError: an unknown name (the message lists the known ones).
    """
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise KeyError(f"unknown model architecture {name!r}; architectures: {sorted(ARCHITECTURES)}") from None


def model_class(name: str):
    """The ``MODEL`` class of architecture ``name`` (imports its module)."""
    return importlib.import_module(architecture(name).module).MODEL


def default_converter(name: str) -> str:
    """The converter of architecture ``name`` when no cache says otherwise: the
    one reading the fewest features (``lm`` for the decoder, ``encdec`` for t5)."""
    return min(architecture(name).converters, key=lambda c: len(c[1]))[0]


def converter_for(name: str, features: Iterable[str], *, cache: str, model: str | None = None) -> str:
    """The converter that feeds architecture ``name`` from a cache with
    ``features``: of those whose features the cache has, the one reading the
    most (a decoder reads an (inputs, targets) cache as a prefix LM, a
    targets-only cache as an LM). ``cache`` and ``model`` (default ``name``)
    label the message.

    Raises:
      ModelDataMismatch: no converter fits; names the cache, its features, the
        model and what it reads.
    """
    have = set(features)
    fits = [(conv, needs) for conv, needs in architecture(name).converters if set(needs) <= have]
    if fits:
        return max(fits, key=lambda c: len(c[1]))[0]
    needs = " or ".join("(" + ", ".join(n) + ")" for _, n in architecture(name).converters)
    hint = (" a single-feature language-model cache needs a decoder-only model (e.g. --model tiny); an "
            "encoder-decoder model needs a cache with inputs and targets (span corruption, translation)")
    raise ModelDataMismatch(
        f"{cache}: the cache has features {sorted(have)}, but model {model or name!r} (architecture {name!r}) "
        f"reads features {needs};{hint}")
