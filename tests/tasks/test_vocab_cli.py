"""The ``seqcache vocab`` command group."""

import hashlib

from click.testing import CliRunner

from seqcache.cli.commands.vocab import vocab


def test_vocab_train_is_deterministic_and_encode(corpora, tmp_path):
    runner = CliRunner()
    src = f"text:{corpora.botchan}"
    outs = []
    for name in ("a.model", "b.model"):
        out = tmp_path / name
        result = runner.invoke(vocab, ["train", "--source", src, "--vocab-size", "600", "--max-records", "2000",
                                       "--seed", "3", "--output", str(out)])
        assert result.exit_code == 0, result.output
        outs.append(hashlib.sha256(out.read_bytes()).hexdigest())
    assert outs[0] == outs[1]
    result = runner.invoke(vocab, ["encode", "--vocabulary", str(tmp_path / "a.model"), "--pieces", "the school"])
    assert result.exit_code == 0, result.output
    ids_line, pieces_line = result.output.strip().split("\n")
    assert all(i.isdigit() for i in ids_line.split())
    assert "".join(pieces_line.split()).replace("\u2581", "") == "theschool"


def test_vocab_encode_byte_and_errors(tmp_path):
    runner = CliRunner()
    result = runner.invoke(vocab, ["encode", "hé"])
    assert result.exit_code == 0 and result.output.split() == ["107", str(0xC3 + 3), str(0xA9 + 3)]
    bad = runner.invoke(vocab, ["encode", "--vocabulary", "wordpiece", "x"])
    assert bad.exit_code == 2 and "expected 'byte' or the path" in bad.output
    missing = runner.invoke(vocab, ["train", "--source", f"text:{tmp_path}/*.none", "--vocab-size", "300",
                                    "--output", str(tmp_path / "x.model")])
    assert missing.exit_code == 1 and "no file matches" in missing.output
    spec = runner.invoke(vocab, ["train", "--source", "csv:x", "--vocab-size", "300", "--output", "x.model"])
    assert spec.exit_code == 2 and "accepted source specs" in spec.output


def test_vocab_check_names_lines_by_number_and_byte(corpora, tmp_path):
    runner = CliRunner()
    model = tmp_path / "m.model"
    trained = runner.invoke(vocab, ["train", "--source", f"text:{corpora.botchan}",
                                    "--vocab-size", "400", "--max-records", "2000", "--output", str(model)])
    assert trained.exit_code == 0, trained.output
    text = tmp_path / "t.txt"
    text.write_text("plain line\nspaces  collapsed\nmeta \u2581 symbol\n", encoding="utf-8")
    out = runner.invoke(vocab, ["check", "--vocabulary", str(model), "--source", f"text:{text}"])
    assert out.exit_code == 1
    shown = [line.strip() for line in out.output.splitlines()[1:]]
    # Record numbers of text lines are byte offsets; the report turns them into line numbers.
    assert [line.split(" (")[0] for line in shown] == [f"{text} line 2", f"{text} line 3"]
    assert "line 2 (byte 11) (normalisation" in shown[0] and "line 3 (byte 29) (contains U+2581" in shown[1]
