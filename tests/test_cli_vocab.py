"""``seqcache vocab train --model``, the bad-input counts it prints, its
trainer errors in its own option names, ``vocab check`` and ``build``/``show``
with a tokenizer.json."""

from __future__ import annotations

import hashlib
import json
import os
import re

import pytest
from click.testing import CliRunner

from seqcache.cli.main import main
from seqcache.cli.commands.vocab import option_names
from testsupport import write_lines


def _train(runner, *args):
    return runner.invoke(main, ["vocab", "train", *args])


@pytest.mark.parametrize("model", ["bpe", "unigram"])
def test_train_a_tokenizer_json_twice_gives_the_same_bytes(model, corpora, tmp_path):
    runner = CliRunner()
    src = f"text:{corpora.botchan}"
    digests = []
    for name in ("a.json", "b.json"):
        out = runner.invoke(main, ["vocab", "train", "--model", model, "--source", src, "--vocab-size", "500",
                                   "--max-records", "1000", "--seed", "2", "--output", str(tmp_path / name)])
        assert out.exit_code == 0, out.output
        assert f"tokenizers {model} vocabulary" in out.output and "pad 0, eos 1, unk 2" in out.output
        digests.append(hashlib.sha256((tmp_path / name).read_bytes()).hexdigest())
    assert digests[0] == digests[1]
    assert json.loads((tmp_path / "a.json").read_text())["model"]["type"] == {"bpe": "BPE", "unigram": "Unigram"}[model]
    encoded = runner.invoke(main, ["vocab", "encode", "--vocabulary", str(tmp_path / "a.json"), "--pieces", "the school"])
    assert encoded.exit_code == 0, encoded.output
    ids_line, pieces_line = encoded.output.strip().split("\n")
    assert all(i.isdigit() for i in ids_line.split()) and len(ids_line.split()) == len(pieces_line.split())


def _counts(output: str) -> dict[str, tuple[int, int, int]]:
    """The rows of the bad-input table: kind -> (skipped, replaced, kept)."""
    out = {}
    for m in re.finditer(r"(\w+)\s*\W\s*([\d,]+)\s*\W\s*([\d,]+)\s*\W\s*([\d,]+)", output):
        out[m.group(1)] = tuple(int(g.replace(",", "")) for g in m.groups()[1:])
    return out


@pytest.mark.parametrize("model", ["sentencepiece", "bpe", "unigram"])
def test_train_prints_skipped_replaced_and_kept_per_kind(model, corpora, tmp_path):
    bad = tmp_path / "bad.txt"
    lines = ["plain text", "", "a control \x01 character", "meta \u2581 symbol", "   ", "", "two \x02 \x03 here"]
    bad.write_text("\n".join(lines) + "\n", encoding="utf-8")
    expected = {  # from the lines written above, by the actions given below
        "control_characters": (0, sum("\x01" in l or "\x02" in l for l in lines), 0),
        "u2581": (0, 0, sum("\u2581" in l for l in lines)),
        "empty": (lines.count(""), 0, 0),
        "whitespace": (sum(bool(l) and l.isspace() for l in lines), 0, 0),
    }
    out = tmp_path / ("v.model" if model == "sentencepiece" else "v.json")
    result = _train(CliRunner(), "--model", model, "--source", f"text:{bad}",
                    "--source", f"text:{corpora.botchan}",
                    "--on-error", "empty=skip", "--on-error", "whitespace=skip",
                    "--on-error", "control_characters=replace", "--on-error", "u2581=keep",
                    "--vocab-size", "400", "--max-records", "2000", "--output", str(out))
    assert result.exit_code == 0, result.output
    botchan = corpora.botchan.read_bytes().count(b"\n")
    assert f"bad input in {len(lines) + botchan:,} records read" in result.output
    assert _counts(result.output) == expected


def test_clean_input_says_so_and_the_output_ending_is_checked(corpora, tmp_path):
    runner = CliRunner()
    src = f"text:{corpora.botchan}"
    ok = _train(runner, "--source", src, "--vocab-size", "400", "--max-records", "500", "--output", str(tmp_path / "m.model"))
    lines = corpora.botchan.read_bytes().count(b"\n")
    assert ok.exit_code == 0 and f"{lines:,} records read, no bad input" in ok.output
    wrong = _train(runner, "--model", "bpe", "--source", src, "--vocab-size", "400", "--output", str(tmp_path / "t.model"))
    assert wrong.exit_code == 2 and "--model bpe writes a .json file" in wrong.output
    mixed = _train(runner, "--model", "bpe", "--model-type", "bpe", "--source", src, "--vocab-size", "400",
                   "--output", str(tmp_path / "t.json"))
    assert mixed.exit_code == 2 and "--model-type chooses SentencePiece's algorithm" in mixed.output


