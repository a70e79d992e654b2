"""The Feeder: exactly-once, resumable, host-sliced batches from task caches.

Index vocabulary (used across seqcache.feeders, its tests and docs/feeder.md):

  global position p  0-based index of an example in the global stream.
  global batch B     examples per step, over all hosts.
  step s             p = s * B + r.
  row r              in [0, B): the example's row in its global batch.
  host h of H        host h owns rows [h * B / H, (h + 1) * B / H) of every step.
  task t             index of a task (cache) in mixture order, 0 <= t < T.
  ordinal k          the k-th example drawn from task t (0-based): the number of
                     positions before p assigned to the same task.
  N_t                number of examples in task t's cache.
  epoch e            e = k // N_t.
  element            k mod N_t.
  cache index i      i = perm_{seed,t,e}(k mod N_t): the record index in the task
                     cache, in cache order. Its shard s and offset in the shard
                     follow from the manifest's cumulative counts:
                     starts[s] <= i < starts[s + 1], offset = i - starts[s].

The stream is a pure function of (caches, rates, seed, B, num_epochs): the number
of hosts, threads or prefetch depth never changes it (G5), and any step is
computed directly, in O(log T + B), whatever its position (G4).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import sys
import threading
from typing import Any, Callable, Iterator, Mapping, Sequence, Union

import numpy as np

from seqcache import format as fmt
from seqcache.feeders import compat, inverse, provenance
from seqcache.feeders import state as state_lib
from seqcache.feeders.compat import check_hosts, divisors, host_counts_for  # noqa: F401 (public here too)
from seqcache.feeders.decode import decode_batch
from seqcache.feeders.reader import ClosedOnExit
from seqcache.feeders.stream import Rate, check_same_features, check_step, feature_layout, open_mixture
from seqcache.lengths import fit_lengths, sequence_lengths

THREAD_NAME_PREFIX = "seqcache-feeder"
# What ``mixture=`` takes (see ``Feeder``).
MixtureArg = Union[Mapping[str, Rate], Sequence[tuple[str, Rate]], Any]


def resolve_threads(num_threads: int | None, prefetch: int | None) -> tuple[int, int]:
    """``(num_threads, prefetch)`` with their defaults: min(4, CPUs) reader
    threads, and as many steps read ahead.

    Raises:
      ValueError: ``num_threads`` below 1 or ``prefetch`` below 0.
    """
    if num_threads is None:
        num_threads = min(4, os.cpu_count() or 1)
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1 (got {num_threads})")
    if prefetch is None:
        prefetch = num_threads
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0 (got {prefetch})")
    return num_threads, prefetch


class Prefetcher:
    """Steps computed ahead on background threads.

    ``get(step)`` returns ``compute(step)`` and keeps steps step+1 ..
    step+``depth`` (those below ``num_steps``, when it is not None) started
    on ``num_threads`` threads; a started step outside that window is
    cancelled. ``depth`` 0: every step computed by the caller. The values
    never depend on the threads or the depth.
    """

    def __init__(self, compute: Callable[[int], Any], *, num_threads: int, depth: int, num_steps: int | None):
        self._compute, self._threads, self._depth, self._num_steps = compute, num_threads, depth, num_steps
        self._lock = threading.Lock()
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    def get(self, step: int) -> Any:
        """``compute(step)``, from a thread when it was started there.

        Raises:
          RuntimeError: after ``close``; what ``compute`` raises.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("the feeder is closed")
            fut = self._futures.pop(step, None)
        self._start_after(step)
        if fut is None:
            return self._compute(step)
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            if self._closed:  # closed by another thread while this one waited
                raise RuntimeError("the feeder is closed") from None
            raise

    def _start_after(self, step: int) -> None:
        if not self._depth:
            return
        with self._lock:
            if self._closed:
                return
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self._threads, thread_name_prefix=THREAD_NAME_PREFIX)
            window = range(step + 1, step + 1 + self._depth)
            for s in list(self._futures):
                if s not in window:
                    self._futures.pop(s).cancel()
            for s in window:
                if self._num_steps is not None and s >= self._num_steps:
                    break
                if s not in self._futures:
                    self._futures[s] = self._executor.submit(self._compute, s)

    def pending(self) -> list[concurrent.futures.Future]:
        """The steps started and not yet taken."""
        with self._lock:
            return list(self._futures.values())

    def close(self) -> None:
        """Cancels the steps not started and waits for the running ones. Idempotent."""
        with self._lock:
            self._closed = True
            futures, self._futures = self._futures, {}
            executor, self._executor = self._executor, None
        for fut in futures.values():
            fut.cancel()
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)


