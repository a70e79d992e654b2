"""Full verification of a cache on disk: counts, checksums and decodability.

``open``-time checks (``seqcache.format.check_shard_files``) are cheap: sizes and
presence. ``verify_cache`` reads every byte: it recomputes each shard's sha256,
counts its records and decodes every record, and reports every problem, each
naming the file and the expected and actual value.
"""

from __future__ import annotations

import dataclasses
import os

from seqcache import format as fmt


@dataclasses.dataclass
class ShardReport:
    file: str
    ok: bool
    problems: list[str]
    num_records: int | None = None


@dataclasses.dataclass
class VerifyReport:
    cache_dir: str
    ok: bool
    problems: list[str]
    shards: list[ShardReport]

    def to_json(self) -> dict:
        return {
            "cache_dir": self.cache_dir,
            "ok": self.ok,
            "problems": self.problems,
            "shards": [dataclasses.asdict(s) for s in self.shards],
        }


def _check_file(cache_dir, name, num_bytes, sha256, num_records, features, decode_batch) -> ShardReport:
    from array_record.python.array_record_module import ArrayRecordReader

    path = os.path.join(cache_dir, name)
    problems = []
    if not os.path.exists(path):
        return ShardReport(name, False, [f"{path}: missing (expected {num_bytes} bytes, {num_records} records)"])
    size = os.path.getsize(path)
    if size != num_bytes:
        problems.append(f"{path}: size {size} bytes, expected {num_bytes}")
    actual_sha = fmt.file_sha256(path)
    if actual_sha != sha256:
        problems.append(f"{path}: sha256 {actual_sha}, expected {sha256}")
    count = None
    try:
        reader = ArrayRecordReader(path, "readahead_buffer_size:0")
    except Exception as e:  # the ArrayRecord library raises plain RuntimeError/ValueError
        problems.append(f"{path}: not a readable ArrayRecord file: {e}")
        return ShardReport(name, False, problems)
    try:
        count = reader.num_records()
        if count != num_records:
            problems.append(f"{path}: {count} records, expected {num_records}")
        for start in range(0, count, decode_batch):
            indices = list(range(start, min(count, start + decode_batch)))
            for i, record in zip(indices, reader.read(indices)):
                fmt.decode_example(features, record, where=f"{path} record {i}")
    except fmt.CacheError as e:
        problems.append(str(e))
    except Exception as e:
        problems.append(f"{path}: cannot read records: {e}")
    finally:
        try:
            reader.close()
        except Exception as e:  # a corrupt file can fail again on close
            if not problems:
                problems.append(f"{path}: corrupt ArrayRecord file: {e}")
    return ShardReport(name, not problems, problems, count)


def verify_cache(cache_dir: str, *, decode_batch: int = 1024) -> VerifyReport:
    """Verifies every shard of the cache at ``cache_dir``.

    Returns:
      A ``VerifyReport`` whose ``problems`` name each bad file with the expected
      and actual value (size, sha256, record count, or the undecodable record).

    Raises:
      CacheError / IncompleteCacheError: the manifest is missing or invalid (then
      nothing else can be checked).
    """
    manifest = fmt.read_manifest(cache_dir)
    shards = []
    for s in manifest.shards:
        shards.append(_check_file(cache_dir, s.file, s.num_bytes, s.sha256, s.num_records, manifest.features, decode_batch))
        shards.append(
            _check_file(cache_dir, s.provenance_file, s.provenance_num_bytes, s.provenance_sha256, s.num_records,
                        fmt.PROVENANCE_FEATURES, decode_batch)
        )
    problems = [p for s in shards for p in s.problems]
    declared = manifest.raw.get("num_examples")
    if declared is not None and declared != manifest.num_examples:
        problems.append(
            f"{os.path.join(cache_dir, fmt.MANIFEST_NAME)}: num_examples {declared}, shards sum to {manifest.num_examples}"
        )
    for name, desc in manifest.vocabularies.items():
        if "file" in desc and not os.path.exists(os.path.join(cache_dir, desc["file"])):
            problems.append(f"{os.path.join(cache_dir, desc['file'])}: vocabulary file of feature {name!r} is missing")
    return VerifyReport(cache_dir, not problems, problems, shards)