def test_sentencepiece_errors_name_this_commands_options(corpora, tmp_path):
    # Japanese text needs thousands of characters: 300 pieces cannot cover them.
    result = _train(CliRunner(), "--source", f"text:{corpora.sentencepiece_data / 'wagahaiwa_nekodearu.txt'}",
                    "--vocab-size", "300", "--max-records", "3000", "--output", str(tmp_path / "ja.model"))
    assert result.exit_code == 1
    assert "--vocab-size" in result.output and "--character-coverage" in result.output
    assert "vocab_size" not in result.output and "character_coverage" not in result.output
    assert "src/trainer_interface.cc" not in result.output
    assert not (tmp_path / "ja.model").exists()
    # The translation itself, on SentencePiece's two wordings.
    assert option_names("Increase vocab_size or decrease character_coverage with --character_coverage option.") == \
        "Increase --vocab-size or decrease --character-coverage."


def test_check_reports_what_a_tokenizer_json_changes(corpora, tmp_path):
    runner = CliRunner()
    src = f"text:{corpora.botchan}"
    for model, norm in (("unigram", "nfkc"), ("bpe", "identity")):
        trained = _train(runner, "--model", model, "--normalization", norm, "--source", src, "--vocab-size", "500",
                         "--max-records", "2000", "--output", str(tmp_path / f"{model}.json"))
        assert trained.exit_code == 0, trained.output
    text = tmp_path / "t.txt"
    lines = ["plain line", "the \ufb01ne ligature", "meta \u2581 symbol"]
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    starts = [len("\n".join(lines[:k]).encode("utf-8")) + (k > 0) for k in range(3)]
    uni = runner.invoke(main, ["vocab", "check", "--vocabulary", str(tmp_path / "unigram.json"), "--source",
                               f"text:{text}", "--json"])
    assert uni.exit_code == 1, uni.output
    report = json.loads(uni.stdout)
    assert report["records"] == 3 and report["by_reason"] == {"normalisation": 1, "contains U+2581": 1}
    assert [e["record_number"] for e in report["examples"]] == starts[1:]  # byte offsets of lines 2 and 3
    # Byte-level BPE without normalisation is lossless.
    bpe = runner.invoke(main, ["vocab", "check", "--vocabulary", str(tmp_path / "bpe.json"), "--source", f"text:{text}"])
    assert bpe.exit_code == 0 and "3 records checked, 0 change" in bpe.output


def test_build_with_a_tokenizer_json_and_show_decodes(corpora, tmp_path):
    runner = CliRunner()
    corpus = tmp_path / "in"
    lines = corpora.shakespeare_lines(1500)
    write_lines(corpus / "a.txt", lines)
    tok = tmp_path / "tokenizer.json"
    trained = _train(runner, "--model", "bpe", "--source", f"text:{corpus}/a.txt", "--on-error", "empty=skip",
                     "--vocab-size", "600", "--output", str(tok))
    assert trained.exit_code == 0, trained.output
    built = runner.invoke(main, ["build", "--source", f"text:{corpus}/a.txt", "--on-error", "empty=skip", "--name", "shk",
                                 "--vocabulary", str(tok), "--num-shards", "2", "--cache-dir", str(tmp_path / "c")])
    assert built.exit_code == 0, built.output
    cache = os.path.join(tmp_path, "c", "shk", "train")
    info = json.loads(runner.invoke(main, ["info", cache, "--json"]).output)
    desc = info["vocabularies"]["targets"]
    assert desc["kind"] == "hf_tokenizer" and desc["sha256"] == hashlib.sha256(tok.read_bytes()).hexdigest()
    assert desc["eos_token"] == "</s>"
    shown = json.loads(runner.invoke(main, ["show", cache, "--index", "0", "--count", "5", "--json"]).output)
    texts = [seg["text"] for ex in shown for seg in ex["features"]["targets"]["segments"]]
    assert len(texts) == 5 and all(t in lines and t for t in texts)
    assert runner.invoke(main, ["verify", cache]).exit_code == 0


def test_vocab_check_reads_both_sides_of_a_parallel_source(tmp_path):
    (tmp_path / "a.en").write_text("a cat\na dog\n", encoding="utf-8")
    (tmp_path / "a.de").write_text("eine Katze\nein Hund\n", encoding="utf-8")
    out = CliRunner().invoke(main, ["vocab", "check", "--vocabulary", "byte", "--json", "--source",
                                    f"parallel:inputs={tmp_path / 'a.en'},targets={tmp_path / 'a.de'}"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["records"] == 4
