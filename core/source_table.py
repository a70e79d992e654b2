"""The per-file source table of a cache (format version 3: its own file,
``source-table.json``, which the manifest's ``source_table`` records by size
and sha256): ``SourceTable`` (columns, an entry made when asked for),
``read_source_table`` (reads and checks it, only when asked), and what a
build's manifest hands over to it (``detach_source_table``: ``sources``, the
per-file counts and the fingerprint inputs' file list).
"""

import collections.abc
import hashlib
from typing import Any, Mapping, Sequence

import msgspec

from seqcache import bounded_json, codec, fs, layout
from seqcache.codec import MANIFEST_NAME, SOURCE_TABLE_NAME, CacheError
from seqcache.manifest_entries import Source, SourceFiles, SourceTableFile, convert

_short = bounded_json.short


# Where a build's fingerprint inputs keep the file list (``Task.fingerprint``'s
# ``source``, ``FileSource.fingerprint``'s ``files``): moved to the source table file.
FINGERPRINT_FILES_KEYS = ("task", "source", "files")


class SourceTable(collections.abc.Sequence):
    """The per-file source table of a cache: entry ``i`` (``table[i]``) is
    ``{path, num_bytes?, mtime_ns?, locator?}`` of the file whose provenance
    records carry ``source_index`` i, as the ``sources`` of a format-2
    manifest; with the read step's counts per file (``examples``, records;
    ``tokens``, feature -> tokens before packing; None when not counted) and
    the value moved out of the fingerprint inputs (``fingerprint_value``).

    Held as columns (``paths``, ``num_bytes``, ``mtime_ns``, ``locators``;
    ``from_columns``), each entry made when asked for: a table of a million
    files is a few lists, not a million dicts. In format version 3 it is the
    file ``SOURCE_TABLE_NAME`` (``to_bytes``: one line of JSON, a column per
    field, ``SourceTableFile``), checked against the manifest's
    ``source_table`` by ``read_source_table``.
    """

    def __init__(self, entries: Sequence[Mapping[str, Any]] = (), *, examples: Sequence[int] | None = None,
                 tokens: Mapping[str, Sequence[int]] | None = None, fingerprint_files: Mapping[str, Any] | None = None,
                 path: str = SOURCE_TABLE_NAME, prefix: str = "", columns: Sequence[Any] | None = None):
        """``entries`` (mappings), or ``columns``: ``(paths, num_bytes,
        mtime_ns, locators)`` (``from_columns``). Raises CacheError (naming
        ``path`` and the column, after ``prefix``): counts of another length
        than the entries."""
        if columns is None:
            entries = [dict(e) for e in entries]
            columns = ([e["path"] for e in entries], *([e.get(k) for e in entries] for k in ("num_bytes", "mtime_ns")),
                       [e.get("locator") for e in entries])
        paths, sizes, times, locators = columns
        self.paths = list(paths)
        n = len(self.paths)
        # None for a column with no value; a locator shared by every file as one string.
        self.num_bytes, self.mtime_ns = ((None if c is None or all(v is None for v in c) else list(c))
                                         for c in (sizes, times))
        if locators is not None and not isinstance(locators, str):
            locators = list(locators)
            distinct = set(locators)
            locators = None if distinct <= {None} else (locators[0] if len(distinct) == 1 and n else locators)
        self.locators = locators
        self.examples = None if examples is None else list(examples)
        self.tokens = None if tokens is None else {k: list(v) for k, v in tokens.items()}
        self.fingerprint_files = None if fingerprint_files is None else dict(fingerprint_files)
        for what, values in (("num_bytes", self.num_bytes), ("mtime_ns", self.mtime_ns),
                             ("locator", None if isinstance(locators, str) else locators)):
            codec.require(values is None or len(values) == n, path,
                           f"{prefix}{what} has {len(values or ())} entries for {n} source files; rebuild the cache")
        for what, values in (("examples", self.examples), *((f"tokens.{k}", v) for k, v in (self.tokens or {}).items())):
            codec.require(values is None or len(values) == n, path,
                           f"{prefix}{what} has {0 if values is None else len(values)} entries for {n} source files "
                           "(edited or damaged); rebuild the cache")

    @classmethod
    def from_columns(cls, paths: Sequence[str], num_bytes: Sequence[int | None] | None = None,
                     mtime_ns: Sequence[int | None] | None = None, locators: "str | Sequence[str | None] | None" = None,
                     **kw) -> "SourceTable":
        """The table of files given as columns (a build's listing): ``paths``
        (str), ``num_bytes`` and ``mtime_ns`` (ints or None each, or None for
        none), ``locators`` (one for every file, a list, or None); ``kw`` as
        the constructor's. No dict per file is made."""
        return cls(columns=(paths, num_bytes, mtime_ns, locators), **kw)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        entry = {"path": self.paths[index]}
        for key, column in (("num_bytes", self.num_bytes), ("mtime_ns", self.mtime_ns)):
            if column is not None and column[index] is not None:
                entry[key] = column[index]
        locator = self.locators if isinstance(self.locators, str) or self.locators is None else self.locators[index]
        if locator is not None:
            entry["locator"] = locator
        return entry

    def __eq__(self, other) -> bool:
        if isinstance(other, SourceTable):
            return (list(self), self.examples, self.tokens) == (list(other), other.examples, other.tokens)
        return isinstance(other, list) and list(self) == other

    __hash__ = None  # mutable entries

    def __repr__(self) -> str:
        return f"SourceTable({len(self)} files)"

    @property
    def statistics(self) -> dict | None:
        """``{"examples": [...], "tokens": {feature: [...]}}`` (records, tokens;
        one per file), the former ``statistics.source_files``; None when the
        build did not count them."""
        if self.examples is None:
            return None
        return {"examples": self.examples, "tokens": self.tokens or {}}

    def fingerprint_value(self) -> Any:
        """The value of the fingerprint inputs this table holds: the list of
        ``{path, num_bytes, mtime_ns}`` of each file (``from_columns``), or the
        value stored as it was. CacheError when it holds none."""
        moved = self.fingerprint_files
        if moved is None:
            raise CacheError(f"{SOURCE_TABLE_NAME}: holds no fingerprint_files, but the manifest's "
                             "source_table.fingerprint_files says it does; rebuild the cache")
        if moved.get("from_columns") is True:
            return [{"path": p, "num_bytes": b, "mtime_ns": t} for p, b, t in self._file_rows()]
        return moved.get("value")

    def _file_rows(self):
        """``(path, num_bytes, mtime_ns)`` of each file (None where not known)."""
        nothing = [None] * len(self)
        return zip(self.paths, self.num_bytes or nothing, self.mtime_ns or nothing)

    def same_files(self, value: Any) -> bool:
        """Whether ``value`` is the list of ``{path, num_bytes, mtime_ns}`` of
        each file (what ``fingerprint_value`` gives ``from_columns``): compared
        column by column, without a dict per file."""
        if not isinstance(value, list) or len(value) != len(self):
            return False
        if value and (set(map(type, value)) != {dict} or set(map(len, value)) != {3}):
            return False
        nothing = [None] * len(self)
        try:  # three keys each, these three: no other
            return ([v["path"] for v in value] == self.paths
                    and [v["num_bytes"] for v in value] == (self.num_bytes or nothing)
                    and [v["mtime_ns"] for v in value] == (self.mtime_ns or nothing))
        except KeyError:
            return False

    def to_json(self) -> dict:
        """The object of the source table file: ``num_files``, then one column
        per field (``SourceTableFile``); a locator shared by every file is
        written once."""
        obj: dict[str, Any] = {"num_files": len(self), "path": self.paths}
        for key, column in (("num_bytes", self.num_bytes), ("mtime_ns", self.mtime_ns)):
            if column is not None:
                obj[key] = column
        if self.locators is not None:
            obj["locator"] = self.locators
        if self.examples is not None:
            obj["examples"] = self.examples
            obj["tokens"] = self.tokens or {}
        if self.fingerprint_files is not None:
            obj["fingerprint_files"] = self.fingerprint_files
        return obj

    def to_bytes(self) -> bytes:
        """The bytes of ``SOURCE_TABLE_NAME``: ``to_json`` as compact JSON
        (UTF-8, msgspec: a tenth of ``json.dumps``'s time for 50,000 files),
        one line and a newline; as deterministic as the file listing."""
        return msgspec.json.encode(self.to_json()) + b"\n"

    @classmethod
    def from_json(cls, obj: Any, *, path: str = SOURCE_TABLE_NAME) -> "SourceTable":
        """The table of a decoded source table file, checked column by column.

        Raises:
          CacheError: ``{path}: ...`` naming the first bad field: not an object,
            a missing column, a column of another length than ``num_files`` or
            holding a value of the wrong type.
        """
        codec.require(isinstance(obj, dict), path, "the source table file is not a JSON object")
        t = convert(obj, SourceTableFile, path=path)  # each column's type (msgspec), then its length
        n = t.num_files
        columns = {"path": t.path, "num_bytes": t.num_bytes, "mtime_ns": t.mtime_ns, "examples": t.examples,
                   "locator": None if isinstance(t.locator, str) else t.locator,
                   **{f"tokens.{k}": v for k, v in (t.tokens or {}).items()}}
        for key, column in columns.items():
            codec.require(column is None or len(column) == n, path,
                          f"{key} has {len(column or ())} entries, expected num_files = {n}")
        codec.require((t.tokens is None) == (t.examples is None), path,
                      "examples and tokens go together: one of them is missing")
        moved = t.fingerprint_files
        codec.require(moved is None or moved.get("from_columns") is True or "value" in moved, path,
                      f"fingerprint_files is {_short(moved)}, expected {{\"value\": ...}} or {{\"from_columns\": true}}")
        return cls.from_columns(t.path, t.num_bytes, t.mtime_ns, t.locator, examples=t.examples, tokens=t.tokens,
                                fingerprint_files=moved, path=path)


