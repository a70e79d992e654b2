"""Sequence lengths: one type and one rule for the whole package.

A sequence length is a mapping from feature name to the tokens of one row of
that feature: ``{"targets": 512}``, ``{"inputs": 512, "targets": 114}`` (dict
of str -> int, each in [1, 2^24)). Where a user gives one (``BuildConfig``,
``Feeder(sequence_length=...)``, ``ConvertedFeeder``, ``TrainConfig``,
``--sequence-length``) an int is accepted as well and means that length for
every feature; ``sequence_lengths`` turns either into the mapping, once, at
that edge. Where the features are not known yet (the command line, a
``TrainConfig`` whose converter the cache decides), an int is kept under the
key ``ALL_FEATURES`` (``"*"``): ``{"*": 1024}``, ``{"*": 1024, "inputs": 512}``
(``parse_sequence_length``), which ``sequence_lengths`` expands to every
feature the mapping does not name.

A cache records its own lengths (``cache_lengths``): a packed cache the row
length it is packed to, a trimmed cache the length it is trimmed to (both its
manifest's ``sequence_length``, ``built_lengths``), any other cache the longest
example of each feature (``statistics.max_length``). A reader of caches
defaults to their lengths (for several caches, the longest: a mixture's rows
fit every cache's), and a length is given only to cut rows shorter; one longer
than a packed or trimmed cache's is refused (``fit_lengths``,
``SequenceLengthError``).
"""

from __future__ import annotations

import numbers
from typing import Any, Iterable, Mapping

from seqcache import bounded_json

MAX_SEQUENCE_LENGTH = bounded_json.MAX_SEQUENCE_LENGTH
# The key of a sequence length given for every feature (a bare N on the command
# line): its length goes to each feature a mapping does not name.
ALL_FEATURES = "*"


class SequenceLengthError(ValueError):
    """A sequence length longer than the caches', or none given where a cache
    records none; one line naming the cache, the feature and both lengths.

    ``for_setting("--sequence-length ")`` gives the same refusal worded for
    another way of giving the length (a command's flag instead of the
    ``sequence_length=`` argument)."""

    def __init__(self, template: str, setting: str = "sequence_length="):
        self._template = template
        super().__init__(template.replace(_SETTING, setting.rstrip(" =")))

    def for_setting(self, setting: str) -> "SequenceLengthError":
        return SequenceLengthError(self._template, setting)


# Where a ``SequenceLengthError`` names how the length is given.
_SETTING = "\x00setting\x00"


def _length(value: Any, feature: str | None) -> int:
    where = "sequence_length" if feature is None else f"sequence_length of feature {feature!r}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value < MAX_SEQUENCE_LENGTH:
        raise ValueError(f"{where} must be an integer in [1, {bounded_json.bound(MAX_SEQUENCE_LENGTH)}) tokens "
                         f"(got {value!r})")
    return int(value)


def sequence_lengths(value: Mapping[str, int | None] | int | None, features: Iterable[str]) -> dict[str, int]:
    """The one form of a sequence length: feature -> tokens per row.

    Args:
      value: None (no lengths); an int L (L tokens for every feature of
        ``features``); or a mapping feature -> L or None (None: no length for
        that feature, left out), which may hold ``ALL_FEATURES`` ("*"): its L
        for every feature of ``features`` the mapping does not name. L is an
        integer (not a bool) in [1, 2^24).
      features: the feature names the lengths are for; a mapping names only these.

    Returns:
      dict str -> int (features without a length left out), in the mapping's
      order, or in ``features`` order for an int or a mapping with "*".

    Raises:
      ValueError: a length that is not an integer in [1, 2^24); a mapping that
        names a feature outside ``features`` (the message lists them); a value
        of another type.
    """
    names = list(features)
    if value is None:
        return {}
    if isinstance(value, Mapping):
        unknown = sorted(str(k) for k in value if k not in names and k != ALL_FEATURES)
        if unknown:
            raise ValueError(f"sequence length given for {unknown}, which are not among the features {names}")
        if ALL_FEATURES in value:
            value = {n: value.get(n, value[ALL_FEATURES]) for n in names}
        return {n: _length(v, n) for n, v in value.items() if v is not None}
    if isinstance(value, (str, bytes)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"sequence_length must be an integer or a mapping feature -> integer (got {value!r})")
    return dict.fromkeys(names, _length(value, None))


