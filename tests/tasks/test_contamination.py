"""seqcache.tasks.contamination: normalisation, stable n-gram hashes, matching."""

import json
import os
import subprocess
import sys
import unicodedata

import numpy as np
import pytest

from seqcache.tasks import contamination as cont

ITEM = ("The committee approved the new budget for the regional hospital after a long debate "
        "about nurses' salaries and the cost of equipment.")


def _bench(*texts, **kw):
    return cont.Benchmark([cont.BenchmarkItem(i, "bench.jsonl", "byte_offset", 100 * i, t)
                           for i, t in enumerate(texts)], **kw)


def test_normalisation_drops_case_whitespace_punctuation_and_compatibility_forms():
    assert cont.normalize_words("The  QUICK,\tbrown-fox!\n") == ["the", "quick", "brown", "fox"]
    # NFKC: full-width letters, the fi ligature, superscript two, no-break space.
    assert cont.normalize_words("ＡＢＣ ﬁne x² a\u00a0b") == ["abc", "fine", "x2", "a", "b"]
    # casefold, not lower: German sharp s; decomposed e + acute composes to one word.
    assert cont.normalize_words("STRASSE straße Cafe\u0301 café") == ["strasse", "strasse", "café", "café"]
    # The underscore separates (\w minus _); letters and digits of other scripts are words.
    assert cont.normalize_words("snake_case Привет 東京 ١٢٣") == ["snake", "case", "привет", "東京", "١٢٣"]
    assert cont.normalize_words(" ... --- ") == []


@pytest.mark.parametrize("text", [
    "Hello, world!  Two  spaces", "a\u00a8b ¨ c", "x\u0301y  \u0301z", "ﬁ½⁄3 ①②", "tab\tnew\nline",
    "Émile «quoted» — dash", ITEM, "",
])
def test_offsets_give_the_same_words_and_point_into_the_text(text):
    words, starts, ends = cont.words_with_offsets(text)
    assert words == cont.normalize_words(text)
    for w, s, e in zip(words, starts, ends):
        assert w in "".join(cont.normalize_words(text[s:e]))


def test_ngram_hashes_match_the_polynomial_and_the_word_spans():
    words = cont.normalize_words(ITEM)
    h = cont.ngram_hashes_of(cont.word_hashes(words), 13)
    assert h.dtype == np.uint64 and h.shape == (len(words) - 12,)
    # Element i is the hash of words[i:i+13]: the same n-gram elsewhere hashes the same.
    assert cont.ngram_hashes_of(cont.word_hashes(words[5:18]), 13)[0] == h[5]
    assert len(set(h.tolist())) == len(h)
    assert cont.ngram_hashes_of(cont.word_hashes(words[:12]), 13).shape == (0,)
    with pytest.raises(ValueError, match="n-gram length must be >= 1"):
        cont.ngram_hashes_of(cont.word_hashes(words), 0)


# Golden values: changing them changes every benchmark's fingerprint and every
# cache built with --exclude; it needs a NORMALIZATION_VERSION bump.
GOLDEN_FIRST_NGRAM = 0x8D7FE61EDEFA3938  # the first 13-gram of ITEM
GOLDEN_CODE = ("from seqcache.tasks import contamination as c;"
               "import json,sys;"
               "w=c.normalize_words(sys.argv[1]);"
               "print(json.dumps([int(x) for x in c.ngram_hashes_of(c.word_hashes(w), 13)]"
               " + [int(c.word_hashes(['the'])[0])]))")


def test_hashes_are_the_same_in_two_fresh_processes_with_different_hash_seeds():
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        run = subprocess.run([sys.executable, "-c", GOLDEN_CODE, ITEM], capture_output=True, text=True,
                             env=env, check=True)
        outs.append(json.loads(run.stdout))
    assert outs[0] == outs[1]
    here = [int(x) for x in cont.ngram_hashes_of(cont.word_hashes(cont.normalize_words(ITEM)), 13)]
    assert outs[0][:-1] == here
    assert here[0] == GOLDEN_FIRST_NGRAM
    import hashlib
    assert outs[0][-1] == int.from_bytes(hashlib.blake2b(b"the", digest_size=8).digest(), "little")


