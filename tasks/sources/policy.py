"""The bad-input policy of a source: kinds of bad input, the action per kind,
and the content checks of text values.

Bad input is sorted into kinds, and each source has a policy per kind
(``on_error``; see ``ErrorPolicy``):

======================  ==================================================  ==========================
kind                    what                                                actions (default first)
======================  ==================================================  ==========================
``invalid_utf8``        bytes that are not UTF-8                            raise, skip, replace
``carriage_return``     a CR inside a text line (old Mac line endings)      raise, skip, replace
``control_characters``  Unicode Cc characters other than the White_Space    keep, raise, skip, replace
                        ones (U+0000-0008, U+000E-001F, U+007F-0084,
                        U+0086-009F)
``u2581``               U+2581, SentencePiece's whitespace symbol, in the   keep, raise, skip, replace
                        text (usually text that was already tokenized)
``empty``               a text value that is ``""`` (an empty line or file)  skip, raise, keep
``whitespace``          a text value of whitespace only (``str.isspace``)    skip, raise, keep
``malformed``           a JSON line that does not parse or is not an object  raise, skip
``missing_field``       a selected JSON field that is absent                 raise, skip
``bad_value``           a value the task cannot use: a wrong type, a null,   raise, skip
                        a token id outside the vocabulary (``Task`` checks)
``duplicate``           a record identical to another in what the task       keep, skip
                        reads (the same ``raw``: the selected fields or
                        columns, a whole line or file; the same shuffle
                        key); found in the build's shuffle
                        (``transforms.SpreadCopies``), not by the source
``near_duplicate``      a record whose words are nearly those of another     keep, skip
                        (MinHash LSH over word n-grams: the build's
                        ``near_duplicates`` parameters,
                        ``seqcache.tasks.near_duplicates``); found in the
                        build's shuffle (``pipelines.near``)
======================  ==================================================  ==========================

The defaults keep every record seqio and Hugging Face datasets keep, except
empty and whitespace-only ones (layout, not documents), and raise where the
input cannot be what was meant; docs/bad-input.md gives the reasons.
``duplicate`` and ``near_duplicate`` are set only by name (``{"duplicate":
"skip"}``): one action for every kind (``"raise"``, ``"skip"``, ``"replace"``,
a mapping's ``"default"``) leaves them at ``"keep"``, as exact deduplication changes what a cache holds
rather than refusing or repairing bad bytes. Under ``"skip"`` the first copy
of each identical record in provenance order (file index, record number) is
kept and every other copy is skipped: quarantined and counted like any
skipped record, and only so (kinds kept or repaired in the copy are not
counted again: ``spill.QuarantineSummary.uncounted``). Records are identical
when their ``raw`` is: a JSON line's selected values (not the line, so the
same text under another ``url`` or with other spacing is a copy), a Parquet
row's or a TSV line's selected columns, a text line, a whole file.

``"raise"`` raises ``BadInputError`` (a ``ValueError``) naming the file, the
record, the problem and the option that accepts it. ``"skip"`` yields the
record with ``data == {}`` and ``issue == RecordIssue("skipped", kind,
message)`` (counted, and written to the quarantine file). ``"replace"`` keeps
it repaired, with ``issue == RecordIssue("replaced", kinds, message)``:
invalid UTF-8 and control
characters become U+FFFD, a carriage return inside a line a newline, U+2581 a
space. ``"keep"`` accepts the text and names the kind in
``SourceRecord.kept`` (counted in ``statistics.bad_input_records.kept``). The
content checks (control characters, U+2581, empty, whitespace) apply to every
string value a source yields, after any repair. A raised error may say
more than the split-independent id of other messages (``Where``).
"""

from __future__ import annotations

import re
from typing import Callable, Mapping, Sequence

import numpy as np

# The kinds of bad input and the actions each allows (the first is the default).
ERROR_KINDS: dict[str, tuple[str, ...]] = {
    "invalid_utf8": ("raise", "skip", "replace"),
    "carriage_return": ("raise", "skip", "replace"),
    "control_characters": ("keep", "raise", "skip", "replace"),
    "u2581": ("keep", "raise", "skip", "replace"),
    "empty": ("skip", "raise", "keep"),
    "whitespace": ("skip", "raise", "keep"),
    "malformed": ("raise", "skip"),
    "missing_field": ("raise", "skip"),
    "bad_value": ("raise", "skip"),
    "duplicate": ("keep", "skip"),
    "near_duplicate": ("keep", "skip"),
}
# The kinds one action for every kind leaves at their default: set only by name.
NAMED_ONLY_KINDS = frozenset({"duplicate", "near_duplicate"})
# Kinds that a policy's fingerprint names only when not at their default, so
# that the caches built before the kind existed keep their fingerprints.
_NEW_KINDS = frozenset({"near_duplicate"})
# Each kind's default action (the reasons are in the module docstring).
DEFAULT_ACTIONS: dict[str, str] = {kind: actions[0] for kind, actions in ERROR_KINDS.items()}
_ON_ERROR = ("raise", "skip", "replace")


