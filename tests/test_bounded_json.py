"""The one reading of msgspec's error text (``bounded_json.read_validation_error``),
held to the messages the installed msgspec really gives: a msgspec whose words
or field paths change fails here, not in a user's error line."""

from typing import Literal

import msgspec
import pytest

from seqcache import bounded_json, format as fmt, manifest


class Inner(msgspec.Struct):
    count: int
    kind: Literal["a", "b"] = "a"


class Outer(msgspec.Struct):
    items: list[Inner]
    lengths: dict[str, int] = {}


def _error(value) -> msgspec.ValidationError:
    with pytest.raises(msgspec.ValidationError) as caught:
        msgspec.convert(value, Outer, strict=True)
    return caught.value


@pytest.mark.parametrize("value, raw, refusal", [
    ({"items": [{"count": 1}, {"count": "7"}]}, "Expected `int`, got `str` - at `$.items[1].count`",
     bounded_json.Refusal("items[1].count", "expected `int`", True, "7")),
    ({"items": [{}]}, "Object missing required field `count` - at `$.items[0]`",
     bounded_json.Refusal("items[0]", "object missing required field `count`", False)),
    ({"items": [{"count": 1, "kind": "c"}]}, "Invalid enum value 'c' - at `$.items[0].kind`",
     bounded_json.Refusal("items[0].kind", "invalid enum value", True, "c")),
    ({"items": [], "lengths": {"targets": "x"}}, "Expected `int`, got `str` - at `$.lengths[...]`",
     bounded_json.Refusal("lengths.targets", "expected `int`", True, "x")),
    ({"items": [], "lengths": {"inputs": 1, "targets": "x"}}, "Expected `int`, got `str` - at `$.lengths[...]`",
     bounded_json.Refusal("lengths[...]", "expected `int`, got `str`", False)),
    ([], "Expected `object`, got `array`", bounded_json.Refusal("", "expected `object`", True, [])),
])
def test_msgspec_errors_read_as_their_field_and_words(value, raw, refusal):
    error = _error(value)
    assert str(error) == raw, "msgspec words its errors differently: update read_validation_error"
    assert bounded_json.read_validation_error(error, value) == refusal


def test_the_prefix_names_the_value_itself():
    value = {"items": [{"count": None}]}
    got = bounded_json.read_validation_error(_error(value), value, "config")
    assert got == bounded_json.Refusal("config.items[0].count", "expected `int`", True)


def test_both_wordings_come_from_the_one_reading():
    with pytest.raises(ValueError, match=r"^s.json: items\[0\].count: expected `int` \(got '7'\)$"):
        bounded_json.convert({"items": [{"count": "7"}]}, Outer, path="s.json")
    with pytest.raises(fmt.CacheError, match=r"^manifest.json: items\[0\].count is '7': expected `int`$"):
        manifest.convert({"items": [{"count": "7"}]}, Outer)
    with pytest.raises(fmt.CacheError, match=r"^manifest.json: items\[0\]: object missing required field `count`$"):
        manifest.convert({"items": [{}]}, Outer)


def test_a_folder_or_a_pipe_is_not_read_and_is_named(tmp_path):
    import os

    (tmp_path / "dir.json").mkdir()
    os.mkfifo(tmp_path / "pipe.json")  # opened without waiting for a writer
    for name, kind in (("dir.json", "a folder"), ("pipe.json", "a pipe, socket or device")):
        with pytest.raises(ValueError) as e:
            bounded_json.read_file(str(tmp_path / name), what="feeder state")
        assert str(e.value) == f"{tmp_path / name}: cannot read the feeder state: not a regular file ({kind})"
    (tmp_path / "ok.json").write_text('{"a": 1}')
    assert bounded_json.read_file(str(tmp_path / "ok.json")) == {"a": 1}
