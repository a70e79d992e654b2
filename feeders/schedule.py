"""Mixture schedules: mixing rates that change at given steps, with exact accounting.

A schedule is a list of stages. Stage j starts at global position P_j = step_j * B
(P_0 = 0, strictly increasing) and has integer weights w^j_t, one per task of the
mixture (0: the task is not read in that stage). Inside stage j, local position
q = p - P_j is assigned by the stage's own ``mixing.Mixer`` over its tasks with
w^j_t > 0, which gives a task t and a local ordinal; the task's ordinal is

    k = base_j[t] + local ordinal,   base_0[t] = 0,
    base_{j+1}[t] = base_j[t] + c^j_t(P_{j+1} - P_j)

where c^j_t(P) counts stage j's local positions in [0, P) assigned to t
(``Mixer.count_before``). So every task's ordinals 0, 1, 2, ... are taken by
exactly one position each across the whole schedule: a rate change skips and
repeats nothing, and the epoch and permutation of an ordinal are what they would be
without the change (exactly once per epoch, G3). A task that first appears in a
later stage starts at ordinal 0.

Bound: inside stage j, for every prefix [P_j, P_j + Q) of the stage and every task
t of the stage, |(k-count of t in that prefix) - Q * w^j_t / W^j| < d^j_t, the
stage mixer's bound (``seqcache.feeders.mixing``).

Cost: the bases are computed once, O(stages * T * log T); locating a position is a
binary search over the stage starts and one tree walk, O(log stages + log T)
(vectorised over a batch: one walk per stage the batch touches, usually one).
A schedule with one stage at step 0 is exactly the unscheduled mixture.

Inverse (``position_of``): ordinal k of task t lies in the last stage j with
base_j[t] <= k, at P_j + the stage mixer's position of local ordinal
k - base_j[t]: O(log stages + log T).
"""

from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np

from seqcache.feeders import mixing


