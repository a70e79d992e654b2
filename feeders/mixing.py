"""Exact, random-access mixing of tasks: which task owns global position p.

A mixture of T tasks with rates r_t assigns every global position p (see the index
vocabulary in ``seqcache.feeders.feeder``) to one task t and gives it an ordinal k:
the number of positions before p that were also assigned to t. Both are computed
directly from p in O(log T) integer operations, without walking from 0, so a
resumed run at position 10^12 costs what position 0 costs.

Algorithm: a balanced binary tree of two-way low-discrepancy splits.

* Rates become positive integer weights w_t (``integer_weights``). Every internal
  node of a balanced binary tree over the tasks (in mixture order) has a left
  weight a (the sum of its left subtree's weights) and a total b.
* A node sees its own local stream q = 0, 1, 2, ... Local position q goes left iff
  floor((q + 1) a / b) > floor(q a / b); then the first q local positions hold
  exactly floor(q a / b) left ones and q - floor(q a / b) right ones (a Beatty /
  Bresenham sequence, also the "largest remainder" apportionment of every prefix).
  The child's local position is that count.
* Descending from the root with q = p gives the task (the leaf reached) and the
  ordinal (the leaf's local position).

Bound (tested over many prefixes): for every prefix length P and task t at depth
d_t in the tree (d_t <= ceil(log2 T)), the number of positions in [0, P) assigned
to t, c_t(P), satisfies |c_t(P) - P * w_t / W| < d_t, where W = sum of weights.
(A floor or ceiling at each level adds less than 1 and scales down the error of
the level above by the split fraction.) For one task the bound is 0; for two it is
< 1.

Inverse (``position_of``): the position of ordinal k of task t, O(log T). Walk
from the leaf up to the root; at each node, the c-th (0-based) local position that
goes left is q = floor(((c + 1) b - 1) / a) (the smallest q with
floor((q + 1) a / b) >= c + 1), and the c-th that goes right is
q = floor(c b / (b - a)) (the rights before q number ceil(q (b - a) / b)). The
parent's local position q becomes the c of the level above; at the root, q is p.

Integer arithmetic only: floor(q a / b) = (q // b) a + ((q mod b) a) // b, with
a < b <= 2^31 and q < 2^62, so every intermediate fits in int64; no float enters
the assignment. The same algorithm also runs in Python integers (``locate`` and
``count_before``) for the scalar, unbounded cases.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
from typing import Sequence

import numpy as np

from seqcache.rates import Rate, RateNumExamples, rate_num_examples  # noqa: F401  (the one definition, re-exported)

# Float rates are quantised to integers with this total (see integer_weights).
WEIGHT_RESOLUTION = 2**30
_MAX_EXACT_TOTAL = 2**31
MAX_POSITION = 2**62


def integer_weights(rates: Sequence[float]) -> list[int]:
    """Converts rates to positive integer weights, deterministically.

    Rule: if every rate is an integer (a Python int, or a float with an integral
    value) and their sum is below 2^31, the rates are the weights. Otherwise each
    weight is round_half_even(r_t * 2^30 / sum(r)), computed exactly from the
    floats' binary values with ``fractions.Fraction`` (no float rounding enters).
    Finally all weights are divided by their greatest common divisor. The result
    depends only on the rate values, never on the platform.

    Raises:
      ValueError: no rates, a rate that is not a finite number > 0, or a rate so
        small relative to the others that its weight would round to 0 (less than
        2^-31 of the total).
    """
    if not rates:
        raise ValueError("a mixture needs at least one task")
    for r in rates:
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or not r > 0:
            raise ValueError(f"mixture rates must be finite numbers > 0 (got {r!r}); remove a task instead of giving it rate 0")
    if all(float(r).is_integer() for r in rates) and sum(int(r) for r in rates) < _MAX_EXACT_TOTAL:
        weights = [int(r) for r in rates]
    else:
        exact = [fractions.Fraction(r) for r in rates]
        total = sum(exact)
        weights = [round(x * WEIGHT_RESOLUTION / total) for x in exact]
        for r, w in zip(rates, weights):
            if w == 0:
                raise ValueError(
                    f"mixture rate {r!r} is below 2^-31 of the total rate {float(total)!r}: the task would never be "
                    "sampled; raise its rate or remove it"
                )
    g = math.gcd(*weights)
    return [w // g for w in weights]


@dataclasses.dataclass(frozen=True)
class _Node:
    lo: int  # first task of the subtree
    hi: int  # one past the last task
    left: "_Node | None"
    right: "_Node | None"
    a: int  # weight of the left subtree
    b: int  # weight of the whole subtree


def _build(weights: Sequence[int], lo: int, hi: int) -> _Node:
    if hi - lo == 1:
        return _Node(lo, hi, None, None, 0, weights[lo])
    mid = (lo + hi + 1) // 2
    left, right = _build(weights, lo, mid), _build(weights, mid, hi)
    return _Node(lo, hi, left, right, left.b, left.b + right.b)


class Mixer:
    """Assigns global positions to tasks; see the module docstring.

    Args:
      weights: positive integer weights, one per task, in mixture order, with a
        sum below 2^31 (``integer_weights`` guarantees both).

    Attributes:
      num_tasks: T.
      depth: per task, its depth in the tree (the prefix-discrepancy bound).
    """

    def __init__(self, weights: Sequence[int]):
        weights = [int(w) for w in weights]
        if not weights or any(w <= 0 for w in weights):
            raise ValueError(f"weights must be a non-empty list of positive integers (got {weights})")
        if sum(weights) >= _MAX_EXACT_TOTAL:
            raise ValueError(f"weights must sum to less than 2^31 (got {sum(weights)}); use integer_weights()")
        self.weights = tuple(weights)
        self.num_tasks = len(weights)
        self.total = sum(weights)
        self._root = _build(weights, 0, len(weights))
        # Flattened tree for the vectorised walk: internal nodes 0..T-2; a child
        # id < 0 is the leaf of task -id - 1.
        self._a: list[int] = []
        self._b: list[int] = []
        self._left: list[int] = []
        self._right: list[int] = []
        self.depth = [0] * self.num_tasks
        self._flatten(self._root, 0)
        self._na = np.array(self._a, dtype=np.int64)
        self._nb = np.array(self._b, dtype=np.int64)
        self._nl = np.array(self._left, dtype=np.int64)
        self._nr = np.array(self._right, dtype=np.int64)
        self.max_depth = max(self.depth)
        # Path from the root to each leaf: [(a, b, went_left)], for count_before.
        self._paths = [self._path(t) for t in range(self.num_tasks)]

    def _flatten(self, node: _Node, depth: int) -> int:
        if node.left is None:
            self.depth[node.lo] = depth
            return -node.lo - 1
        i = len(self._a)
        self._a.append(node.a)
        self._b.append(node.b)
        self._left.append(0)
        self._right.append(0)
        self._left[i] = self._flatten(node.left, depth + 1)
        self._right[i] = self._flatten(node.right, depth + 1)
        return i

    def _path(self, task: int) -> list[tuple[int, int, bool]]:
        out = []
        node = self._root
        while node.left is not None:
            go_left = task < node.left.hi
            out.append((node.a, node.b, go_left))
            node = node.left if go_left else node.right
        return out

    # --- scalar, exact in Python integers -------------------------------------

    def locate(self, p: int) -> tuple[int, int]:
        """(task t, ordinal k) of global position p >= 0."""
        if p < 0:
            raise ValueError(f"position must be >= 0 (got {p})")
        q = int(p)
        node = self._root
        while node.left is not None:
            below = q * node.a // node.b
            if (q + 1) * node.a // node.b > below:
                q, node = below, node.left
            else:
                q, node = q - below, node.right
        return node.lo, q

    def count_before(self, task: int, p: int) -> int:
        """c_t(p): how many of the positions [0, p) belong to ``task``."""
        q = int(p)
        for a, b, go_left in self._paths[task]:
            below = q * a // b
            q = below if go_left else q - below
        return q

    def position_of(self, task: int, ordinal: int) -> int:
        """The global position p of ordinal ``ordinal`` of ``task``: the inverse of
        ``locate`` (``locate(position_of(t, k)) == (t, k)``), exact in Python
        integers, in O(depth) = O(log T) (module docstring, "Inverse").

        Raises:
          ValueError: a task outside [0, T) or a negative ordinal.
        """
        check_task_ordinal(task, ordinal, self.num_tasks)
        c = int(ordinal)
        for a, b, went_left in reversed(self._paths[task]):
            c = ((c + 1) * b - 1) // a if went_left else c * b // (b - a)
        return c

    def first_position_with_count(self, task: int, count: int) -> int:
        """The smallest P with c_t(P) >= count (so positions [0, P) hold ``count``
        positions of ``task``). O(log(count) * depth)."""
        if count <= 0:
            return 0
        lo = 0
        # c_t(P) > P * w_t / W - depth, so this P is large enough.
        hi = (count + self.depth[task] + 1) * self.total // self.weights[task] + 1
        while self.count_before(task, hi) < count:  # guard; the bound makes this rare
            hi *= 2
        while lo < hi:
            mid = (lo + hi) // 2
            if self.count_before(task, mid) >= count:
                hi = mid
            else:
                lo = mid + 1
        return lo

    # --- vectorised ------------------------------------------------------------

    def locate_many(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised ``locate``.

        Args:
          positions: int64 array (n,) of global positions in [0, 2^62).

        Returns:
          (task int32 (n,), ordinal int64 (n,)).
        """
        q = np.asarray(positions, dtype=np.int64)
        if q.size and (q.min() < 0 or q.max() >= MAX_POSITION):
            raise ValueError(f"positions must be in [0, 2^62) (got [{q.min()}, {q.max()}])")
        if self.num_tasks == 1:
            return np.zeros(q.shape, np.int32), q.copy()
        node = np.zeros(q.shape, np.int64)
        q = q.copy()
        active = np.arange(q.size)
        task = np.empty(q.shape, np.int32)
        qa, nodea = q, node
        for _ in range(self.max_depth):
            a = self._na[nodea]
            b = self._nb[nodea]
            hi, rem = np.divmod(qa, b)
            below = hi * a + rem * a // b
            # floor((q+1) a / b) > floor(q a / b)  <=>  (rem * a mod b) + a >= b
            go_left = (rem * a % b) + a >= b
            qa = np.where(go_left, below, qa - below)
            nodea = np.where(go_left, self._nl[nodea], self._nr[nodea])
            leaf = nodea < 0
            if leaf.any():
                idx = active[leaf]
                task[idx] = -nodea[leaf] - 1
                q[idx] = qa[leaf]
                keep = ~leaf
                active, qa, nodea = active[keep], qa[keep], nodea[keep]
            if not active.size:
                break
        return task, q


def check_task_ordinal(task: int, ordinal: int, num_tasks: int) -> None:
    """Checks the arguments of an inverse lookup (``position_of``).

    Raises:
      ValueError: a task outside [0, num_tasks) or a negative ordinal.
    """
    if not 0 <= task < num_tasks:
        raise ValueError(f"task must be in [0, {num_tasks}) (got {task})")
    if ordinal < 0:
        raise ValueError(f"ordinal must be >= 0 (got {ordinal})")
