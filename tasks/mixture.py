"""Mixtures: tasks with mixing rates (seqio's ``Mixture``).

A rate is a constant or a callable of the task's number of cached examples
(``rate_num_examples``), relative: the feeder normalises and mixes, and
changing rates needs no rebuild. A schedule changes the rates at given steps
(``schedule={10_000: {"wiki": 3, "code": 1}}``; ``seqcache.feeders.schedule``).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from seqcache.rates import Rate, RateNumExamples, rate_num_examples
from seqcache.tasks.task import Task, check_name
from seqcache.tasks.task_registry import TaskRegistry

__all__ = ["Mixture", "Rate", "RateNumExamples", "rate_num_examples"]


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
      schedule: optional {step: {task name: rate}}, steps >= 1 (``tasks``'
        rates are step 0's); a task a stage leaves out has rate 0 in it, and
        every task named is one of ``tasks`` (rate 0 for one that starts later).

    Every task of a mixture has the same output features (by name; seqio's
    rule), checked here for the tasks known now, by ``get_tasks`` for names
    registered later, and by the feeder for every cache.

    Raises:
      ValueError: no tasks, a task listed twice or without a rate, a negative
        rate; in ``schedule``, a step not an integer >= 1, a task not in the
        mixture, a bad rate; tasks with different output features.
    """

    def __init__(self, name: str, tasks: Sequence[tuple[str | Task, Rate]] | Sequence[str | Task], *,
                 default_rate: Rate | None = None, schedule: Mapping[int, Mapping[str, Rate]] | None = None):
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
        self._schedule = self._check_schedule(schedule)
        self._check_features(self._known_tasks())

    def _known_tasks(self) -> list[Task]:
        """The Task objects given, and those of the names registered now."""
        registered = set(TaskRegistry.names())
        return [self._task_objects[n] if n in self._task_objects else TaskRegistry.get(n)
                for n in self._rates if n in self._task_objects or n in registered]

    def _check_features(self, tasks: Sequence[Task]) -> None:
        """Refuses tasks with different output features (by name), as seqio does."""
        if all(set(t.output_features) == set(tasks[0].output_features) for t in tasks[1:]):
            return
        seen = "; ".join(f"task {t.name!r} has {sorted(t.output_features)}" for t in tasks)
        shared = sorted(set.intersection(*(set(t.output_features) for t in tasks)))
        raise ValueError(
            f"mixture {self.name!r}: its tasks have different output features, so a feeder would drop some tasks' "
            f"features: {seen}. Mix only tasks with the same output features"
            + (f" (e.g. register a variant of each task with only the features they share, {shared})" if shared
               else "")
        )

    def _check_schedule(self, schedule) -> dict[int, dict[str, Rate]]:
        if schedule is None:
            return {}
        if not isinstance(schedule, Mapping):
            raise ValueError(f"mixture {self.name!r}: schedule is {{step: {{task: rate}}}} (got {schedule!r})")
        out = {}
        for step, rates in schedule.items():
            if isinstance(step, bool) or not isinstance(step, int) or step < 1:
                raise ValueError(f"mixture {self.name!r}: schedule steps are integers >= 1 (got {step!r}); the rates "
                                 "at step 0 are the mixture's task rates")
            if not isinstance(rates, Mapping) or not rates:
                raise ValueError(f"mixture {self.name!r}: schedule stage at step {step} must map task names to "
                                 f"rates (got {rates!r})")
            stage = {}
            for task_name, rate in rates.items():
                if task_name not in self._rates:
                    raise ValueError(f"mixture {self.name!r}: schedule stage at step {step} names task "
                                     f"{task_name!r}, which is not in the mixture (tasks: {self.task_names}); list "
                                     "it in the mixture's tasks, with rate 0 if it starts later")
                if not callable(rate):
                    rate = float(rate)
                    if rate < 0 or math.isnan(rate):
                        raise ValueError(f"mixture {self.name!r}: schedule rate of task {task_name!r} at step {step} "
                                         f"must be >= 0 (got {rate})")
                stage[task_name] = rate
            out[step] = stage
        return dict(sorted(out.items()))

    @property
    def schedule(self) -> dict[int, dict[str, Rate]]:
        """The stages after step 0, {step: {task name: rate}} in step order ({} without a schedule)."""
        return {step: dict(stage) for step, stage in self._schedule.items()}

    def get_schedule(self, num_examples: Mapping[str, int] | None = None) -> dict[int, dict[str, float]]:
        """Every stage's rates, {step: {task name: rate}} from step 0
        (``get_rates``) on, 0.0 for a task a stage leaves out. Raises
        ``ValueError`` as ``get_rates``."""
        out = {0: self.get_rates(num_examples)}
        for step, stage in self._schedule.items():
            out[step] = self._evaluate({n: stage.get(n, 0.0) for n in self._rates}, num_examples,
                                       where=f" at step {step}")
        return out

    @property
    def task_names(self) -> list[str]:
        """The task names, in the order given."""
        return list(self._rates)

    def get_tasks(self) -> list[Task]:
        """The Task objects, resolving names through ``TaskRegistry``.

        Raises:
          KeyError: a task name is not registered (with suggestions).
          ValueError: the tasks have different output features (a name
            registered after the mixture was built).
        """
        tasks = [self._task_objects.get(n) or TaskRegistry.get(n) for n in self._rates]
        self._check_features(tasks)
        return tasks

    def get_rates(self, num_examples: Mapping[str, int] | None = None) -> dict[str, float]:
        """Unnormalised rate per task name; callables receive the task's example count.

        Args:
          num_examples: task name -> number of examples (needed for callable rates).

        Raises:
          ValueError: a callable rate without the task's count, a negative or NaN
            rate, or a total rate that is not > 0.
        """
        return self._evaluate(self._rates, num_examples)

    def _evaluate(self, given: Mapping[str, Rate], num_examples, *, where: str = "") -> dict[str, float]:
        rates = {}
        for task_name, rate in given.items():
            if callable(rate):
                if num_examples is None or task_name not in num_examples:
                    raise ValueError(f"mixture {self.name!r}: the rate of task {task_name!r}{where} depends on its "
                                     "number of examples, which was not given")
                value = float(rate(int(num_examples[task_name])))
            else:
                value = float(rate)
            if not value >= 0:
                raise ValueError(f"mixture {self.name!r}: rate of task {task_name!r}{where} is {value}; rates must "
                                 "be >= 0")
            rates[task_name] = value
        total = sum(rates.values())
        if not total > 0:
            raise ValueError(f"mixture {self.name!r}: the total rate{where} is {total}; at least one rate must be > 0 "
                             f"(rates: {rates})")
        return rates

    def fingerprint(self) -> dict:
        """JSON-able identity: name and, per task, the rate (a number or a description)."""
        out = {"name": self.name, "tasks": [[n, _rate_fingerprint(r)] for n, r in self._rates.items()]}
        if self._schedule:
            out["schedule"] = [[step, [[n, _rate_fingerprint(r)] for n, r in stage.items()]]
                               for step, stage in self._schedule.items()]
        return out

    def __repr__(self) -> str:
        extra = f", schedule={self._schedule!r}" if self._schedule else ""
        return f"Mixture({self.name!r}, {[(n, r) for n, r in self._rates.items()]}{extra})"
