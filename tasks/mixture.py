"""Mixtures: tasks with mixing rates (seqio's ``Mixture``).

A mixture names tasks and their rates. A rate is a constant or a callable of the
task's number of cached examples (``rate_num_examples``). Rates are relative:
``get_rates`` returns them unnormalised; the feeder normalises and mixes. Changing
rates needs no rebuild of the task caches.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

from seqcache.tasks.task import Task, check_name

Rate = float | Callable[[int], float]


class RateNumExamples:
    """Rate proportional to a task's example count (seqio's ``mixing_rate_num_examples``).

    ``rate(n) = min(n * scale, maximum) ** (1 / temperature)``; with ``maximum``
    None there is no cap. Temperature > 1 flattens the mixture towards uniform
    (as in T5, Raffel et al. 2020, section 3.5.2; mT5 uses the related
    ``alpha = 1 / temperature``).
    """

    def __init__(self, *, maximum: float | None = None, temperature: float = 1.0, scale: float = 1.0):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (got {temperature=})")
        if scale <= 0:
            raise ValueError(f"scale must be > 0 (got {scale=})")
        if maximum is not None and maximum <= 0:
            raise ValueError(f"maximum must be > 0 or None (got {maximum=})")
        self.maximum = maximum
        self.temperature = float(temperature)
        self.scale = float(scale)

    def __call__(self, num_examples: int) -> float:
        n = float(num_examples) * self.scale
        if self.maximum is not None:
            n = min(n, float(self.maximum))
        if n <= 0:
            return 0.0
        return n ** (1.0 / self.temperature)

    def params(self) -> dict:
        return {"maximum": self.maximum, "temperature": self.temperature, "scale": self.scale}

    def __repr__(self) -> str:
        return f"rate_num_examples(maximum={self.maximum}, temperature={self.temperature}, scale={self.scale})"


def rate_num_examples(*, maximum: int | None = None, temperature: float = 1.0,
                      scale: float = 1.0) -> RateNumExamples:
    """A rate callable: ``min(n * scale, maximum) ** (1 / temperature)`` for n examples.

    Raises:
      ValueError: temperature or scale <= 0, or maximum <= 0.
    """
    return RateNumExamples(maximum=maximum, temperature=temperature, scale=scale)


def _rate_fingerprint(rate: Rate):
    if isinstance(rate, RateNumExamples):
        return {"rate_num_examples": rate.params()}
    if callable(rate):
        params = rate.params() if hasattr(rate, "params") else None
        name = f"{getattr(rate, '__module__', '?')}.{getattr(rate, '__qualname__', type(rate).__qualname__)}"
        return {"callable": name, "params": params}
    return float(rate)


class Mixture:
    """Tasks and their mixing rates.

    Args:
      name: mixture name (letters, digits, ``_ . -``).
      tasks: ``(task or task name, rate)`` pairs, or task names / Tasks alone, which
        then get ``default_rate``. A rate is a number >= 0 or a callable of the
        task's example count (see ``rate_num_examples``).
      default_rate: the rate of tasks listed without one.

    Raises:
      ValueError: no tasks, a task listed twice, a task without a rate and no
        default_rate, or a negative constant rate.
    """

    def __init__(self, name: str, tasks: Sequence[tuple[str | Task, Rate]] | Sequence[str | Task], *,
                 default_rate: Rate | None = None):
        self.name = check_name(name, "mixture")
        if not tasks:
            raise ValueError(f"mixture {name!r} needs at least one task")
        self._rates: dict[str, Rate] = {}
        self._task_objects: dict[str, Task] = {}
        for item in tasks:
            if isinstance(item, tuple):
                if len(item) != 2:
                    raise ValueError(f"mixture {name!r}: expected (task, rate) pairs (got {item!r})")
                task, rate = item
            else:
                task, rate = item, default_rate
            if rate is None:
                raise ValueError(f"mixture {name!r}: task {task if isinstance(task, str) else task.name!r} "
                                 "has no rate; give (task, rate) or default_rate")
            if isinstance(task, Task):
                task_name = task.name
                self._task_objects[task_name] = task
            elif isinstance(task, str):
                task_name = task
            else:
                raise TypeError(f"mixture {name!r}: expected a task name or Task (got {type(task).__name__})")
            if task_name in self._rates:
                raise ValueError(f"mixture {name!r}: task {task_name!r} is listed twice")
            if not callable(rate):
                rate = float(rate)
                if rate < 0 or math.isnan(rate):
                    raise ValueError(f"mixture {name!r}: rate of task {task_name!r} must be >= 0 (got {rate})")
            self._rates[task_name] = rate

    @property
    def task_names(self) -> list[str]:
        """The task names, in the order given."""
        return list(self._rates)

    def get_tasks(self) -> list[Task]:
        """The Task objects, resolving names through ``TaskRegistry``.

        Raises:
          KeyError: a task name is not registered (with suggestions).
        """
        from seqcache.tasks.registry import TaskRegistry

        return [self._task_objects.get(n) or TaskRegistry.get(n) for n in self._rates]

    def get_rates(self, num_examples: Mapping[str, int] | None = None) -> dict[str, float]:
        """Unnormalised rate per task name; callables receive the task's example count.

        Args:
          num_examples: task name -> number of examples (needed for callable rates).

        Raises:
          ValueError: a callable rate without the task's count, a negative or NaN
            rate, or a total rate that is not > 0.
        """
        rates = {}
        for task_name, rate in self._rates.items():
            if callable(rate):
                if num_examples is None or task_name not in num_examples:
                    raise ValueError(f"mixture {self.name!r}: the rate of task {task_name!r} depends on its "
                                     "number of examples, which was not given")
                value = float(rate(int(num_examples[task_name])))
            else:
                value = float(rate)
            if not value >= 0:
                raise ValueError(f"mixture {self.name!r}: rate of task {task_name!r} is {value}; rates must be >= 0")
            rates[task_name] = value
        total = sum(rates.values())
        if not total > 0:
            raise ValueError(f"mixture {self.name!r}: the total rate is {total}; at least one rate must be > 0 "
                             f"(rates: {rates})")
        return rates

    def fingerprint(self) -> dict:
        """JSON-able identity: name and, per task, the rate (a number or a description)."""
        return {"name": self.name, "tasks": [[n, _rate_fingerprint(r)] for n, r in self._rates.items()]}

    def __repr__(self) -> str:
        return f"Mixture({self.name!r}, {[(n, r) for n, r in self._rates.items()]})"
