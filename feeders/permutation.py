"""Seeded bijections of [0, N): the per-epoch order in which a task is read.

For every (seed, task, epoch) the feeder needs a permutation of the task's N cache
indices that it can evaluate at any point in O(1), without materialising it (memory
must not grow with N, and resuming at epoch 10^6 must cost the same as epoch 0).

Construction (a format-preserving block cipher):

* A **Feistel network over Z_a x Z_b** with a = ceil(sqrt(N)), b = ceil(N / a), so
  a * b >= N and a * b - N < a. A value x is the pair (L, R) = (x // b, x % b). Each
  round maps (L, R) -> (R, (L + F_i(R)) mod m_L), where m_L is the modulus of L and
  F_i is the SplitMix64 finaliser of R xor a 64-bit round key; the two halves swap
  moduli every round, so after an even number of rounds x' = L * b + R again. Every
  round is invertible whatever F_i is, so the network is a bijection of [0, a * b)
  (Luby & Rackoff, "How to construct pseudorandom permutations from pseudorandom
  functions", SIAM J. Computing 1988; the mixed-radix form is Black & Rogaway's
  generalised Feistel cipher, below). ``ROUNDS`` = 6.
* **Cycle walking** restricts it to [0, N): encrypt x; while the result is >= N,
  encrypt again. Since a * b - N < a <= sqrt(N) + 1, this is rarely needed.
  Restricting a permutation of a superset this way yields a permutation of the
  subset (Black & Rogaway, "Ciphers with arbitrary finite domains", CT-RSA 2002).
* Round keys are the first 8 * ROUNDS bytes of BLAKE2b over a versioned string
  naming the seed, the task's cache fingerprint and the epoch, so different tasks
  and epochs get independent orders and a task's order does not depend on the
  mixture it is part of.

Everything is vectorised with numpy uint64 arithmetic over a whole batch of
indices. Changing ``ROUNDS``, the round function or the key derivation changes
every user's data order: it needs a feeder state version bump
(``seqcache.feeders.state.STATE_VERSION``) and the golden-order test updated.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

ROUNDS = 6
# Domains whose halves have at most this many values (n up to about 2^20)
# evaluate the round function from per-round tables (ROUNDS * 1024 int64 at most:
# 48 KiB per permutation).
TABLE_MAX_SIDE = 1024
_KEY_DOMAIN = b"seqcache.feeders.permutation.v1"
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def round_keys(*, seed: int, task_key: str, epoch: int) -> np.ndarray:
    """The ``ROUNDS`` 64-bit round keys for one (seed, task, epoch).

    Args:
      seed: the feeder seed, an integer in [0, 2**64).
      task_key: identifies the task's data; the feeder passes the cache fingerprint.
      epoch: the epoch number, >= 0.

    Returns:
      uint64 array of shape (ROUNDS,).
    """
    return round_keys_many(seed=seed, task_key=task_key, epochs=[epoch])[0]


def round_keys_many(*, seed: int, task_key: str, epochs) -> np.ndarray:
    """``round_keys`` for many epochs of one (seed, task): row j is
    ``round_keys(seed=seed, task_key=task_key, epoch=epochs[j])``.

    Args:
      epochs: int sequence (m,), each >= 0.

    Returns:
      uint64 array (m, ROUNDS).
    """
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64) (got {seed=})")
    prefix = hashlib.blake2b(digest_size=8 * ROUNDS)
    prefix.update(_KEY_DOMAIN)
    prefix.update(b"\x00seed=%d\x00task=" % seed)
    prefix.update(task_key.encode("utf-8"))
    digests = []
    for epoch in epochs:
        epoch = int(epoch)
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0 (got {epoch=})")
        h = prefix.copy()
        h.update(b"\x00epoch=%d" % epoch)
        digests.append(h.digest())
    return np.frombuffer(b"".join(digests), dtype="<u8").astype(np.uint64).reshape(len(digests), ROUNDS)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (Steele, Lea & Flood, OOPSLA 2014), elementwise on uint64."""
    z = z ^ (z >> _S30)  # a new array; the rest works in place on it
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z


