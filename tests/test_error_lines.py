"""Error lines repeat a user's values cut to a few hundred characters, with
each value's full length (``seqcache.cli.commands.common.cut_values``): a
120 KB ``--cache-dir`` or task name makes a line of a few hundred characters
that still shows how the value starts and ends, in every way a command says
``error:`` (its own lines, click's usage errors, the training commands'
``fail_line``) and from the real executable."""

import subprocess
import sys

import pytest
from click.testing import CliRunner

from seqcache.cli.commands import common
from seqcache.cli.main import main

HUGE = 120_000
# An error line with one cut value: the value's head, tail and length, and the message around it.
LINE_LIMIT = common.VALUE_HEAD + common.VALUE_TAIL + 200


def _huge_path(tmp_path, n=HUGE):
    """A path of ``n`` characters under ``tmp_path`` that ends differently from how it starts."""
    prefix = f"{tmp_path}/"
    return prefix + "a" * (n - len(prefix) - 4) + "tail"


def _cut(value):
    return f"{value[:common.VALUE_HEAD]}...{value[-common.VALUE_TAIL:]} [{len(value):,} characters]"


def test_cut_value_keeps_a_short_value_and_cuts_a_long_one_stating_its_length():
    assert common.cut_value("x" * common.VALUE_LIMIT) == "x" * common.VALUE_LIMIT
    value = "h" * 150 + "m" * 1000 + "t" * 150
    assert common.cut_value(value) == "h" * 150 + "m" * 50 + "..." + "t" * 60 + " [1,300 characters]"
    assert common.cut_value(value, 9).endswith(" [9 characters]")


def test_cut_values_cuts_given_values_with_spaces_and_long_runs_and_keeps_the_rest():
    spaced = "a b " * 1000
    run = "/data/" + "x" * 5000 + ".txt"
    message = f"task {spaced!r} reads '{run}': no such file; give --module"
    out = common.cut_values(message, [spaced, "short"])
    assert out == f"task '{_cut(spaced)}' reads '{_cut(run)}': no such file; give --module"
    assert common.cut_values(out, [spaced]) == out  # cutting again changes nothing
    assert common.cut_values("short message", []) == "short message"
    # A value written by repr (a newline as \\n) is found in that form, and the length stated is the value's.
    lines = "line\n" * 100
    form = repr(lines)[1:-1]
    assert common.cut_values(f"bad name {lines!r}", [lines]) == \
        f"bad name '{form[:common.VALUE_HEAD]}...{form[-common.VALUE_TAIL:]} [500 characters]'"


def _error_lines(output):
    return [x for x in output.splitlines() if x.startswith(("error:", "Error:"))]


def test_a_huge_cache_folder_is_cut_in_the_error_line(tmp_path):
    path = _huge_path(tmp_path)
    res = CliRunner().invoke(main, ["info", path])
    assert res.exit_code == 1, res.output[:2000]
    assert _error_lines(res.output) == [f"error: {_cut(path)}: no such cache folder"]


def test_a_huge_task_name_is_cut_in_the_usage_error(tmp_path):
    name = "t" * (HUGE - 4) + "tail"
    res = CliRunner().invoke(main, ["build", name, "--cache-dir", str(tmp_path)])
    assert res.exit_code == 2, res.output[:2000]
    (line,) = _error_lines(res.output)
    assert line.startswith(f"Error: no task or mixture named '{_cut(name)}'; ") and len(line) < LINE_LIMIT, line


def test_a_huge_path_with_spaces_is_cut_where_it_is_given_whole(tmp_path):
    path = f"{tmp_path}/" + "a b " * (HUGE // 4)
    res = CliRunner().invoke(main, ["info", path])
    assert res.exit_code == 1, res.output[:2000]
    assert _error_lines(res.output) == [f"error: {_cut(path)}: no such cache folder"]


def test_the_training_commands_error_line_is_cut(tmp_path):
    pytest.importorskip("jax")
    path = _huge_path(tmp_path)
    res = CliRunner().invoke(main, ["eval", "--checkpoint-dir", path])
    assert res.exit_code == 1, res.output[:2000]
    (line,) = _error_lines(res.output)
    assert line.startswith(f"error: {_cut(path)}: no config.json") and len(line) < LINE_LIMIT, line


@pytest.mark.parametrize("command", [["info"], ["clean"], ["build", "--source", "text:{path}", "--name", "t",
                                                             "--cache-dir", "{tmp}"]])
def test_the_executable_prints_one_short_line_for_a_huge_path(tmp_path, command):
    """As a user runs it: one line on stderr, a few hundred characters, the
    value's length stated (``clean`` gave a traceback: the file system refuses
    the name of the lock beside the folder)."""
    path = _huge_path(tmp_path)
    args = [a.format(path=path, tmp=tmp_path) for a in command] + ([path] if len(command) == 1 else [])
    done = subprocess.run([sys.executable, "-m", "seqcache.cli", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and done.stdout == "", done.stderr[-2000:]
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: ") and len(line) < LINE_LIMIT, line
    assert f"{tmp_path}/" in line and "aaatail" in line and " characters]" in line, line