def parse_sequence_length(texts: Iterable[str] | str) -> dict[str, int]:
    """The command line's form of a sequence length, the one parser of
    ``--sequence-length`` (every command; repeatable; one value may be given
    as a str): ``("1024",)`` or ``"1024"`` ->
    ``{"*": 1024}``, ``("inputs=512,targets=114",)`` -> ``{"inputs": 512,
    "targets": 114}``, ``("1024", "inputs=512")`` -> ``{"*": 1024, "inputs":
    512}``. A bare N is the length of every feature the command reads (kept
    under ``ALL_FEATURES`` until ``sequence_lengths`` knows them: a build's task
    features, a converter's), FEATURE=N that feature's, over a bare N; the last
    of two values for one key counts. Nothing given: {}.

    Returns:
      dict str -> tokens (int >= 1).

    Raises:
      ValueError: a part that is not N or FEATURE=N ("'x': expected N or
        FEATURE=N"), or N < 1.
    """
    out = {}
    for text in (texts,) if isinstance(texts, str) else texts:  # one value, or the values of a repeated flag
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            name, sep, length = part.rpartition("=")
            try:
                n = int(length)
            except ValueError:
                raise ValueError(f"{part!r}: expected N or FEATURE=N") from None
            if n < 1:
                raise ValueError(f"{part!r}: a sequence length must be >= 1")
            out[name if sep else ALL_FEATURES] = n
    return out


def built_lengths(manifest: Any) -> dict[str, int]:
    """The lengths (tokens) a cache was built to, from its manifest
    (``seqcache.format.Manifest``): its ``sequence_length``, the length a
    packed cache's rows are packed to or a trimmed cache's examples trimmed to.
    Features without one are left out.

    Raises:
      ValueError: a recorded length outside [1, 2^24) (a manifest read with
        ``read_manifest`` has been checked already).
    """
    return sequence_lengths(manifest.sequence_length, [f.name for f in manifest.features])


def cache_lengths(manifest: Any) -> dict[str, int]:
    """A cache's own sequence lengths (tokens): ``built_lengths``, else for a
    feature without one its longest example, ``statistics.max_length`` (when
    the build counted it, above 0). Features with neither are left out.

    Raises:
      ValueError: a recorded length outside [1, 2^24).
    """
    names = [f.name for f in manifest.features]
    out = built_lengths(manifest)
    longest = getattr(manifest.statistics, "max_length", None)  # the model's ``Statistics``
    for name in names:
        most = longest.get(name) if isinstance(longest, Mapping) and name not in out else None
        if isinstance(most, numbers.Integral) and not isinstance(most, bool) and 0 < most < MAX_SEQUENCE_LENGTH:
            out[name] = int(most)
    return {n: out[n] for n in names if n in out}


def _longest(manifests: Mapping[str, Any], name: str, lengths_of) -> tuple[int | None, str | None]:
    """(the longest of the caches' lengths of ``name``, the first cache with it);
    (None, a cache without one) when a cache has none."""
    known = {path: lengths_of(m).get(name) for path, m in manifests.items()}
    missing = [p for p, n in known.items() if n is None]
    if missing or not known:
        return None, (missing[0] if missing else None)
    return max(known.values()), max(known, key=known.get)


def fit_lengths(given: Mapping[str, int | None] | int | None, manifests: Mapping[str, Any],
                features: Iterable[str], *, setting: str = "sequence_length=") -> dict[str, int]:
    """The sequence lengths a reader of caches uses for ``features``, by the
    package's one rule (the module's docstring): the given length, else the
    caches' own; a given length over ``built_lengths`` is refused. A cache
    built to no length sets no limit: longer rows only pad its examples.

    Args:
      given: what the user gave, None, an int or a mapping feature -> int or
        None (``sequence_lengths`` against ``features``).
      manifests: cache (its path, for messages) -> its ``seqcache.format.Manifest``.
      features: the features read, e.g. ("targets",) or ("inputs", "targets").
      setting: how the user sets a length, as written before the value, for
        the message: "sequence_length=" (Python), "--sequence-length " (the CLI).

    Returns:
      dict feature -> tokens (int), in ``features`` order.

    Raises:
      SequenceLengthError: a given length longer than the caches' ("CACHE:
        sequence length G for feature 'f' is longer than the cache's, C tokens;
        ..."); no length given for a feature of which a cache records none.
      ValueError: a malformed ``given`` (``sequence_lengths``).
    """
    names = list(features)
    asked = sequence_lengths(given, names)
    out = {}
    for name in names:
        if name not in asked:
            own, where = _longest(manifests, name, cache_lengths)
            if own is None:
                raise SequenceLengthError(f"{where or 'the cache'}: the cache records no sequence length for feature "
                                          f"{name!r}; give its length ({_SETTING})", setting)
            out[name] = own
            continue
        limit, where = _longest(manifests, name, built_lengths)
        if limit is not None and asked[name] > limit:
            raise SequenceLengthError(
                f"{where}: sequence length {asked[name]} for feature {name!r} is longer than the cache's, {limit} "
                f"tokens; leave {_SETTING} out to read rows of {limit}, or give at most {limit}", setting)
        out[name] = asked[name]
    return out
