"""``FunctionSource``: records produced by a Python function."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping

from seqcache.tasks.sources.base import Source, SourceFile, SourceRecord
from seqcache.tasks.sources.policy import ErrorPolicy


class FunctionSource(Source):
    """Records produced by a Python function, e.g. for small synthetic tasks.

    ``fn()`` (deterministic, picklable) returns an iterable of dicts: one
    pseudo-file ``"<function NAME>"``, one split, its records numbered 0, 1, ...
    (``locator`` ``"record"``). The fingerprint holds only ``name`` and
    ``version``: **bump ``version`` whenever the function's output changes**.

    Args:
      fn: a callable with no arguments returning an iterable of dicts.
      name: the source's name (in the pseudo-file name and the fingerprint).
      version: the version of the function's output.
      on_error: the ``ErrorPolicy`` spec (content kinds, the task's checks).

    Raises (from ``read_split``):
      ValueError: ``fn`` yields a non-dict; a split that is not the whole.
    """

    kind = "function"
    locator = "record"

    def __init__(self, fn: Callable[[], Iterable[dict]], *, name: str, version: str = "0",
                 on_error: "str | Mapping[str, str] | None" = None):
        if not callable(fn):
            raise TypeError(f"FunctionSource {name!r}: fn must be callable (got {type(fn).__name__})")
        if not name:
            raise ValueError("FunctionSource needs a non-empty name")
        self.fn = fn
        self.name = name
        self.version = str(version)
        self.on_error = ErrorPolicy(on_error)

    @property
    def path(self) -> str:
        return f"<function {self.name}>"

    def list_files(self) -> list[SourceFile]:
        return [SourceFile(self.path, 0, 0)]

    def read_file(self, file_index: int, path: str) -> Iterator[SourceRecord]:
        for number, item in enumerate(self.fn()):
            if not isinstance(item, dict):
                kind = type(item).__name__
                raise ValueError(f"{self.path}: record {number} is {'an' if kind[0] in 'aeiou' else 'a'} {kind}, "
                                 "expected a dict")
            yield self._row_record(file_index, number, self.where(self.path, number), dict(item))

    def fingerprint(self) -> dict:
        return {
            "kind": self.kind,
            "name": self.name,
            "version": self.version,
            "on_error": self.on_error.to_json(),
            "files": [{"path": self.path, "num_bytes": 0, "mtime_ns": 0}],
        }

    def describe(self) -> str:
        return f"function {self.name} (version {self.version})"