class Schedule:
    """Piecewise-constant mixing over global positions.

    Args:
      stages: [(start position P_j, weights)] in increasing start order, the first
        at position 0; ``weights``: one non-negative integer per task (the same
        number of tasks in every stage), at least one positive per stage.

    Attributes:
      num_tasks: T (tasks of every stage, in mixture order).
      starts: the stage start positions.

    Raises:
      ValueError: a first stage not at 0, starts not strictly increasing, a stage
        with no positive weight, or stages with different numbers of tasks.
    """

    def __init__(self, stages: Sequence[tuple[int, Sequence[int]]]):
        if not stages:
            raise ValueError("a schedule needs at least one stage")
        self.starts = [int(s) for s, _ in stages]
        if self.starts[0] != 0:
            raise ValueError(f"the first stage of a schedule starts at position 0 (got {self.starts[0]})")
        for a, b in zip(self.starts, self.starts[1:]):
            if not b > a:
                raise ValueError(f"schedule stages must start at increasing positions (got {a} then {b})")
        self.weights = [tuple(int(w) for w in ws) for _, ws in stages]
        self.num_tasks = len(self.weights[0])
        for start, ws in zip(self.starts, self.weights):
            if len(ws) != self.num_tasks:
                raise ValueError(f"stage at position {start} has {len(ws)} weights, expected {self.num_tasks}")
            if any(w < 0 for w in ws) or not any(ws):
                raise ValueError(f"stage at position {start}: weights must be >= 0 with one > 0 (got {list(ws)})")
        # Per stage: its tasks (global indices), their mixer, and global -> local.
        self.tasks = [[t for t, w in enumerate(ws) if w > 0] for ws in self.weights]
        self.mixers = [mixing.Mixer([ws[t] for t in tasks]) for ws, tasks in zip(self.weights, self.tasks)]
        self._local = [{t: j for j, t in enumerate(tasks)} for tasks in self.tasks]
        self._task_arrays = [np.array(tasks, np.int32) for tasks in self.tasks]
        bases = [[0] * self.num_tasks]
        for j in range(len(self.starts) - 1):
            length = self.starts[j + 1] - self.starts[j]
            nxt = list(bases[j])
            for t in self.tasks[j]:
                nxt[t] += self.mixers[j].count_before(self._local[j][t], length)
            bases.append(nxt)
        self.bases = bases  # bases[j][t]: task t's ordinals taken before stage j
        self._base_arrays = [np.array(b, np.int64) for b in bases]
        self._starts_array = np.array(self.starts, np.int64)
        self._task_bases = [list(b) for b in zip(*bases)]  # per task, its base in each stage (position_of)

    @property
    def num_stages(self) -> int:
        return len(self.starts)

    def stage_of(self, p: int) -> int:
        """The index j of the stage holding global position p."""
        return bisect.bisect_right(self.starts, int(p)) - 1

    def depth(self, task: int, stage: int) -> int | None:
        """The prefix bound of ``task`` inside ``stage`` (None: not in the stage)."""
        local = self._local[stage].get(task)
        return None if local is None else self.mixers[stage].depth[local]

    # --- scalar, exact in Python integers -------------------------------------

    def locate(self, p: int) -> tuple[int, int]:
        """(task t, ordinal k) of global position p >= 0."""
        if p < 0:
            raise ValueError(f"position must be >= 0 (got {p})")
        j = self.stage_of(p)
        local, q = self.mixers[j].locate(int(p) - self.starts[j])
        t = self.tasks[j][local]
        return t, self.bases[j][t] + q

    def count_before(self, task: int, p: int) -> int:
        """How many of the positions [0, p) belong to ``task``."""
        if p <= 0:
            return 0
        j = self.stage_of(p - 1)
        local = self._local[j].get(task)
        inside = 0 if local is None else self.mixers[j].count_before(local, int(p) - self.starts[j])
        return self.bases[j][task] + inside

    def position_of(self, task: int, ordinal: int) -> int | None:
        """The global position of ordinal ``ordinal`` of ``task`` (the inverse of
        ``locate``), or None when the task never takes that ordinal (it is not in
        the last stage and its stages end before it).

        The stage is the last j with base_j[t] <= k (a binary search over the
        task's bases, which never decrease; a stage without the task does not
        raise them, so that j holds the task unless it is the last stage), then
        P_j + the stage mixer's ``position_of``: O(log stages + log T).

        Raises:
          ValueError: a task outside [0, T) or a negative ordinal.
        """
        mixing.check_task_ordinal(task, ordinal, self.num_tasks)
        k = int(ordinal)
        j = bisect.bisect_right(self._task_bases[task], k) - 1
        local = self._local[j].get(task)
        if local is None:  # only in the last stage: the task's ordinals end before k
            return None
        return self.starts[j] + self.mixers[j].position_of(local, k - self.bases[j][task])

    def first_position_with_count(self, task: int, count: int) -> int | None:
        """The smallest P with ``count_before(task, P) >= count``; None when the
        task never reaches ``count`` (it is not in the last stage)."""
        if count <= 0:
            return 0
        last = self.num_stages - 1
        for j in range(self.num_stages):
            if j < last and count > self.bases[j + 1][task]:
                continue
            local = self._local[j].get(task)
            if local is None:  # only possible in the last stage
                return None
            need = count - self.bases[j][task]
            return self.starts[j] + self.mixers[j].first_position_with_count(local, need)
        return None

    # --- vectorised ------------------------------------------------------------

    def locate_many(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised ``locate``: int64 (n,) positions -> (task int32 (n,), ordinal int64 (n,))."""
        p = np.asarray(positions, dtype=np.int64)
        if self.num_stages == 1:
            local, q = self.mixers[0].locate_many(p)
            return self._task_arrays[0][local], q + self._base_arrays[0][self._task_arrays[0][local]]
        stage = np.searchsorted(self._starts_array, p, side="right") - 1
        task = np.empty(p.shape, np.int32)
        ordinal = np.empty(p.shape, np.int64)
        for j in np.unique(stage).tolist():
            sel = stage == j
            local, q = self.mixers[j].locate_many(p[sel] - self.starts[j])
            t = self._task_arrays[j][local]
            task[sel] = t
            ordinal[sel] = q + self._base_arrays[j][t]
        return task, ordinal
