"""A reader is pinned to the manifest it opened (docs/cache-format.md, "Readers
and rebuilds").

The cache here is rebuilt in place (``overwrite=True``, what ``seqcache build
--overwrite`` runs) from the same lines with another preprocessor that upper-cases
them: the same shuffle keys, so every shard has the same record count and byte
size, and only the bytes of the records (and the fingerprint) differ. A reader
that opened the old cache reads, after the rebuild, only old rows (from the
shard files it had open) or fails with one line saying the cache was rebuilt;
never a row of the new cache.
"""

from __future__ import annotations

import os
import pickle
import shutil

import numpy as np
import pytest

from seqcache import format as fmt
from seqcache import tasks
from seqcache.feeders import CacheDataSource, Feeder
from seqcache.feeders.reader import CacheReader, CacheRebuiltError
from seqcache.pipelines import BuildConfig, build_task, writer
from testsupport import byte_task, write_lines

# 16 shards: the first 3 steps (12 rows: step 0 and the 2 prefetched) leave at
# least 4 shards unopened, whatever order the cache's path gives the stream.
SHARDS, B, L = 16, 4, 32


def _as_is(example, ctx):
    return example


def _upper(example, ctx):
    return {**example, "text": example["text"].upper()}  # ASCII lines: the same number of bytes


def _task(pattern, *, upper: bool):
    step = tasks.FunctionPreprocessor(_upper if upper else _as_is, name="upper" if upper else "as_is")
    return byte_task("lines", tasks.TextLineSource(pattern, on_error={"empty": "skip"}), first=[step])


@pytest.fixture
def built(tmp_path, corpora):
    """``(build, cache)``: ``build(upper)`` (re)builds the cache at ``cache`` from
    the first 400 lines of tinyshakespeare, in place (overwrite)."""
    lines = corpora.shakespeare_lines(400)
    assert all(line.isascii() for line in lines)
    write_lines(tmp_path / "in" / "play.txt", lines)
    pattern, root = str(tmp_path / "in" / "*.txt"), str(tmp_path / "caches")

    def build(upper: bool) -> str:
        return build_task(_task(pattern, upper=upper), cache_dir=root, config=BuildConfig(num_shards=SHARDS),
                          overwrite=True).cache_dir

    return build, build(False)


def _rebuild(build, cache) -> tuple[fmt.Manifest, fmt.Manifest]:
    """Rebuilds ``cache`` upper-cased; returns (old, new) manifests, checked to
    differ in fingerprint only, not in any shard's record count or byte size."""
    old = fmt.read_manifest(cache)
    assert build(True) == cache
    new = fmt.read_manifest(cache)
    assert new.fingerprint != old.fingerprint
    for key in ("num_records", "num_bytes", "provenance_num_bytes"):
        assert [getattr(s, key) for s in new.shards] == [getattr(s, key) for s in old.shards], key
    return old, new


def _copy_aside(cache, tmp_path) -> str:
    """A copy of the cache as it is now: what its old rows are."""
    aside = str(tmp_path / "aside" / "lines" / "train")
    shutil.copytree(cache, aside)
    return aside


def _open_data_shards(reader: CacheReader) -> list[int]:
    return [s for s, r in enumerate(reader._data) if r is not None]


def _check_one_line(error: CacheRebuiltError, cache: str, old: fmt.Manifest, new: fmt.Manifest | None) -> None:
    text = str(error)
    assert "\n" not in text and isinstance(error, fmt.CacheError)
    assert text.startswith(f"{cache} was rebuilt")
    assert old.fingerprint[:12] in text
    if new is not None:
        assert f"{old.fingerprint[:12]}… → {new.fingerprint[:12]}…" in text


def _same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def _feeder(cache, **kw) -> Feeder:
    return Feeder(cache=cache, global_batch_size=B, sequence_length=L, host_index=0, host_count=1, num_epochs=1, **kw)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_feeder_running_across_a_rebuild_reads_old_rows_or_says_the_cache_was_rebuilt(built, tmp_path, prefetch):
    build, cache = built
    aside = _copy_aside(cache, tmp_path)
    with _feeder(cache, prefetch=prefetch) as feeder, _feeder(aside, prefetch=0) as old_rows:
        assert _same(feeder.get_batch(0), old_rows.get_batch(0))
        for pending in feeder._prefetch.pending():
            pending.result()  # the prefetched steps read before the rebuild, not during it
        opened = _open_data_shards(feeder.readers[0])
        assert 0 < len(opened) < SHARDS  # some shards open, some not
        old, new = _rebuild(build, cache)
        with _feeder(cache, prefetch=0) as new_rows:
            differ = [s for s in range(1, feeder.num_steps) if not _same(new_rows.get_batch(s), old_rows.get_batch(s))]
        assert len(differ) > feeder.num_steps // 2  # the new cache's rows are not the old ones

        read, error = 0, None
        for step in range(1, feeder.num_steps):
            try:
                batch = feeder.get_batch(step)
            except CacheRebuiltError as e:
                error = e
                break
            assert _same(batch, old_rows.get_batch(step)), f"step {step} is not the old cache's"
            read += 1
    # The old shard files are gone with the old cache: the first read of a shard
    # not open before the rebuild fails, with one line.
    assert error is not None and read < feeder.num_steps - 1
    _check_one_line(error, cache, old, new)


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_a_reader_keeps_its_open_shards_and_refuses_the_others(built, tmp_path, monkeypatch, exchange):
    """Whichever way the rebuild is published: the shards read before it stay
    the old ones (data and provenance), the others are refused, then and later."""
    if not exchange:
        monkeypatch.setattr(writer, "_exchange", lambda a, b: False)
    build, cache = built
    aside = _copy_aside(cache, tmp_path)
    reader = CacheReader(cache, open_shards=False)
    with reader, CacheReader(aside) as want:
        starts = reader.shard_starts
        first = list(range(int(starts[0]), int(starts[1])))
        assert reader.read(first) == want.read(first)
        assert reader.read_provenance_records(first) == want.read_provenance_records(first)
        old, new = _rebuild(build, cache)
        with CacheReader(cache) as now:
            assert now.read(first) != want.read(first)
        assert reader.read(first) == want.read(first)  # the open shard: the old file
        assert reader.read_provenance_records(first) == want.read_provenance_records(first)
        third = int(starts[3])
        for read in (reader.read, reader.read_provenance_records, reader.read):
            with pytest.raises(CacheRebuiltError) as raised:
                read([third])
            _check_one_line(raised.value, cache, old, new)
        assert _open_data_shards(reader) == [0]