class ErrorPolicy:
    """What a source does with each kind of bad input (see the module docstring).

    ``ErrorPolicy()`` (or ``None``) gives every kind its default action
    (``DEFAULT_ACTIONS``). ``"raise"``, ``"skip"`` and ``"replace"`` apply one
    action to every kind (``"replace"`` skips the kinds that cannot be
    repaired; ``duplicate``, set only by name, stays ``"keep"``). A mapping
    sets the action per kind; the kinds it does not name
    get ``"default"`` when it is given, else their own defaults::

        ErrorPolicy({"control_characters": "raise"})   # the defaults, but strict on Cc
        ErrorPolicy({"default": "raise", "empty": "skip"})
        ErrorPolicy({"default": "skip", "u2581": "replace"})

    Raises:
      ValueError: an unknown kind or action, or an action a kind does not allow
        (e.g. ``{"empty": "replace"}``); the message lists what is allowed.
    """

    __slots__ = ("actions",)

    def __init__(self, spec: "str | Mapping[str, str] | ErrorPolicy | None" = None):
        if isinstance(spec, ErrorPolicy):
            self.actions = dict(spec.actions)
            return
        spec = {} if spec is None else {"default": spec} if isinstance(spec, str) else spec
        if not isinstance(spec, Mapping):
            raise ValueError(f"on_error must be one of {_ON_ERROR} or a mapping kind -> action (got {spec!r})")
        spec = dict(spec)
        default = spec.pop("default", None)
        if default is not None and default not in _ON_ERROR:
            raise ValueError(f"on_error must be one of {_ON_ERROR} (got {default!r}); "
                             "'keep' is set per kind, e.g. {'empty': 'keep'}")
        actions = {kind: DEFAULT_ACTIONS[kind] if default is None or kind in NAMED_ONLY_KINDS
                   else default if default in allowed else "skip"
                   for kind, allowed in ERROR_KINDS.items()}
        for kind, action in spec.items():
            if kind not in ERROR_KINDS:
                raise ValueError(f"unknown kind of bad input {kind!r} in on_error (kinds: {', '.join(ERROR_KINDS)})")
            if action not in ERROR_KINDS[kind]:
                raise ValueError(f"on_error[{kind!r}] must be one of {ERROR_KINDS[kind]} (got {action!r})")
            actions[kind] = action
        self.actions = actions

    def action(self, kind: str) -> str:
        """The action for ``kind``: ``"raise"``, ``"skip"``, ``"replace"`` or ``"keep"``."""
        return self.actions[kind]

    def to_json(self) -> dict[str, str]:
        """Every kind with its action (part of the source's fingerprint);
        ``near_duplicate`` only when it is not ``"keep"``."""
        return {k: v for k, v in self.actions.items() if k not in _NEW_KINDS or v != DEFAULT_ACTIONS[k]}

    def __eq__(self, other) -> bool:
        if isinstance(other, (str, Mapping)):
            other = ErrorPolicy(other)
        return isinstance(other, ErrorPolicy) and self.actions == other.actions

    def __getstate__(self):
        return self.actions

    def __setstate__(self, state):
        self.actions = state

    def __repr__(self) -> str:
        changed = {k: v for k, v in self.actions.items() if v != DEFAULT_ACTIONS[k]}
        return f"ErrorPolicy({changed or ''})"


def parse_on_error(values: "str | Sequence[str]") -> "str | dict[str, str] | None":
    """The ``on_error`` of command-line values: ``"raise"``, ``"skip"``,
    ``"replace"`` or ``"KIND=ACTION"`` (several: ``["skip", "empty=keep"]``);
    None for none. ``ValueError`` for a malformed value, kind or action."""
    if isinstance(values, str):
        values = [values]
    spec: dict[str, str] = {}
    for value in values:
        kind, sep, action = value.partition("=")
        kind, action = (kind.strip(), action.strip()) if sep else ("default", value.strip())
        if kind == "default" and action not in _ON_ERROR:
            raise ValueError(f"{value!r}: one action for every kind is one of {', '.join(_ON_ERROR)}; "
                             f"'keep' is given per kind, e.g. empty=keep")
        if kind != "default" and kind not in ERROR_KINDS:
            raise ValueError(f"{value!r}: unknown kind {kind!r} (kinds: {', '.join(ERROR_KINDS)})")
        if kind != "default" and action not in ERROR_KINDS[kind]:
            raise ValueError(f"{value!r}: {kind} can be {', '.join(ERROR_KINDS[kind])}")
        if kind in spec and spec[kind] != action:
            shown = kind if kind != "default" else "the action for every kind"
            raise ValueError(f"{shown} given twice: {spec[kind]!r} and {action!r}")
        spec[kind] = action
    ErrorPolicy(spec)  # validates
    if not spec:
        return None
    return spec["default"] if set(spec) == {"default"} else spec