def default_hosts() -> tuple[int, int]:
    """(host index, host count): ``jax.process_index()/process_count()`` when JAX is
    installed, else (0, 1)."""
    if "jax" in sys.modules or importlib.util.find_spec("jax") is not None:
        import jax  # optional: jax

        return int(jax.process_index()), int(jax.process_count())
    return 0, 1


def resolve_hosts(host_index: int | None, host_count: int | None) -> tuple[int, int]:
    """(h, H): the given ones, each None replaced by ``default_hosts()``'s."""
    if host_index is None or host_count is None:
        dh, dn = default_hosts()
        host_index = dh if host_index is None else host_index
        host_count = dn if host_count is None else host_count
    return host_index, host_count


class Feeder(ClosedOnExit):
    """Exactly-once, resumable batches from a task cache or a mixture of them.

    Args (keyword-only):
      cache: one task cache folder (``CACHE_DIR/<task>/<split>``, with manifest.json).
      mixture: instead of ``cache``: {cache folder: rate} (or a list of pairs), a
        rate being a number > 0 or a callable ``num_examples -> rate`` such as
        ``rate_num_examples(maximum=, temperature=, scale=)``; or a
        ``seqcache.tasks.Mixture`` together with ``caches_root`` and ``split``
        (each task resolves to ``caches_root/<task>/<split>``; tasks with rate 0 are
        left out; a Mixture with a ``schedule`` is read as a schedule, below).
        Rates are relative; see ``mixing.integer_weights`` for how they
        become exact integer weights. Changing rates needs no rebuild of caches.
        Or a schedule, rates that change at given steps: {step: {cache folder:
        rate}}, e.g. ``{0: {a: 1, b: 1}, 10_000: {a: 3, b: 1}}`` (the first stage
        at step 0; a cache left out of a stage, or given rate 0, is not read in
        it; each task's ordinal continues across a change: see
        ``seqcache.feeders.schedule``).
      caches_root, split: see ``mixture``.
      global_batch_size: B, rows per step over all hosts.
      sequence_length: L, tokens per row: a mapping ``{feature: L}``, or an int
        (``seqcache.lengths.sequence_lengths``: the feature's). Default: the caches' own
        (``seqcache.lengths.fit_lengths``: the length a cache is packed or
        trimmed to, else its longest example; the longest over a mixture). A
        given L only cuts rows shorter; one longer than a packed or trimmed
        cache's is refused.
      host_index, host_count: h and H (default: ``jax.process_index()`` /
        ``jax.process_count()`` when JAX is installed, else 0 / 1). H must divide B.
      seed: in [0, 2^64); selects the per-epoch orders.
      num_epochs: None (repeat forever) or E >= 1: every example of every task is
        read exactly E times, then iteration stops (see ``stream`` for the rule).
      start_step: the step iteration starts from.
      feature: the token feature to feed (e.g. "targets"); packed caches also
        store ``<feature>_segment_ids``, from which the batches' positions are
        derived (``positions_from_segment_ids``).
      num_threads: reader threads (default min(4, CPU count)).
      prefetch: steps prepared ahead of the last requested one (default num_threads).

    Attributes (besides the arguments'):
      sequence_length: dict str -> int, ``{feature: L}``: the tokens per row
        the feeder reads (given or the caches' own), e.g. ``{"targets": 1024}``;
        ``feeder.sequence_length[feeder.feature]`` is L.

    Batches (``get_batch(step)`` and iteration) are dicts of numpy arrays for this
    host's B / H rows (R = B / H):

      "<feature>"               int32 (R, L): tokens, 0 after the end of the record.
      "<feature>_segment_ids"   int32 (R, L): 0 = padding; 1 on every token of an
                                unpacked record; the packed segment ids otherwise.
      "<feature>_positions"     int32 (R, L): position of the token in its segment.
      "<feature>_loss_weights"  float32 (R, L): 1 on tokens, 0 on padding tokens and
                                on padding rows.
      "task_index"              int32 (R,): t, or -1 on a padding row.
      "cache_index"             int64 (R,): i, or -1 on a padding row.
      "epoch"                   int64 (R,): e, or -1 on a padding row.

    The arrays are read-only (``arr.flags.writeable`` is False): arrays that are
    the same in every batch (the segment ids, positions and loss weights of
    unpacked rows that fill the sequence length) are shared between batches
    rather than rebuilt. Copy an array (``np.array(a)``) to modify it in place.

    Padding rows (only in finite runs, once a task is exhausted) have zeros
    everywhere and zero loss weight. Records longer than L are truncated to L
    (like seqio's trimming), packed rows too.

    Raises:
      seqcache.lengths.SequenceLengthError (a ValueError): an L longer than the
        caches' own, or none given where a cache records none.
      ValueError: bad arguments (host count that does not divide the global batch,
        more hosts than rows, unknown feature, bad rates, ...); a mixture whose
        caches have different features (``stream.check_same_features``: the
        message names every cache's task and features).
      seqcache.format.CacheError: a cache is missing, incomplete or inconsistent.
    """

    def __init__(self, *, cache: str | os.PathLike | None = None, mixture: MixtureArg = None,
                 caches_root: str | os.PathLike | None = None, split: str = "train", global_batch_size: int,
                 sequence_length: Mapping[str, int] | int | None = None, host_index: int | None = None,
                 host_count: int | None = None, seed: int = 0, num_epochs: int | None = None, start_step: int = 0,
                 feature: str = "targets", num_threads: int | None = None, prefetch: int | None = None):
        host_index, host_count = resolve_hosts(host_index, host_count)
        check_hosts(global_batch_size, host_index, host_count)
        asked = sequence_lengths(sequence_length, [feature])  # malformed: refused before the caches are opened
        if not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**64:
            raise ValueError(f"seed must be an integer in [0, 2**64) (got {seed=})")
        if num_epochs is not None and (not isinstance(num_epochs, (int, np.integer)) or num_epochs < 1):
            raise ValueError(f"num_epochs must be None (forever) or an integer >= 1 (got {num_epochs!r})")
        num_threads, prefetch = resolve_threads(num_threads, prefetch)

        self.global_batch_size = int(global_batch_size)
        self.host_index = int(host_index)
        self.host_count = int(host_count)
        self.seed = int(seed)
        self.num_epochs = None if num_epochs is None else int(num_epochs)
        self.feature = feature
        self.num_threads = int(num_threads)
        self.prefetch = int(prefetch)
        self.rows_per_host = self.global_batch_size // self.host_count
        self.first_row = self.host_index * self.rows_per_host

        opened = open_mixture(cache=cache, mixture=mixture, caches_root=caches_root, split=split)
        self.mixture_name = opened.name
        self.paths, self.readers, self.rates, self.weights = opened.paths, opened.readers, opened.rates, opened.weights
        self.schedule = opened.stages  # None, or [{"step", "rates", "weights"}] (see ``feeders/schedule.py``)
        try:
            # Where the caches were opened, as a state records them: resolved once here
            # (a relative path against the working directory of the opening).
            self._locations = [state_lib.location(p) for p in self.paths]
            check_same_features(self.paths, self.readers)
            self._layouts = [feature_layout(r, self.feature) for r in self.readers]
            manifests = {p: r.manifest for p, r in zip(self.paths, self.readers)}
            self.sequence_length: dict[str, int] = fit_lengths(asked, manifests, [feature])
            self.stream = opened.stream(seed=self.seed, num_epochs=self.num_epochs,
                                        global_batch_size=self.global_batch_size)
        except BaseException:
            for r in self.readers:
                r.close()
            raise
        self.num_steps = self.stream.num_steps(self.global_batch_size)
        self._step = 0
        self._lock = threading.Lock()
        self._prefetch = Prefetcher(self._compute, num_threads=self.num_threads, depth=self.prefetch,
                                    num_steps=self.num_steps)
        self._read_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._closed = False
        self._length = self.sequence_length[feature]  # L, the row length of every batch array
        self._ar = np.arange(self._length, dtype=np.int32)
        self._constants: tuple | None = None
        try:
            self.step = start_step
        except BaseException:
            self.close()
            raise

    # --- configuration ---------------------------------------------------------

    @property
    def step(self) -> int:
        """The next step iteration returns; assigning it moves the iterator."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        value = int(value)
        self._check_step(value, allow_end=True)
        with self._lock:
            self._step = value

    @property
    def position(self) -> int:
        """The global position of the next example iteration returns (step * B)."""
        return self._step * self.global_batch_size

    def _check_step(self, step: int, *, allow_end: bool = False) -> None:
        check_step(step, global_batch_size=self.global_batch_size, num_steps=self.num_steps,
                   num_epochs=self.num_epochs, allow_end=allow_end)

    # --- batches ---------------------------------------------------------------

    def _compute(self, step: int) -> dict[str, np.ndarray]:
        b_host, length, f = self.rows_per_host, self._length, self.feature
        positions = step * self.global_batch_size + self.first_row + np.arange(b_host, dtype=np.int64)
        loc = self.stream.locate(positions)
        names = (f, f"{f}_segment_ids", f"{f}_positions", f"{f}_loss_weights")
        valid = loc.valid
        all_valid = bool(valid.all())
        if len(self.readers) == 1:
            tasks = [0] if valid.any() else []  # no np.unique for one task
        else:
            tasks = np.unique(loc.task[valid]).tolist()
        if not tasks:  # every row is padding
            out = _zeros(names, b_host, length)
        elif len(tasks) == 1 and all_valid:  # one task fills the host batch
            out = dict(zip(names, self._read_and_decode(tasks[0], loc.cache_index)))
        else:
            out = self._compute_mixed(loc, tasks, names)
        for key, arr in (("task_index", loc.task), ("cache_index", loc.cache_index), ("epoch", loc.epoch)):
            out[key] = arr if all_valid else np.where(valid, arr, -1)  # -1 on padding rows
        out["task_index"] = out["task_index"].astype(np.int32, copy=False)
        for arr in out.values():
            arr.flags.writeable = False
        return out

    def _compute_mixed(self, loc, tasks: list[int], names) -> dict[str, np.ndarray]:
        """The rows of a step from several tasks (or with padding rows): every task's
        reads issued together and, for one shared record layout, decoded in one batch."""
        b_host, length = self.rows_per_host, self._length
        rows_of = {t: np.flatnonzero((loc.task == t) & loc.valid) for t in tasks}
        records: list = [b""] * b_host
        # Every task's read in flight at once (the first on this thread): ArrayRecord's reads overlap.
        pool = self._read_pool_or_none()
        pending = [(t, pool.submit(self.readers[t].read, loc.cache_index[rows_of[t]]) if pool and j else None)
                   for j, t in enumerate(tasks)]
        try:
            for t, fut in pending:
                got = fut.result() if fut is not None else self.readers[t].read(loc.cache_index[rows_of[t]])
                for r, rec in zip(rows_of[t].tolist(), got):
                    records[r] = rec
        finally:
            for _, fut in pending:
                if fut is not None:
                    fut.cancel()
        layouts = {self._layout_key(t) for t in tasks}
        if len(layouts) == 1 and loc.valid.all():
            try:
                return dict(zip(names, self._decode_block(tasks[0], records, loc.cache_index)))
            except fmt.CacheError:
                pass  # decoded again per task below, so that the error names the task's cache and record
        out = _zeros(names, b_host, length)
        for t in tasks:
            rows = rows_of[t]
            block = self._decode_block(t, [records[r] for r in rows.tolist()], loc.cache_index[rows])
            for name, arr in zip(names, block):
                out[name][rows] = arr
        return out

    def _layout_key(self, task: int) -> tuple:
        """Tasks with equal keys decode with the same ``decode_batch`` call."""
        return tuple(self.readers[task].features), tuple(self._layouts[task].items())

    def _read_sorted(self, task: int, cache_index: np.ndarray) -> tuple[list[bytes], np.ndarray | None]:
        return self.readers[task].read_sorted(cache_index)  # a seam: benchmarks/feeder.py answers it from memory

    def _read_and_decode(self, task: int, cache_index: np.ndarray):
        """Rows ``cache_index`` of task ``task``, read and decoded in ascending index
        order, put in row order by the decoder's copy: 4 arrays (n, L)."""
        records, order = self._read_sorted(task, cache_index)
        if order is None:
            return self._decode_block(task, records, cache_index)
        rows = np.empty_like(order)
        rows[order] = np.arange(order.size)
        return self._decode_block(task, records, cache_index[order], rows=rows)

    def _decode_block(self, task: int, records: Sequence[bytes], cache_index: np.ndarray,
                      rows: np.ndarray | None = None):
        """Decodes records laid out as task ``task``'s: 4 arrays (n, L), row r
        from records[rows[r]] when ``rows`` is given (``decode_batch``)."""
        reader, layout, length = self.readers[task], self._layouts[task], self._length
        wanted = {layout["tokens"]: np.int32}
        if layout["segment_ids"]:
            wanted[layout["segment_ids"]] = np.int32
        try:
            values, counts = decode_batch(reader.features, records, length=length, outputs=wanted, rows=rows)
        except fmt.CacheError:
            # Re-decode record by record so the error names the shard and record.
            for rec, i in zip(records, cache_index.tolist()):
                reader.decode(rec, i)
            raise
        tokens = values[layout["tokens"]]
        n = tokens.shape[0]
        if layout["segment_ids"]:
            seg = values[layout["segment_ids"]]
            pos = positions_from_segment_ids(seg)
            weights = (seg != 0).astype(np.float32)
            return tokens, seg, pos, weights
        keep = np.minimum(counts[layout["tokens"]], length)
        if (keep == length).all():
            seg, pos, weights = self._full_rows(n)
        else:
            mask = self._ar[None, :] < keep[:, None]
            seg = mask.astype(np.int32)
            pos = self._ar * seg
            weights = mask.astype(np.float32)
        return tokens, seg, pos, weights

    def _full_rows(self, n: int):
        """Segment ids, positions and loss weights of n <= B/H full unpacked rows:
        built once, shared read-only by every batch."""
        if self._constants is None:
            shape = (self.rows_per_host, self._length)
            seg = np.ones(shape, np.int32)
            pos = np.empty(shape, np.int32)
            pos[:] = self._ar
            weights = np.ones(shape, np.float32)
            for a in (seg, pos, weights):
                a.flags.writeable = False
            self._constants = (seg, pos, weights)
        return tuple(a[:n] for a in self._constants)

    def _read_pool_or_none(self):
        """The threads that read the other tasks of a mixed step (None for one task)."""
        if len(self.readers) == 1:
            return None
        with self._pool_lock:
            if self._closed:
                raise RuntimeError("the feeder is closed")
            if self._read_pool is None:
                self._read_pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=min(len(self.readers) - 1, 2 * self.num_threads),
                    thread_name_prefix=THREAD_NAME_PREFIX + "-read")
            return self._read_pool

    def get_batch(self, step: int) -> dict[str, np.ndarray]:
        """This host's rows of global batch ``step`` (see the class docstring for
        keys, shapes and dtypes). Random access: any step, in any order, at the
        same cost. Prepares steps step+1 .. step+prefetch in the background.

        Raises:
          ValueError: a negative step, or a step past the end of a finite run.
          RuntimeError: the feeder is closed.
        """
        step = int(step)
        self._check_step(step)
        with self._lock:
            if self._closed:
                raise RuntimeError("the feeder is closed")
        return self._prefetch.get(step)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        step = self.step
        if self.num_steps is not None and step >= self.num_steps:
            raise StopIteration
        batch = self.get_batch(step)
        self.step = step + 1
        return batch

    # --- state -----------------------------------------------------------------

    def state(self) -> dict:
        """A small JSON-serialisable dict: everything needed to resume (G4). A
        cache is identified by its fingerprint; its absolute path says where it was."""
        state = {
            "kind": state_lib.STATE_KIND,
            "version": state_lib.STATE_VERSION if self.schedule is None else state_lib.SCHEDULE_STATE_VERSION,
            "cache_format_version": fmt.RECORD_FORMAT_VERSION,
            "mixture": state_lib.mixture_entries(self._locations, self.rates, self.weights, self.readers),
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "sequence_length": dict(self.sequence_length),
            "feature": self.feature,
            "num_epochs": self.num_epochs,
            "position": self.position,
        }
        if self.schedule is not None:  # the whole schedule, stages ahead included
            state["schedule"] = [dict(step=st["step"], rates=list(st["rates"]), weights=list(st["weights"]))
                                 for st in self.schedule]
        return state

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Moves this feeder to a saved state's position after checking that the
        state denotes this feeder's stream: the same caches (by fingerprint, in
        mixture order, wherever they are now), rates, seed, global batch size,
        sequence length, feature and number of epochs. With a schedule (in the
        state or here) this feeder may extend the stream: it keeps every stage
        started before the saved step and the state's caches in order, and may
        change later stages and add caches (ordinals from 0).

        Raises:
          FeederStateError (a ValueError): every refusal of ``state``: a
            malformed state (``state.check_state``); the first difference, with
            both values, e.g. "the cache at PATH was rebuilt (fingerprint A, the
            state was saved with fingerprint B)", or "the mixture schedule
            rewrites the past at step S: ..."; a position past the end of a
            finite run; a ``ConvertedFeeder``'s state (restore it with
            ``ConvertedFeeder``).
        """
        state = state_lib.read_state(state)
        state_lib.refuse_converter_state(state)
        current = self.state()
        if state.get("schedule") is None and self.schedule is None:
            diff = state_lib.stream_difference(state, current)
        else:
            diff = state_lib.schedule_difference(state, current)
        if diff:
            raise state_lib.FeederStateError(diff + state_lib.RESTORE_HINT)
        step = state["position"] // self.global_batch_size
        try:
            self._check_step(step, allow_end=True)
        except ValueError as e:
            raise state_lib.FeederStateError(f"feeder state has position={state['position']} "
                                             f"(global_batch_size={self.global_batch_size}): {e}") from None
        self.step = step

    _UNSET = object()

    @classmethod
    def restore(cls, state: Mapping[str, Any], *, host_index: int | None = None, host_count: int | None = None,
                num_threads: int | None = None, prefetch: int | None = None, cache: str | os.PathLike | None = None,
                mixture: MixtureArg = None, caches_root: str | os.PathLike | None = None, split: str = "train",
                seed: int | None = None, global_batch_size: int | None = None,
                sequence_length: Mapping[str, int] | int | None = None, feature: str | None = None,
                num_epochs: Any = _UNSET) -> "Feeder":
        """A feeder positioned where ``state`` was saved: the same global stream,
        for any host count that divides the global batch (G4, G5).

        The caches are looked for at the paths stored in the state, or at
        ``cache=``/``mixture=`` (with ``caches_root=``/``split=``, as for the
        constructor): caches moved, copied or reached by another path are
        accepted when their fingerprints (and rates, in mixture order) are the
        state's. ``seed``, ``global_batch_size``, ``sequence_length``,
        ``feature`` and ``num_epochs`` are optional expectations: a state that
        differs is refused (``sequence_length``: an int or {feature: L}, for
        the state's feature). A state of an earlier release, whose sequence
        length is an int, restores as well (``state.read_state``).

        Raises:
          FeederStateError (a ValueError): every refusal of ``state``: a
            malformed state or another state/format version; a cache whose
            fingerprint differs ("the cache at PATH was rebuilt (fingerprint A,
            the state was saved with fingerprint B)"); other rates, caches or
            mixture order; a difference from an expectation (both values named);
            a feature or sequence length the caches cannot give; a position past
            the end of a finite run; a host count that does not divide the saved
            global batch (the message lists host counts that do); a
            ``ConvertedFeeder``'s state (restore it with
            ``ConvertedFeeder.restore`` or ``restore_feeder``).
          ValueError: a bad ``host_index``, ``num_threads`` or ``prefetch``.
          seqcache.format.CacheError: a cache cannot be opened where it is looked for.
        """
        state = state_lib.read_state(state)
        state_lib.refuse_converter_state(state)
        if sequence_length is not None:  # an int, or {feature: L}: the expectation for the state's feature
            sequence_length = sequence_lengths(sequence_length, [feature or state["feature"]])
        own = state["sequence_length"].get(state["feature"])  # None: a damaged state, refused by set_state
        return restore_with(state, lambda **arguments: cls(sequence_length=own, feature=state["feature"],
                                                          **arguments),
                            expected=dict(seed=seed, global_batch_size=global_batch_size, feature=feature,
                                          sequence_length=sequence_length, num_epochs=num_epochs),
                            cache=cache, mixture=mixture, caches_root=caches_root, split=split,
                            host_index=host_index, host_count=host_count, num_threads=num_threads, prefetch=prefetch)

    @classmethod
    def restore_file(cls, path: str | os.PathLike, **kwargs: Any) -> "Feeder":
        """``restore`` of the state saved at ``path``: a JSON file (``json.dump``
        of ``state()``) or a checkpoint step folder (``<step>/feeder/metadata``,
        as ``seqcache train`` and ``feeder_save_args`` save it). The file is read
        by ``seqcache.feeders.state.load_state``: within bounds (16 MiB, depth,
        values, keys and numbers), no key twice, one line naming the file for
        what it cannot read. The safe way to restore a state you did not just
        make: ``json.load`` keeps the last of two equal keys without a word, and
        ``restore(dict)`` cannot know there were two. ``kwargs``: ``restore``'s.

        Raises:
          FeederStateError (a ValueError): the file cannot be read (naming it,
            and the line and column of text that is not JSON), and what
            ``restore`` refuses.
          ValueError, seqcache.format.CacheError: as ``restore``.
        """
        return cls.restore(state_lib.load_state(path), **kwargs)

    # --- provenance --------------------------------------------------------------

    def which(self, step: int, row: int, *, tokens: bool = True) -> dict:
        """Where row ``row`` of global batch ``step`` comes from (G6); see
        ``seqcache.feeders.provenance.which``."""
        return provenance.which(self.stream, self.paths, global_batch_size=self.global_batch_size, step=step,
                                row=row, feature=self.feature, tokens=tokens)

    def trace(self, steps, *, text: bool = False):
        """Provenance of whole steps, every row of the global batch (not only this
        host's): ``seqcache.feeders.provenance.trace``'s pyarrow Table, one row
        per (step, row, segment). ``steps``: a range or an iterable of steps."""
        return provenance.trace(self.stream, self.paths, global_batch_size=self.global_batch_size, steps=steps,
                                feature=self.feature, text=text)

    def where(self, *, cache_index: int | None = None, task: int | str | None = None, source: str | None = None,
              until_step: int | None = None, epochs=None) -> list[dict]:
        """Where an example appears in this run, the inverse of ``which``, with
        this feeder's host count: ``seqcache.feeders.inverse.where`` (its
        arguments, result and errors). The example is ``cache_index`` of
        ``task`` (only needed in a mixture), or every example holding a segment
        of ``source`` (``"FILE:LINE"``, ``"FILE:row=N"``, ...)."""
        return inverse.where(self.stream, self.paths, global_batch_size=self.global_batch_size,
                             host_count=self.host_count, until_step=until_step, cache_index=cache_index, task=task,
                             source=source, epochs=epochs)

    # --- lifetime ----------------------------------------------------------------

    def close(self) -> None:
        """Stops the reader threads (waiting for running reads) and closes the
        shard readers. Idempotent; the feeder cannot be used afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._prefetch.close()
        with self._pool_lock:
            read_pool, self._read_pool = self._read_pool, None
        if read_pool is not None:
            read_pool.shutdown(wait=True, cancel_futures=True)
        for r in self.readers:
            r.close()

    def __repr__(self) -> str:
        return (
            f"Feeder({len(self.paths)} task(s), B={self.global_batch_size}, L={self.sequence_length}, "
            f"host {self.host_index}/{self.host_count}, seed={self.seed}, num_epochs={self.num_epochs}, step={self._step})"
        )