def with_value_at(obj: Mapping[str, Any], keys: Sequence[str], value: Any) -> dict:
    """A copy of the nested object ``obj`` with ``value`` at ``keys`` (the
    objects along the way copied, the rest shared)."""
    out = dict(obj)
    if len(keys) == 1:
        out[keys[0]] = value
    else:
        inner = out.get(keys[0])
        out[keys[0]] = with_value_at(inner if isinstance(inner, dict) else {}, keys[1:], value)
    return out


def _without_value_at(obj: Mapping[str, Any], keys: Sequence[str]) -> tuple[dict, Any] | None:
    """(a copy of ``obj`` without the value at ``keys``, that value), or None
    when there is none."""
    inner: Any = obj
    for key in keys:
        if not isinstance(inner, dict) or key not in inner:
            return None
        inner = inner[key]
    out = dict(obj)
    if len(keys) == 1:
        del out[keys[0]]
    else:
        out[keys[0]], _ = _without_value_at(obj[keys[0]], keys[1:])
    return out, inner


def _check_sources(entries: Sequence[Any]) -> None:
    """Checks a build's ``sources`` against ``Source`` (one ``msgspec.convert``:
    a million entries in well under a second).

    Raises:
      CacheError: naming the first bad entry and its field (``sources[3].path``).
    """
    convert(list(entries), list[Source], path=MANIFEST_NAME, prefix="sources")