class Where:
    """Where a record lies, for messages: ``text`` names the file and the
    record by an id that does not depend on the split (``"/data/a.txt: line at
    byte 1234"``; skipped and repaired records, the quarantine file);
    ``raised()`` is what a raised error says, which may cost a read of the file
    (``"/data/a.txt: line 12 (byte 1234)"``). A plain string is a ``Where``
    whose two forms are the same."""

    __slots__ = ("text", "_raised")

    def __init__(self, text: str, raised: Callable[[], str] | None = None):
        self.text = text
        self._raised = raised

    def raised(self) -> str:
        """The form for a raised error (``text`` when no other was given)."""
        return self._raised() if self._raised is not None else self.text

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Where({self.text!r})"


def as_where(where: "str | Where") -> Where:
    """``where`` as a ``Where`` (a string is both of its forms)."""
    return where if isinstance(where, Where) else Where(where)


_CONTROL_RE = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x84\x86-\x9f]")
_SURROGATE_RE = re.compile("[\ud800-\udfff]")
# Any character some content kind looks at: one scan tells a clean text apart.
SUSPECT_CHARACTERS = "\x00-\x08\x0e-\x1f\x7f-\x84\x86-\x9f\u2581\ud800-\udfff"
_SUSPECT_RE = re.compile(f"[{SUSPECT_CHARACTERS}]")
_HOW = {
    "invalid_utf8": "'replace' (U+FFFD) or 'skip'",
    "carriage_return": "'replace' (a newline) or 'skip'",
    "control_characters": "'keep', 'replace' (U+FFFD) or 'skip'",
    "u2581": "'keep', 'replace' (a space) or 'skip'",
    "empty": "'skip' or 'keep'",
    "whitespace": "'skip' or 'keep'",
    "malformed": "'skip'",
    "missing_field": "'skip'",
    "bad_value": "'skip'",
    "duplicate": "'skip' (keep the first copy) or 'keep'",
    "near_duplicate": "'skip' (keep the member with the smallest shuffle key) or 'keep'",
}


def is_clean_text(text: str) -> bool:
    """True when ``text`` has none of ``text_problems`` and no carriage return."""
    return bool(text) and "\r" not in text and _SUSPECT_RE.search(text) is None and not text.isspace()


# The second bytes after 0xC2 that make a suspect C1 control character.
_C1_SECOND = np.zeros(256, dtype=bool)  # C2 80..84, C2 86..9F: U+0080..U+0084, U+0086..U+009F
_C1_SECOND[[*range(0x80, 0x85), *range(0x86, 0xA0)]] = True