def restore_with(state: Mapping[str, Any], open_feeder, *, expected: Mapping[str, Any], cache, mixture, caches_root,
                 split, host_index, host_count, **threads: Any):
    """``Feeder.restore`` of a checked ``state`` with ``open_feeder(**arguments)``
    (the caches' location, the state's global batch size, seed and epochs, hosts
    and threads) for the feeder. ``expected``: the values not None, and
    ``num_epochs`` unless ``Feeder._UNSET`` (None there means forever).

    Raises:
      as ``Feeder.restore``; an IncompleteCacheError where the state says adds
      that moved caches are passed with cache= or mixture=.
    """
    state_lib.compare(state, {key: value for key, value in expected.items()
                              if value is not (Feeder._UNSET if key == "num_epochs" else None)})
    host_index, host_count = resolve_hosts(host_index, host_count)
    # A state's stream has its global batch: a host count must divide it.
    compat.check_hosts(state["global_batch_size"], host_index, host_count, saved=True)
    resolve_threads(threads.get("num_threads"), threads.get("prefetch"))  # the caller's own arguments
    moved = cache is not None or mixture is not None
    where = (dict(cache=cache, mixture=mixture, caches_root=caches_root, split=split) if moved
             else {"mixture": state_lib.mixture_argument(state)})
    try:
        feeder = open_feeder(**where, global_batch_size=state["global_batch_size"], seed=state["seed"],
                             num_epochs=state["num_epochs"], host_index=host_index, host_count=host_count, **threads)
    except fmt.IncompleteCacheError as e:
        # The caches may have moved (a damaged cache is reported as it is).
        if moved:
            raise
        raise type(e)(
            f"{e}. The feeder state names its caches by the paths they had when it was saved; if they moved, "
            "pass their current locations with cache= or mixture= (matched by fingerprint)"
        ) from e
    except state_lib.FeederStateError:
        raise
    except ValueError as e:
        # The hosts and threads are checked above: what is left is the state's
        # own values (feature, sequence length, mixture, schedule, epochs) that
        # the caches cannot give. The message is the constructor's, as
        # ``seqcache which`` prints it for the same state.
        raise state_lib.FeederStateError(str(e)) from None
    try:
        feeder.set_state(state)
    except BaseException:
        feeder.close()
        raise
    return feeder


