"""``parse_source_spec``: a source from its command-line form ``KIND:REST``,
built by the ``from_spec(spec: SourceSpec)`` of the source registered for
``KIND`` (``Source.__init_subclass__``); nothing here names a source.
"""

from __future__ import annotations

import importlib.util
from typing import Mapping, NamedTuple, Sequence

from seqcache.tasks.sources.base import SPEC_KINDS, Source

PIP_HINT = "pip install 'seqcache[tfds]'"


class SourceSpec(NamedTuple):
    """A source's command-line form, cut at its first colon, with the build's options.

    Attributes:
      text: the whole spec, ``KIND:REST``, for messages.
      kind: the part before the first colon: a source's ``kind``.
      rest: the part after it (not empty).
      exclude: glob patterns of paths to leave out.
      on_error: the source's ``ErrorPolicy`` spec (see ``parse_on_error``).
      split: the build's ``--split``: a dataset's split without ``@SPLIT``.
      tfds_data_dir: where prepared TFDS datasets lie, or None.
    """

    text: str
    kind: str
    rest: str
    exclude: Sequence[str] = ()
    on_error: "str | Mapping[str, str] | None" = None
    split: str = "train"
    tfds_data_dir: str | None = None

    def error(self, detail: str = "") -> ValueError:
        """``ValueError("bad source spec '...': {detail}; accepted source specs: ...")``,
        every registered source's ``spec_forms``."""
        forms = ", ".join(SPEC_KINDS[k].spec_forms for k in sorted(SPEC_KINDS))
        return ValueError(f"bad source spec {self.text!r}: {detail + '; ' if detail else ''}accepted source specs: {forms}")

    def named(self, text: str) -> dict[str, str] | None:
        """``"inputs=a,targets=b"`` -> ``{"inputs": "a", "targets": "b"}``; None
        without ``=``. ``ValueError`` for an empty key or value, or a key twice."""
        if "=" not in text:
            return None
        out: dict[str, str] = {}
        for part in text.split(","):
            key, sep, value = (s.strip() for s in part.partition("="))
            if not sep or not key or not value:
                raise self.error(f"{part!r} is not KEY=VALUE")
            if key in out:
                raise ValueError(f"bad source spec {self.text!r}: {key!r} is given twice")
            out[key] = value
        return out

    def one_or_named(self, one: str, several: str, default: str = "text") -> tuple[str, dict]:
        """``PATTERN[#NAME]`` -> ``(PATTERN, {one: NAME or default})``;
        ``PATTERN#KEY=NAME,...`` -> ``(PATTERN, {several: {KEY: NAME, ...}})``.
        Raises ``ValueError`` as ``target_and_name`` and ``named``."""
        pattern, name = self.target_and_name()
        named = self.named(name or default)
        return pattern, ({several: named} if named else {one: name or default})

    def target_and_name(self, module: str | None = None) -> tuple[str, str | None]:
        """``TARGET#NAME`` -> ``(TARGET, NAME)`` (the last ``#``), ``TARGET`` ->
        ``(TARGET, None)``, once ``module`` (if any) is found installed.

        Raises:
          ValueError: an empty target, or an empty name after ``#``.
          ImportError: ``module`` is not installed; the message gives the pip command.
        """
        target, sep, name = self.rest.rpartition("#")
        if not sep:
            target, name = self.rest, None
        if not target or (sep and not name):
            raise self.error()
        try:
            found = module is None or importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ImportError(f"the {self.kind}: source needs the tfds extra ({module} is not installed): {PIP_HINT}")
        return target, name

    def dataset_split(self, target: str) -> tuple[str, str]:
        """``NAME@SPLIT`` -> ``(NAME, SPLIT)``; ``(NAME, self.split)`` without
        ``@SPLIT`` (or a ``/`` after ``@``). ``ValueError`` with ``exclude``."""
        if self.exclude:
            raise ValueError(f"--exclude applies to file patterns, not to the {self.kind}: source {self.text!r}")
        head, at, tail = target.rpartition("@")
        return (head, tail) if at and tail and "/" not in tail else (target, self.split)


def parse_source_spec(spec: str, *, exclude: Sequence[str] = (),
                      on_error: "str | Mapping[str, str] | None" = None, split: str = "train",
                      tfds_data_dir: str | None = None) -> Source:
    """The source of the command-line form ``KIND:REST`` (the sources'
    ``spec_forms``: ``text:PATTERN``, ``jsonl:PATTERN#FIELD``, ...), with
    ``exclude`` (glob patterns to leave out), ``on_error`` (the ``ErrorPolicy``
    spec) and ``split`` (a dataset's split without ``@SPLIT``).

    Raises:
      ValueError: an unknown kind or a malformed spec (the message lists the
        forms), ``exclude`` with a source that has no file patterns.
      ImportError: a ``tfrecord:`` or ``tfds:`` source without the ``tfds`` extra
        (the message gives ``pip install 'seqcache[tfds]'``).
    """
    kind, sep, rest = spec.partition(":")
    parsed = SourceSpec(spec, kind, rest, exclude, on_error, split, tfds_data_dir)
    if not sep or not rest:
        raise parsed.error()
    if kind not in SPEC_KINDS:
        raise parsed.error(f"unknown kind {kind!r}")
    return SPEC_KINDS[kind].from_spec(parsed)