def suspect_utf8_values(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Indices of the values of a column of UTF-8 strings that hold a character
    of ``SUSPECT_CHARACTERS``, found in the column's bytes at once.

    Args:
      data: uint8 (B,), the values' UTF-8 bytes, one after the other.
      offsets: int (n + 1,), value i is ``data[offsets[i] - offsets[0]:offsets[i + 1] - offsets[0]]``.

    Returns:
      int64 (k,), sorted, unique. ``data`` must be valid UTF-8 (as the text of
      an Arrow string column is).
    """
    data = np.asarray(data, dtype=np.uint8)
    # Bytes that start a suspect character's UTF-8 form: the ASCII ones, 0xC2
    # (C1 controls) and 0xE2 (U+2581), told apart by the bytes after them
    # (surrogates have no UTF-8 form). Comparisons, not a table: no widening.
    lead = np.flatnonzero(((data < 0x20) & ((data < 0x09) | (data > 0x0D))) | (data == 0x7F) | (data == 0xC2)
                          | (data == 0xE2))
    if not len(lead):
        return np.zeros(0, np.int64)
    first = data[lead]
    nxt = data[np.minimum(lead + 1, len(data) - 1)]
    third = data[np.minimum(lead + 2, len(data) - 1)]
    at_end1, at_end2 = lead + 1 >= len(data), lead + 2 >= len(data)
    keep = np.ones(len(lead), dtype=bool)
    c2 = first == 0xC2
    keep[c2] = _C1_SECOND[nxt[c2]] & ~at_end1[c2]
    e2 = first == 0xE2
    keep[e2] = (nxt[e2] == 0x96) & (third[e2] == 0x81) & ~at_end2[e2]
    ends = np.asarray(offsets[1:], dtype=np.int64) - int(offsets[0])
    return np.unique(np.searchsorted(ends, lead[keep], side="right"))


class BadInputError(ValueError):
    """A record the source's ``on_error`` policy raises on (the kind's action is
    ``"raise"``); the message names the record and ends with ``error_hint``'s
    way to accept, repair or skip it."""


def with_path(error: ValueError, path: str) -> ValueError:
    """``error`` with its message starting with ``path`` (the file it came from):
    ``error`` itself when it does, else a new one of the same kind (a
    ``BadInputError`` stays one, anything else becomes a ``ValueError``)."""
    if str(error).startswith(path):
        return error
    kind = BadInputError if isinstance(error, BadInputError) else ValueError
    return kind(f"{path}: {error}")


def error_hint(kind: str) -> str:
    """How to accept, repair or skip records of ``kind``, for error messages."""
    return (f"set the source's on_error={{{kind!r}: ...}} to {_HOW[kind]} "
            f"(with --source on the command line: --on-error {kind}=ACTION)")


def text_problems(text: str) -> list[tuple[str, str]]:
    """The content problems of one text value, ``(kind, description)`` pairs
    (``invalid_utf8`` for a lone surrogate, ``control_characters``, ``u2581``,
    ``empty``, ``whitespace``), locating the first offending character."""
    if not text:
        return [("empty", "is empty")]
    out = []
    m = _SURROGATE_RE.search(text)
    if m:  # only a JSON \\u escape or a Python string can carry one; it has no UTF-8 form
        out.append(("invalid_utf8", f"contains a lone surrogate U+{ord(m.group()):04X} at character {m.start()} "
                                    "(a broken \\u escape?), which is not valid UTF-8"))
    m = _CONTROL_RE.search(text)
    if m:
        n = len(_CONTROL_RE.findall(text))
        out.append(("control_characters",
                    f"contains control character U+{ord(m.group()):04X} at character {m.start()}"
                    + (f" ({n} in all)" if n > 1 else "")))
    i = text.find("\u2581")
    if i >= 0:
        n = text.count("\u2581")
        out.append(("u2581", f"contains U+2581 (SentencePiece's whitespace symbol) at character {i}"
                             + (f" ({n} in all)" if n > 1 else "")))
    if text.isspace():
        out.append(("whitespace", "holds only whitespace"))
    return out


_REPAIRS = {
    "invalid_utf8": lambda t: _SURROGATE_RE.sub("\ufffd", t),
    "control_characters": lambda t: _CONTROL_RE.sub("\ufffd", t),
    "u2581": lambda t: t.replace("\u2581", " "),
}


def check_text_values(data: dict, where: "str | Where", policy: ErrorPolicy,
                      kept: list | None = None) -> tuple[dict | None, list[tuple[str, str]], tuple[str, str] | None]:
    """Applies ``policy`` to the content problems of the values of ``data``
    (strings, and empty token-id lists for the kind ``empty``).

    Returns ``(data, repairs, skip)``: the (possibly repaired) data, the repairs
    as ``(kind, message)`` pairs, and ``(kind, message)`` when the record is to
    be skipped (``data`` then None); messages name ``where.text``. The kinds
    kept as they are go into ``kept`` (when a list), once per record.

    Raises:
      ValueError: a problem whose action is ``"raise"``, naming
        ``where.raised()``, the field when there are several, and the option.
    """
    where = as_where(where)
    repairs: list[tuple[str, str]] = []
    out = data

    def label(key: str, raising: bool) -> str:
        w = where.raised() if raising else where.text
        return w if len(data) == 1 else f"{w}, field {key!r},"

    def keep(kind: str) -> None:
        if kept is not None and kind not in kept:
            kept.append(kind)

    for key, value in data.items():
        if isinstance(value, (list, tuple)) and not value:
            action = policy.actions["empty"]
            if action == "keep":
                keep("empty")
                continue
            message = f"{label(key, action == 'raise')} is empty (no token ids)"
            if action == "raise":
                raise BadInputError(f"{message}; {error_hint('empty')}")
            return None, repairs, ("empty", message)
        if not isinstance(value, str):
            continue
        if value and _SUSPECT_RE.search(value) is None and not value.isspace():
            continue  # clean: one scan instead of one per kind
        while True:  # each repair removes its kind, but can expose another (U+2581 -> whitespace)
            problems = []
            for k, d in text_problems(value):
                if policy.actions[k] == "keep":
                    keep(k)
                else:
                    problems.append((k, d))
            if not problems:
                break
            kind, description = problems[0]
            action = policy.actions[kind]
            message = f"{label(key, action == 'raise')} {description}"
            if action == "raise":
                raise BadInputError(f"{message}; {error_hint(kind)}")
            if action == "skip":
                return None, repairs, (kind, message)
            value = _REPAIRS[kind](value)
            repairs.append((kind, message))
        if value is not data[key]:
            if out is data:
                out = dict(data)
            out[key] = value
    return out, repairs, None
