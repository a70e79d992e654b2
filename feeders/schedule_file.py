"""Mixture schedule files: ``{step: {task or cache: rate}}``, JSON or YAML.

The one reader of the files ``seqcache train --mixture-schedule`` and
``seqcache which --mixture-schedule`` take, e.g.::

    {"0": {"wiki": 1, "code": 1}, "10000": {"wiki": 3, "code": 1}}

or, in a file named ``.yaml`` or ``.yml``::

    0: {wiki: 1, code: 1}
    10000:
      wiki: 3
      code: 1

A JSON file is read by ``seqcache.bounded_json``, a YAML one by
``seqcache.bounded_yaml`` (the YAML 1.2 core schema, no anchors, aliases,
merge keys or tags), both within the same bounds: ``MAX_SCHEDULE_BYTES``,
``MAX_SCHEDULE_VALUES`` values, ``bounded_json.MAX_KEYS`` keys a mapping,
``bounded_json.MAX_DEPTH`` levels. What the names are (tasks, cache folders)
is the caller's business.
"""

from __future__ import annotations

from typing import Any

from seqcache import bounded_json, bounded_yaml

# The most bytes a mixture schedule file may have (as a feeder state): a
# schedule of thousands of stages takes well under 1 MiB.
MAX_SCHEDULE_BYTES = 16 << 20
# The most values (stages, rates) a schedule file may hold: 1,000 stages of
# 100 tasks are 101,000. YAML is built a node at a time in Python (about 2.4
# microseconds a value): the bound keeps the worst file under a second.
MAX_SCHEDULE_VALUES = 2**18
# Steps and rates: a step is a global batch index below 2^62 (as a feeder state's
# positions), a rate a number >= 0 below 2^53.
MAX_STEP = 2**62
MAX_RATE = bounded_json.MAX_COUNT


def read_schedule_file(path: str, *, error: type[Exception] = ValueError) -> dict[int, dict[str, float]]:
    """Reads a mixture schedule file: JSON, or YAML for a name ending in
    ``.yaml`` or ``.yml``, within the bounds above.

    Returns:
      ``{step: {name: rate}}`` sorted by step: each step an integer in
      [0, 2^62) (a YAML integer key, or a JSON key of ASCII digits), the
      first 0; each stage a non-empty mapping of names to numbers in
      [0, 2^53) (0: not read in that stage).

    Raises:
      error: one line naming the file: not readable, out of bounds, not JSON
        or YAML (with the line and column), YAML anchors, aliases, merge keys
        or tags, a key twice, a step that is not an integer or is given twice
        (``"0"`` and ``"00"``), a stage that is not a mapping, a rate that is
        not a number >= 0, no stage at step 0.
    """
    bounds = dict(error=error, max_bytes=MAX_SCHEDULE_BYTES, max_nodes=MAX_SCHEDULE_VALUES,
                  what="mixture schedule")
    reader = bounded_yaml if path.endswith((".yaml", ".yml")) else bounded_json
    raw = reader.read_file(path, **bounds)
    if not isinstance(raw, dict) or not raw:
        raise error(f"{path}: a mixture schedule is a mapping {{step: {{task: rate}}}} "
                    f"(got {bounded_json.short(raw)})")
    out: dict[int, dict[str, float]] = {}
    for key, stage in raw.items():
        step = _step(key)
        if step is None:
            raise error(f"{path}: schedule step {bounded_json.short(key)} is not an integer in [0, 2^62)")
        if step in out:  # "0" and "00": which stage counts would depend on the keys' order
            raise error(f"{path}: step {step} is given twice (stage keys {bounded_json.short(key)} and another)")
        if not isinstance(stage, dict) or not stage:
            raise error(f"{path}: the stage at step {step} must map tasks to rates "
                        f"(got {bounded_json.short(stage)})")
        rates = {}
        for name, rate in stage.items():
            if "\x00" in str(name):  # no file system takes it: one line here, not "embedded null byte" later
                raise error(f"{path}: the cache {bounded_json.short(name)} at step {step} holds a NUL character")
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < MAX_RATE:
                raise error(f"{path}: rate of {bounded_json.short(name)} at step {step} is "
                            f"{bounded_json.short(rate)}, expected a number >= 0 (below 2^53)")
            rates[str(name)] = float(rate)
        out[step] = rates
    if 0 not in out:
        raise error(f"{path}: a mixture schedule starts at step 0 (its first stage is at step {min(out)})")
    return dict(sorted(out.items()))


def _step(key: Any) -> int | None:
    """A stage key as a step: an integer (YAML) or a string of ASCII digits
    (JSON), in [0, 2^62); None otherwise."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19:
        key = int(key)
    if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < MAX_STEP:
        return key
    return None