def test_planted_text_matches_with_its_span_and_changed_case_and_whitespace():
    bench = _bench("An unrelated item about rivers and mountains in the far north of the country today.", ITEM)
    doc = "Some preamble here.  " + ITEM.upper().replace(" ", "\n  ") + "  And an ending."
    (m,) = bench.match(doc)
    assert m.item == 1 and m.words == " ".join(cont.normalize_words(ITEM))
    assert m.ngrams == len(cont.normalize_words(ITEM)) - 12
    assert cont.normalize_words(doc[m.start:m.end]) == cont.normalize_words(ITEM)
    assert m.ngram == " ".join(cont.normalize_words(ITEM)[:13])
    # A pure function: the same answer again, and from a fresh Benchmark of the same items.
    assert bench.match(doc) == [m] == _bench(*[it.text for it in bench.items]).match(doc)


def test_a_partial_overlap_matches_at_n_words_and_not_below():
    words = ITEM.split()
    bench = _bench(ITEM)
    for k, expected in ((13, 1), (14, 1), (12, 0), (5, 0)):
        doc = "zebra quantum " + " ".join(words[3:3 + k]) + " orchid lantern"
        assert len(bench.match(doc)) == expected, k
    # n is settable.
    assert len(_bench(ITEM, n=5).match("zebra " + " ".join(words[3:8]) + " orchid")) == 1
    assert _bench(ITEM, n=5).match("zebra " + " ".join(words[3:7]) + " orchid") == []


def test_short_items_are_matched_whole_or_counted_as_too_short():
    bench = _bench("one two three four five six seven eight nine", "tiny item of five words", ITEM)
    assert bench.too_short == [1]
    assert bench.describe()["too_short"] == 1
    assert [m.item for m in bench.match("x One two three, four five six seven eight nine! y")] == [0]
    assert bench.match("x one two three four five six seven eight y") == []
    assert bench.match("a tiny item of five words b") == []


def test_fingerprint_depends_on_the_items_n_and_min_words_only():
    a = _bench(ITEM, "second item")
    assert a.fingerprint == _bench(ITEM, "second item").fingerprint
    assert a.fingerprint != _bench(ITEM, "second item.").fingerprint
    assert a.fingerprint != _bench(ITEM, "second item", n=12).fingerprint
    assert a.fingerprint != _bench(ITEM, "second item", min_words=5).fingerprint
    assert a.fingerprint != _bench("second item", ITEM).fingerprint
    assert a.size_bytes == len(ITEM.encode()) + len(b"second item")


def test_load_reads_a_source_spec_with_several_fields(tmp_path):
    p = tmp_path / "test.jsonl"
    rows = [{"question": "What is the boiling point of water at sea level in degrees Celsius, roughly?",
             "answer": "One hundred", "id": 1},
            {"question": "Name the largest planet of the solar system by mass and by volume please.",
             "answer": "Jupiter", "id": 2}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench = cont.Benchmark.load(f"jsonl:{p}#question=question,answer=answer")
    # The fields in the source's key order (sorted: answer, question).
    assert [it.text for it in bench.items] == [r["answer"] + "\n" + r["question"] for r in rows]
    assert [(it.path, it.locator, it.record_number) for it in bench.items] == [
        (str(p), "byte_offset", 0), (str(p), "byte_offset", len(json.dumps(rows[0])) + 1)]
    doc = "blah " + rows[1]["answer"] + ". " + rows[1]["question"][:-8] + " more"
    assert [m.item for m in bench.match(doc)] == [1]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="has no records"):
        cont.Benchmark.load(f"jsonl:{empty}#question")


def test_ntrex_sentences_do_not_match_c4_documents(corpora):
    bench = cont.Benchmark.load(f"text:{corpora.ntrex / 'newstest2019-src.eng.txt'}")
    assert len(bench.items) > 1000 and bench.num_ngrams > 10000
    assert sum(len(bench.match(t)) for t in corpora.c4_texts(300).to_pylist()) == 0


def test_the_ascii_path_gives_the_words_of_the_unicode_path():
    import string
    import unicodedata

    texts = [ITEM, string.printable, "snake_case x__y 3.14 e-mail C++ A1b2 \x00\x7f end", "MiXeD   CaSe\n\tTabs"]
    for text in texts:
        assert text.isascii()
        slow = cont._words(unicodedata.normalize("NFKC", text).casefold())
        assert cont.normalize_words(text) == slow