def _zeros(names, rows: int, length: int) -> dict[str, np.ndarray]:
    """All-padding arrays for (tokens, segment ids, positions, loss weights)."""
    dtypes = (np.int32, np.int32, np.int32, np.float32)
    return {name: np.zeros((rows, length), dt) for name, dt in zip(names, dtypes)}


def positions_from_segment_ids(segment_ids: np.ndarray) -> np.ndarray:
    """Positions restarting at 0 at each segment (and at each row), 0 on padding.

    Packed caches store no positions (docs/cache-format.md, "Positions"): a
    position is the token's offset from the start of its run of equal segment
    ids, so the feeder derives it here, in one pass over the flattened
    (rows * L) ids: a segment starts where the id changes or a row starts, and
    each token's position is its index minus its segment's start.

    Args:
      segment_ids: int (rows, L); 0 = padding.

    Returns:
      int32 (rows, L).
    """
    seg = np.asarray(segment_ids)
    rows, length = seg.shape
    flat = seg.reshape(-1)
    n = flat.size
    if n == 0:
        return np.zeros(seg.shape, np.int32)
    starts = np.empty(n, bool)
    starts[0] = True
    np.not_equal(flat[1:], flat[:-1], out=starts[1:])
    starts[::length] = True
    first = np.flatnonzero(starts)
    index = np.int32 if n < 2**31 else np.int64
    pos = np.arange(n, dtype=index)
    pos -= np.repeat(first.astype(index, copy=False), np.diff(first, append=n))
    pos *= flat != 0
    return pos.reshape(rows, length).astype(np.int32, copy=False)