def _check_source_columns(table: SourceTable) -> None:
    """``_check_sources`` of a table given as columns (``SourceTable.from_columns``):
    the columns against ``SourceTableFile``, entry by entry only when one fails."""
    try:
        columns = {"num_bytes": table.num_bytes, "mtime_ns": table.mtime_ns, "locator": table.locators}
        msgspec.convert({"num_files": len(table), "path": table.paths,
                         **{k: v for k, v in columns.items() if v is not None}}, SourceTableFile)
    except msgspec.ValidationError:
        _check_sources(list(table))


def _check_source_files(per_file: Any) -> None:
    """Checks a build's ``statistics.source_files`` against ``SourceFiles``.
    Raises CacheError as ``convert``."""
    convert(per_file, SourceFiles, path=MANIFEST_NAME, prefix="statistics.source_files")


def detach_source_table(fields: dict, *, fingerprint_known: bool = False) -> tuple[SourceTable, bytes]:
    """Moves a build's per-file source table out of its manifest fields (in
    place): ``sources``, ``statistics.source_files`` and the fingerprint
    inputs' file list (``FINGERPRINT_FILES_KEYS``) go into the returned
    ``SourceTable`` (returned with the bytes of its file), and
    ``source_table`` (its file's name, size, sha256, file count and the keys
    of what left the fingerprint inputs) comes in.

    Raises:
      CacheError: ``fingerprint`` is not the sha256 of ``fingerprint_inputs``
        (checked here, while the inputs are whole, unless ``fingerprint_known``);
        columns that disagree.
    """
    entries = fields.pop("sources", None) or []
    if isinstance(entries, SourceTable):
        _check_source_columns(entries)
    else:
        _check_sources(entries)
        entries = SourceTable(entries)
    statistics = fields.get("statistics")
    per_file = None
    if isinstance(statistics, Mapping) and "source_files" in statistics:
        statistics = dict(statistics)
        per_file = statistics.pop("source_files")
        _check_source_files(per_file)
        fields["statistics"] = statistics
    inputs, moved, keys = fields.get("fingerprint_inputs"), None, None
    if isinstance(inputs, Mapping) and isinstance(fields.get("fingerprint"), str):
        actual = fields["fingerprint"] if fingerprint_known else codec.fingerprint_of(inputs)
        codec.require(fields["fingerprint"] == actual, MANIFEST_NAME,
                       f"fingerprint = {_short(fields['fingerprint'])}, but the sha256 of fingerprint_inputs is "
                       f"{actual!r}")
        split = _without_value_at(inputs, FINGERPRINT_FILES_KEYS)
        if split is not None:
            fields["fingerprint_inputs"], value = split
            keys = list(FINGERPRINT_FILES_KEYS)
            moved = {"from_columns": True} if entries.same_files(value) else {"value": value}
    table = SourceTable.from_columns(entries.paths, entries.num_bytes, entries.mtime_ns, entries.locators,
                                     examples=None if per_file is None else per_file["examples"],
                                     tokens=None if per_file is None else per_file["tokens"], fingerprint_files=moved)
    data = table.to_bytes()
    record = {"file": SOURCE_TABLE_NAME, "num_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
              "num_files": len(table)}
    if keys is not None:
        record["fingerprint_files"] = keys
        record["inputs_sha256"] = inputs_sha256(fields["fingerprint"], fields["fingerprint_inputs"])
    fields["source_table"] = record
    return table, data