def test_combining_marks_stay_in_their_word():
    # Devanagari vowel signs and virama, Thai vowels and tone marks, Hebrew
    # points, Myanmar medials and asat: category M, inside the word.
    assert cont.normalize_words("पिछले कुछ महीनों में सेंट मार्टिन") == [
        "पिछले", "कुछ", "महीनों", "में", "सेंट", "मार्टिन"]
    assert cont.normalize_words("ภาษาไทย เป็น ภาษา") == ["ภาษาไทย", "เป็น", "ภาษา"]
    assert cont.normalize_words("שָׁלוֹם, עֲלֵיכֶם!") == ["שָׁלוֹם", "עֲלֵיכֶם"]
    assert cont.normalize_words("မြန်မာ စာ") == ["မြန်မာ", "စာ"]
    # An accent NFKC cannot compose stays on its letter; the underscore still separates.
    assert cont.normalize_words("q\u0301 snake_case") == ["q\u0301", "snake", "case"]
    # Japanese without spaces: one word per run between punctuation.
    assert cont.normalize_words("東京タワー、大阪") == ["東京タワー", "大阪"]
    # Words that differ only in their vowel signs are different words: no match
    # (split at the marks, each word's consonants alone would match).
    item = "पिछले कुछ महीनों में सेंट मार्टिन के लोगों ने समुद्र तट पर बहुत काम किया है"
    bench = _bench(item)
    other_signs = "".join("\u093e" if unicodedata.category(ch).startswith("M") else ch for ch in item)
    assert len(cont.normalize_words(item)) == 16
    assert [m.item for m in bench.match("x " + item + " y")] == [0]
    assert bench.match(other_signs) == []


def test_a_benchmark_record_without_its_field_names_the_field_and_the_record_fields(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_text('{"question": "x"}\n{"q": "y", "answer": "z"}\n')
    with pytest.raises(ValueError) as e:
        cont.Benchmark.load(f"jsonl:{path}#question")
    message = str(e.value)
    assert "has no field 'question'" in message and "['answer', 'q']" in message and str(path) in message
    assert "--on-error" not in message and "on_error" not in message


def test_empty_and_null_benchmark_records_are_counted_not_items(tmp_path):
    text = tmp_path / "b.txt"
    text.write_text("line one is here\n\n   \n" + ITEM + "\n")
    bench = cont.Benchmark.load(f"text:{text}")
    assert [item.text for item in bench.items] == ["line one is here", ITEM]
    assert bench.empty == 2 and bench.too_short == [0]
    assert bench.describe()["empty"] == 2 and bench.describe()["too_short"] == 1
    lines = [{"q": None}, {"q": ""}, {"q": 42}, {"q": 3.5}, {"q": True}, {"q": ITEM}, {"q": None, "a": "kept"}]
    records = tmp_path / "b.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in lines))
    bench = cont.Benchmark.load(f"jsonl:{records}#q")
    assert [item.text for item in bench.items] == ["42", "3.5", "True", ITEM]
    assert [item.record_number for item in bench.items][0] == len(json.dumps(lines[0])) + len(json.dumps(lines[1])) + 2
    assert bench.empty == 3
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    with pytest.raises(ValueError, match=r"has no items: its 2 record\(s\) are empty"):
        cont.Benchmark.load(f"text:{blank}")


def test_match_many_is_match_of_each_text_and_no_ngram_spans_two_texts():
    bench = _bench(ITEM, "one two three four five six seven eight nine")
    words = cont.normalize_words(ITEM)
    assert len(words) == 22
    texts = ["nothing here", "a " + ITEM + " b", " ".join(words[:11]), " ".join(words[11:]) + " tail",
             "One two three four five six seven eight nine", ""]
    many = bench.match_many(texts)
    assert many == [bench.match(t) for t in texts]
    # Texts 2 and 3 together hold ITEM, but no n-gram crosses from one to the other.
    assert [len(m) for m in many] == [0, 1, 0, 0, 1, 0]
    # The benchmark's own word hashes are the module's for its words, 0 for others.
    assert bench.word_hashes(["committee", "zebraquantum"]).tolist() == [
        int(cont.word_hashes(["committee"])[0]), 0]
    # hits() takes either, with the same answer.
    w = cont.normalize_words(texts[1])
    assert bench.hits(cont.word_hashes(w)) == bench.hits(bench.word_hashes(w)) != []