class FeistelPermutation:
    """A keyed bijection of [0, n) evaluated elementwise on numpy arrays.

    Args:
      n: the domain size, 1 <= n < 2**62.
      keys: uint64 array (ROUNDS,), e.g. from ``round_keys``.

    ``permute(x)`` and ``inverse(y)`` take integer arrays with values in [0, n) and
    return uint64 arrays of the same shape. Cost per element: ROUNDS rounds times
    the expected number of cycle-walking steps (< 1 + 1/sqrt(n)). Memory: beyond
    the input and output arrays, for n up to about 2^20 the round function's
    tables (``ROUNDS * max(a, b)`` int64, at most 48 KiB), else O(1).
    """

    def __init__(self, n: int, keys: np.ndarray):
        n = int(n)
        if not 1 <= n < 2**62:
            raise ValueError(f"permutation domain size must be in [1, 2**62) (got {n=})")
        keys = np.asarray(keys, dtype=np.uint64)
        if keys.shape != (ROUNDS,):
            raise ValueError(f"expected {ROUNDS} round keys (got shape {keys.shape})")
        self.n = n
        self.keys = keys
        self._key_list = list(keys)  # numpy uint64 scalars (iterating the array per call costs more)
        self._tables: list[np.ndarray] | None = None
        # [0, n) embeds in Z_a x Z_b with a = ceil(sqrt(n)), b = ceil(n / a):
        # a * b - n < a, so cycle walking is rarely needed.
        self.a = math.isqrt(n - 1) + 1
        self.b = -(-n // self.a)
        self.domain = self.a * self.b

    def _round_tables(self) -> list[np.ndarray] | None:
        """Per round i, F_i(R) mod m_L for every right half R: int64 arrays of
        b or a entries (at most ``TABLE_MAX_SIDE``), built on first use; None
        for larger domains. A round is then a lookup, an addition and one
        conditional subtraction, the same values as computing F_i."""
        if self._tables is None and max(self.a, self.b) <= TABLE_MAX_SIDE:
            ml, mr = self.a, self.b
            tables = []
            for k in self._key_list:
                tables.append((_mix(np.arange(mr, dtype=np.uint64) ^ k) % np.uint64(ml)).astype(np.int64))
                ml, mr = mr, ml
            self._tables = tables
        return self._tables

    # One full network (ROUNDS rounds) over [0, a * b), x = left * b + right.
    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        tables = self._round_tables()
        if tables is not None:
            # (L + F(R)) mod m_L with L, F(R) < m_L: one conditional subtraction.
            ml, mr = self.a, self.b
            left, right = np.divmod(x.astype(np.int64), mr)
            for table in tables:
                f = table[right]
                f += left
                f -= ml * (f >= ml)
                left, right = right, f
                ml, mr = mr, ml
            return (left * mr + right).astype(np.uint64)
        ml, mr = np.uint64(self.a), np.uint64(self.b)
        left, right = np.divmod(x, mr)
        for k in self._key_list:
            f = _mix(right ^ k)
            f %= ml
            f += left
            f %= ml
            left, right = right, f
            ml, mr = mr, ml
        # ROUNDS is even: the moduli are back to (a, b).
        return left * mr + right

    def _decrypt(self, y: np.ndarray) -> np.ndarray:
        ml, mr = np.uint64(self.a), np.uint64(self.b)
        left, right = np.divmod(y, mr)
        for k in self.keys[::-1]:
            # Undo (L, R) -> (R, (L + F(R)) mod m_L): the current left is the old
            # right, the current right's modulus is the old left's.
            f = _mix(left ^ k) % mr
            left, right = (right + mr - f) % mr, left
            ml, mr = mr, ml
        return left * mr + right

    def _walk(self, x, step) -> np.ndarray:
        x = np.asarray(x)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise ValueError(
                f"permutation input out of range [0, {self.n}) (got values in [{x.min()}, {x.max()}])"
            )
        out = x.astype(np.uint64)
        if self.n == 1:
            return out
        out = step(out)
        if self.domain == self.n:
            return out
        n = np.uint64(self.n)
        todo = np.flatnonzero(out >= n)
        while todo.size:
            y = step(out[todo])
            out[todo] = y
            todo = todo[y >= n]
        return out

    def permute(self, x) -> np.ndarray:
        """The image of each element of ``x`` (uint64 array, same shape)."""
        return self._walk(x, self._encrypt)

    def inverse(self, y) -> np.ndarray:
        """The preimage of each element of ``y``: ``inverse(permute(x)) == x``."""
        return self._walk(y, self._decrypt)


def _encrypt_each(x: np.ndarray, a: np.ndarray, b: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """``FeistelPermutation._encrypt`` with per-element moduli a, b (uint64 (m,))
    and round keys (uint64 (m, ROUNDS)): the same operations, elementwise."""
    ml, mr = a, b
    left, right = np.divmod(x, mr)
    for r in range(ROUNDS):
        left, right = right, (left + _mix(right ^ keys[:, r]) % ml) % ml
        ml, mr = mr, ml
    return left * mr + right


def permute_each(perms, which: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``perms[which[i]].permute(x[i])`` for every i, in one vectorised pass.

    The same uint64 operations as ``FeistelPermutation.permute`` run elementwise
    with each element's own domain, moduli and round keys, so the result is
    bit-for-bit that of permuting each group separately (tested), at the cost of
    one network over all elements instead of one per permutation (a mixture
    batch draws from several (task, epoch) permutations at once).

    Args:
      perms: a sequence of ``FeistelPermutation``.
      which: int array (m,): the permutation of each element, in [0, len(perms)).
      x: int array (m,): each element's input, in [0, perms[which[i]].n).

    Returns:
      uint64 array (m,).

    Raises:
      ValueError: an input outside its permutation's domain.
    """
    x = np.asarray(x)
    which = np.asarray(which, dtype=np.int64)
    if len(perms) == 1:
        return perms[0].permute(x)
    n = np.array([p.n for p in perms], np.uint64)[which]
    if x.size and (x.min() < 0 or (x.astype(np.uint64) >= n).any()):
        bad = int(np.flatnonzero((x < 0) | (x.astype(np.uint64) >= n))[0])
        raise ValueError(f"permutation input out of range [0, {int(n[bad])}) (got {int(x[bad])})")
    a = np.array([p.a for p in perms], np.uint64)[which]
    b = np.array([p.b for p in perms], np.uint64)[which]
    keys = np.stack([p.keys for p in perms])[which]
    out = _encrypt_each(x.astype(np.uint64), a, b, keys)
    # Cycle walking, per element (a domain of 1 maps 0 to 0 and never walks).
    todo = np.flatnonzero(out >= n)
    while todo.size:
        y = _encrypt_each(out[todo], a[todo], b[todo], keys[todo])
        out[todo] = y
        todo = todo[y >= n[todo]]
    return out


def _decrypt_each(y: np.ndarray, a: int, b: int, keys: np.ndarray) -> np.ndarray:
    """``FeistelPermutation._decrypt`` with per-element round keys (uint64
    (m, ROUNDS)) over one domain Z_a x Z_b."""
    ml, mr = np.uint64(a), np.uint64(b)
    left, right = np.divmod(y, mr)
    for r in range(ROUNDS - 1, -1, -1):
        f = _mix(left ^ keys[:, r]) % mr
        left, right = (right + mr - f) % mr, left
        ml, mr = mr, ml
    return left * mr + right


def inverse_each(n: int, keys: np.ndarray, y) -> np.ndarray:
    """``FeistelPermutation(n, keys[j]).inverse(y[j])`` for every j, in one
    vectorised pass: the preimages of ``y`` under many permutations of the same
    domain [0, n) (e.g. one task's epochs), bit for bit those of ``inverse``
    (tested), with cycle walking per element.

    Args:
      n: the domain size, 1 <= n < 2**62.
      keys: uint64 array (m, ROUNDS): each element's round keys.
      y: int array (m,) with values in [0, n).

    Returns:
      uint64 array (m,).

    Raises:
      ValueError: a bad n, keys of the wrong shape, or an input outside [0, n).
    """
    perm = FeistelPermutation(n, np.zeros(ROUNDS, np.uint64))  # the domain's moduli and checks
    y = np.asarray(y)
    keys = np.asarray(keys, dtype=np.uint64)
    if keys.shape != (y.size, ROUNDS):
        raise ValueError(f"expected round keys of shape ({y.size}, {ROUNDS}) (got {keys.shape})")
    if y.size and (y.min() < 0 or y.max() >= n):
        raise ValueError(f"permutation input out of range [0, {n}) (got values in [{y.min()}, {y.max()}])")
    out = y.astype(np.uint64).reshape(-1)
    if n == 1 or not out.size:
        return out
    out = _decrypt_each(out, perm.a, perm.b, keys)
    limit = np.uint64(n)
    todo = np.flatnonzero(out >= limit)
    while todo.size:
        step = _decrypt_each(out[todo], perm.a, perm.b, keys[todo])
        out[todo] = step
        todo = todo[step >= limit]
    return out


def epoch_permutation(*, n: int, seed: int, task_key: str, epoch: int) -> FeistelPermutation:
    """The permutation of [0, n) that orders epoch ``epoch`` of a task."""
    return FeistelPermutation(n, round_keys(seed=seed, task_key=task_key, epoch=epoch))
