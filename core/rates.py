"""Mixing rates: the one ``Rate`` type and the one ``rate_num_examples``.

A mixing rate is what a mixture gives each task: a number >= 0, or a callable of
the task's number of examples (cached examples, an int) returning such a number.
Rates are relative; the feeder turns them into exact integer weights
(``seqcache.feeders.mixing.integer_weights``).

``seqcache.tasks.Mixture`` (task definitions) and ``seqcache.feeders.Feeder``
(``mixture={cache: rate}``) both take these rates, so they live here, in a module
that imports nothing else of seqcache: neither area depends on the other for them.
"""

from __future__ import annotations

from typing import Callable, Union

Rate = Union[float, int, Callable[[int], float]]
"""A constant rate (a number >= 0) or ``num_examples -> rate``."""


class RateNumExamples:
    """Rate proportional to a task's example count (seqio's ``mixing_rate_num_examples``).

    ``rate(n) = min(n * scale, maximum) ** (1 / temperature)`` for a task of n
    examples; with ``maximum`` None there is no cap. Temperature > 1 flattens the
    mixture towards uniform (T5, Raffel et al. 2020, section 3.5.2; mT5 uses the
    related ``alpha = 1 / temperature``).

    A task with no examples (n == 0) has rate 0.0: it is part of the mixture but
    never read. A negative n is not an example count and raises ValueError.

    Args (keyword-only):
      maximum: the cap on ``n * scale`` (examples), > 0, or None.
      temperature: > 0.
      scale: > 0, multiplies the example count before the cap.

    Raises:
      ValueError: temperature, scale or maximum <= 0 (at construction); a
        negative example count (at call).
    """

    def __init__(self, *, maximum: float | None = None, temperature: float = 1.0, scale: float = 1.0):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 (got {temperature=})")
        if not scale > 0:
            raise ValueError(f"scale must be > 0 (got {scale=})")
        if maximum is not None and not maximum > 0:
            raise ValueError(f"maximum must be > 0 or None (got {maximum=})")
        self.maximum = maximum
        self.temperature = float(temperature)
        self.scale = float(scale)

    def __call__(self, num_examples: int) -> float:
        if num_examples < 0:
            raise ValueError(f"rate_num_examples: the number of examples must be >= 0 (got {num_examples!r})")
        n = float(num_examples) * self.scale
        if self.maximum is not None:
            n = min(n, float(self.maximum))
        if n == 0:
            return 0.0
        return n ** (1.0 / self.temperature)

    def params(self) -> dict:
        """{"maximum", "temperature", "scale"}: what identifies this rate (fingerprints)."""
        return {"maximum": self.maximum, "temperature": self.temperature, "scale": self.scale}

    def __eq__(self, other) -> bool:
        return isinstance(other, RateNumExamples) and self.params() == other.params()

    def __hash__(self) -> int:
        return hash(tuple(self.params().items()))

    def __repr__(self) -> str:
        return f"rate_num_examples(maximum={self.maximum}, temperature={self.temperature}, scale={self.scale})"


def rate_num_examples(*, maximum: float | None = None, temperature: float = 1.0,
                      scale: float = 1.0) -> RateNumExamples:
    """A rate callable: ``min(n * scale, maximum) ** (1 / temperature)`` for a task
    of n examples (0.0 for n == 0); see ``RateNumExamples``.

    Use it in ``seqcache.tasks.Mixture(..., [(task, rate_num_examples(...))])`` or
    ``Feeder(mixture={cache: rate_num_examples(...)})``: the feeder calls it with
    the cache's example count.

    Raises:
      ValueError: temperature, scale or maximum <= 0.
    """
    return RateNumExamples(maximum=maximum, temperature=temperature, scale=scale)