def test_a_removed_cache_is_refused_with_one_line(built):
    _, cache = built
    old = fmt.read_manifest(cache)
    with CacheReader(cache, open_shards=False) as reader:
        reader.read([0])
        writer.remove_cache_tree(cache)  # what an object store publish does first
        with pytest.raises(CacheRebuiltError, match=r"was rebuilt or removed .*\(fingerprint [0-9a-f]{12}…; now: "
                                                    r"it has no manifest\.json\)") as raised:
            reader.read([len(reader) - 1])
    _check_one_line(raised.value, cache, old, None)


def test_a_manifest_rewritten_with_the_same_fingerprint_is_the_same_cache(built, tmp_path):
    """Another manifest file of the same fingerprint (the same inputs, so the same
    shard bytes) is the cache the reader opened."""
    _, cache = built
    with CacheReader(cache, open_shards=False) as reader, CacheReader(_copy_aside(cache, tmp_path)) as want:
        path = os.path.join(cache, fmt.MANIFEST_NAME)
        data = open(path, "rb").read()
        os.unlink(path)
        with open(path, "wb") as f:
            f.write(data)
        everything = list(range(len(reader)))
        assert reader.read(everything) == want.read(everything)


def test_a_grain_data_source_sent_to_a_worker_before_a_rebuild_never_reads_the_new_cache(built, tmp_path):
    """grain sends the data source to each worker process pickled; a worker opens
    the shards itself, lazily. One that got it before the rebuild refuses the
    new files; the source in this process holds every data shard open (it opens
    them all) and reads the old rows."""
    build, cache = built
    aside = _copy_aside(cache, tmp_path)
    source, want = CacheDataSource(cache), CacheDataSource(aside)
    try:
        assert _same(source[0], want[0])
        sent = pickle.dumps(source)
        old, new = _rebuild(build, cache)
        everything = list(range(len(source)))
        assert all(_same(a, b) for a, b in zip(source._getitems(everything), want._getitems(everything)))
        worker = pickle.loads(sent)
        with pytest.raises(CacheRebuiltError) as raised:
            worker[len(source) - 1]
        _check_one_line(raised.value, cache, old, new)
        with pytest.raises(CacheRebuiltError):
            worker._getitems(everything)
        worker.close()
    finally:
        source.close()
        want.close()


def test_the_trainers_feeder_across_a_rebuild_reads_old_rows_or_says_the_cache_was_rebuilt(built, tmp_path):
    """``seqcache train``'s data path (``training.data.make_feeder``), with its
    default prefetch."""
    from seqcache.training import data as data_lib
    from seqcache.training.config import DataConfig, TrainConfig

    build, cache = built
    aside = _copy_aside(cache, tmp_path)
    config = TrainConfig(global_batch_size=B, sequence_length=L)
    source = data_lib.resolve_source(DataConfig(task=cache), "train")
    with data_lib.make_feeder(config, source, seed=0) as feeder, \
            Feeder(cache=aside, global_batch_size=B, sequence_length=L, host_index=0, host_count=1, seed=0,
                   prefetch=0) as old_rows:
        assert _same(next(feeder), old_rows.get_batch(0))
        old, new = _rebuild(build, cache)
        steps = -(-len(old_rows.readers[0]) // B)
        error = None
        for step in range(1, steps):
            try:
                batch = next(feeder)
            except CacheRebuiltError as e:
                error = e
                break
            assert _same(batch, old_rows.get_batch(step)), f"step {step} is not the old cache's"
    assert error is not None
    _check_one_line(error, cache, old, new)


def test_a_vocabulary_model_replaced_by_a_rebuild_is_refused_as_a_rebuild(tmp_path, corpora):
    """A reader loads the stored vocabulary model when asked (``which --text``,
    converters): after a rebuild with another model, it says the cache was
    rebuilt, not that a model was damaged."""
    lines = corpora.botchan.read_text(encoding="utf-8").splitlines()
    write_lines(tmp_path / "in" / "in.txt", [line for line in lines[:200] if line.strip()])

    def build(vocab_size: int) -> str:
        model = tasks.train_sentencepiece(lines[:2000], output_path=str(tmp_path / f"m{vocab_size}.model"),
                                          vocab_size=vocab_size)
        task = tasks.Task("sp", source=tasks.TextLineSource(str(tmp_path / "in" / "in.txt")),
                          output_features={"targets": tasks.Feature(model)},
                          preprocessors=[tasks.preprocessors.rekey({"targets": "text"}),
                                         tasks.preprocessors.tokenize()])
        return build_task(task, cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=1),
                          overwrite=True).cache_dir

    cache = build(400)
    old = fmt.read_manifest(cache)
    with CacheReader(cache, open_shards=False) as reader:
        build(500)
        with pytest.raises(CacheRebuiltError) as raised:
            reader.vocabulary("targets")
    _check_one_line(raised.value, cache, old, fmt.read_manifest(cache))