def inputs_sha256(fingerprint: str, inputs: Mapping[str, Any]) -> str:
    """``source_table.inputs_sha256``: the sha256 of the canonical JSON of
    ``{"fingerprint": fingerprint, "fingerprint_inputs": inputs}`` (the inputs
    as the manifest records them, without what the source table file holds)."""
    return codec.fingerprint_of({"fingerprint": fingerprint, "fingerprint_inputs": inputs})


def read_source_table(cache_dir: str | None, manifest: Any) -> SourceTable:
    """The cache's per-file source table: from ``SOURCE_TABLE_NAME`` in
    ``cache_dir`` (a local path or a URL) after checking that file's size and
    sha256 against the manifest's ``source_table`` (format version 3); or, for
    a cache that keeps it in the manifest (``sources`` and
    ``statistics.source_files``, format version 2), from the manifest without
    reading anything. Opening a cache (``info``, the feeder) never reads it;
    ``which --source``, provenance look-ups, ``report`` and ``verify`` do.

    Raises:
      CacheError: one line naming the file: missing, another size or sha256
        than the manifest records, not a source table, or listing another
        number of files than the manifest's ``source_table.num_files``.
      seqcache.fs.FileSystemError: (URLs) the object store cannot be reached.
    """
    recorded = manifest.source_table
    if recorded is None:
        per_file = manifest.statistics.source_files or SourceFiles(examples=None, tokens=None)
        where = MANIFEST_NAME if manifest.cache_dir is None else fs.join(manifest.cache_dir, MANIFEST_NAME)
        return SourceTable([s.to_json() for s in manifest.sources], examples=per_file.examples,
                           tokens=per_file.tokens, path=where, prefix="statistics.source_files.")
    if cache_dir is None:
        raise ValueError("read_source_table: the manifest keeps its source table in a file; give the cache folder")
    path, data = layout.read_recorded_file(cache_dir, recorded.to_json(), "source table file",
                                     missing=f" for {recorded.num_files:,} source files); rebuild the cache")
    obj = bounded_json.loads(data, path=path, error=CacheError, what="source table file",
                             max_bytes=max(bounded_json.MAX_BYTES, len(data)),
                             max_nodes=bounded_json.MAX_NODES + 8 * recorded.num_files)
    table = SourceTable.from_json(obj, path=path)
    if len(table) != recorded.num_files:
        raise CacheError(f"{path}: lists {len(table):,} source files, the manifest's source_table.num_files is "
                         f"{recorded.num_files:,}")
    if recorded.fingerprint_files and table.fingerprint_files is None:
        raise CacheError(f"{path}: holds no fingerprint_files, but the manifest's source_table.fingerprint_files "
                         f"is {recorded.fingerprint_files}")
    return table
