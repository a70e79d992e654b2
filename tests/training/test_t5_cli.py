"""``seqcache train`` with the T5 model on real (inputs, targets) caches built by
the pipeline: span corruption of the C4 sample (first-fit packed, byte
vocabulary with 100 sentinel ids) and Multi30k en->de translation
(ParallelTextSource), trained, stopped and resumed; the decoder-only model on
the span-corruption cache as a prefix LM; and the refusal of a T5 model on a
language-model cache."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from seqcache import pipelines, tasks
from seqcache.cli.commands.train import train
from seqcache.tasks import preprocessors as P
from seqcache.training.metrics import read_metrics

INPUTS = 128
SPAN_TARGETS = 29  # T5's random_spans_helper(128): 142 raw tokens -> 128 inputs, 29 targets
# One encoder and one decoder layer: the same code, compiled faster.
SMALL = "model.num_layers=1 model.num_decoder_layers=1 progress=false optimizer.lr=1e-2 optimizer.warmup_steps=2"


@pytest.fixture(scope="module")
def caches(tmp_path_factory, corpora):
    root = tmp_path_factory.mktemp("t5caches")
    c4 = root / "c4"
    c4.mkdir()
    texts = corpora.c4_texts(300)
    pq.write_table(pa.table({"text": texts}), c4 / "part-0.parquet")
    sentinels = tasks.ByteVocabulary(extra_ids=100)
    span = tasks.Task(
        "c4_span",
        source=tasks.ParquetSource(str(c4 / "*.parquet"), column="text", on_error={"control_characters": "keep"}),
        output_features={"inputs": tasks.Feature(sentinels), "targets": tasks.Feature(sentinels)},
        preprocessors=[P.rekey({"inputs": None, "targets": "text"}), P.tokenize(), tasks.span_corruption(),
                       P.append_eos_after_trim()],
        packing="first_fit",
    )
    out = root / "caches"
    pipelines.build_task(span, cache_dir=str(out), config=pipelines.BuildConfig(
        num_shards=2, sequence_length={"inputs": INPUTS, "targets": SPAN_TARGETS}))
    d = corpora.multi30k
    translation = tasks.Task(
        "multi30k_en_de",
        source=tasks.ParallelTextSource({"en": str(d / "val.en.gz"), "de": str(d / "val.de.gz")}),
        output_features={"inputs": tasks.Feature(tasks.ByteVocabulary()),
                         "targets": tasks.Feature(tasks.ByteVocabulary())},
        preprocessors=[P.rekey({"inputs": "en", "targets": "de"}), P.tokenize(), P.append_eos_after_trim()],
        packing="first_fit",
    )
    pipelines.build_task(translation, cache_dir=str(out), config=pipelines.BuildConfig(
        num_shards=2, sequence_length={"inputs": INPUTS, "targets": INPUTS}))
    return out


def _train(cache_dir, task, ckpt, *extra):
    args = ["--cache-dir", str(cache_dir), "--task", task, "--batch-size", "8",
            "--checkpoint-dir", str(ckpt), *extra]
    return CliRunner().invoke(train, args, catch_exceptions=False)


def _losses(ckpt):
    return [m["loss"] for m in read_metrics(str(ckpt / "metrics.jsonl")) if "loss" in m]


@pytest.mark.slow  # the default suite resolves the same config in test_t5_config_is_resolved_from_the_span_cache
def test_t5_loss_falls_on_span_corruption(caches, tmp_path):
    ckpt = tmp_path / "span"
    res = _train(caches, "c4_span", ckpt, "--model", "t5-tiny", "--steps", "12",
                 "--sequence-length", f"targets={SPAN_TARGETS}", "--set", SMALL)
    assert res.exit_code == 0, res.output
    config = json.loads((ckpt / "config.json").read_text())
    # Resolved from the cache: the converter, the encoder length, the vocabulary
    # (256 bytes + 3 special ids + 100 sentinels).
    assert config["data"]["converter"] == "encdec" and config["sequence_length"]["inputs"] == INPUTS
    assert config["model"]["architecture"] == "t5" and config["model"]["vocab_size"] == 359
    assert "converter" in res.output and "encdec" in res.output
    losses = _losses(ckpt)
    assert len(losses) == 12
    # From about ln(359) = 5.9 nats at initialisation; measured about 3.3 after 12 steps.
    assert losses[0] > 5.0
    assert sum(losses[-3:]) / 3 < losses[0] - 1.5


def test_t5_config_is_resolved_from_the_span_cache(caches, tmp_path):
    res = _train(caches, "c4_span", tmp_path / "span", "--model", "t5-tiny", "--steps", "12",
                 "--sequence-length", f"targets={SPAN_TARGETS}", "--set", SMALL, "--dry-run")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    config = json.loads("\n".join(lines[lines.index("{"):]))
    # Resolved from the cache: the converter, the encoder length, the vocabulary
    # (256 bytes + 3 special ids + 100 sentinels).
    assert config["data"]["converter"] == "encdec" and config["sequence_length"]["inputs"] == INPUTS
    assert config["model"]["architecture"] == "t5" and config["model"]["vocab_size"] == 359
    assert config["sequence_length"] == {"inputs": INPUTS, "targets": SPAN_TARGETS}


@pytest.mark.parametrize("model, converter", [("t5-tiny", "encdec"), ("tiny", "prefix_lm")])
def test_a_bare_sequence_length_is_every_feature_the_converter_reads(caches, tmp_path, model, converter):
    """``--sequence-length N`` is N tokens for every feature the command reads, as
    in ``seqcache build``: inputs and targets for encdec, and for a decoder that
    the cache makes a prefix LM (the converter is decided by the cache)."""
    def resolved(*lengths):
        res = _train(caches, "c4_span", tmp_path / model, "--model", model, "--steps", "2", *lengths,
                     "--set", SMALL, "--dry-run")
        assert res.exit_code == 0, res.output
        lines = res.output.splitlines()
        return json.loads("\n".join(lines[lines.index("{"):]))

    config = resolved("--sequence-length", str(SPAN_TARGETS))
    assert config["data"]["converter"] == converter
    assert config["sequence_length"] == {"inputs": SPAN_TARGETS, "targets": SPAN_TARGETS}
    assert resolved("--sequence-length", f"{SPAN_TARGETS},inputs=64")["sequence_length"] == \
        {"inputs": 64, "targets": SPAN_TARGETS}
    # A length through --set, in the form of earlier releases: the inputs' over the targets'.
    assert resolved("--set", f"sequence_length={SPAN_TARGETS} inputs_sequence_length=64")["sequence_length"] == \
        {"inputs": 64, "targets": SPAN_TARGETS}


# One T5 program for the translation runs below: 8 steps of this schedule,
# checkpointed at step 4 (checkpointing is not part of the compiled step).
TRANSLATION = ("--model", "t5-tiny", "--steps", "8", "--sequence-length", str(INPUTS), "--set", SMALL,
               "--set", "checkpoint.every_steps=4")


@pytest.fixture(scope="module")
def translation_run(caches, tmp_path_factory):
    """The uninterrupted T5 run on the translation cache: (checkpoint folder, summary)."""
    ckpt = tmp_path_factory.mktemp("t5run") / "full"
    res = _train(caches, "multi30k_en_de", ckpt, *TRANSLATION)
    assert res.exit_code == 0, res.output
    return ckpt, _last_json(res.output)


def _last_json(output: str) -> dict:
    return json.loads([x for x in output.splitlines() if x.startswith("{")][-1])


def test_t5_trains_on_translation(translation_run):
    ckpt, summary = translation_run
    assert summary["end_step"] == 8
    config = json.loads((ckpt / "config.json").read_text())
    assert config["data"]["converter"] == "encdec" and config["sequence_length"]["inputs"] == INPUTS
    losses = _losses(ckpt)
    assert len(losses) == 8
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0


def test_decoder_only_model_reads_an_inputs_targets_cache_as_a_prefix_lm(caches, tmp_path):
    res = _train(caches, "c4_span", tmp_path / "prefix", "--model", "tiny", "--steps", "4",
                 "--sequence-length", f"targets={SPAN_TARGETS}",
                 "--set", "model.num_layers=1 progress=false optimizer.warmup_steps=1")
    assert res.exit_code == 0, res.output
    config = json.loads((tmp_path / "prefix" / "config.json").read_text())
    assert config["data"]["converter"] == "prefix_lm" and config["sequence_length"]["inputs"] == INPUTS
    losses = _losses(tmp_path / "prefix")
    assert losses[-1] < losses[0]


@pytest.fixture(scope="module")
def lm_cache(tmp_path_factory, shakespeare_lm_cache):
    return shakespeare_lm_cache(tmp_path_factory, num_lines=200, sequence_length=64)


def test_t5_on_a_language_model_cache_is_refused_naming_both(lm_cache, tmp_path):
    for extra in ((), ("--dry-run",)):
        res = _train(lm_cache, "shakespeare_lm", tmp_path / "t5lm", "--model", "t5-tiny", "--steps", "2",
                     "--sequence-length", "64", *extra)
        assert res.exit_code == 2, res.output
        assert ("shakespeare_lm/train: the cache has features ['targets'], but model 't5-tiny' (architecture "
                "'t5') reads features (inputs, targets)") in res.output
        assert "Traceback" not in res.output and not (tmp_path / "t5lm").exists()


def test_t5_stop_and_resume_on_a_real_cache_matches_an_uninterrupted_run(caches, translation_run, tmp_path):
    """Through ConvertedFeeder("encdec") and the real feeders, on the packed
    translation cache: --stop-at-step 4, then the same command resumes (a new
    invocation, the feeders restored from the checkpoint's state); per-step
    losses and the parameter digest equal the uninterrupted run's."""
    full, summary = translation_run
    stopped = _train(caches, "multi30k_en_de", tmp_path / "resumed", *TRANSLATION, "--stop-at-step", "4")
    assert stopped.exit_code == 0, stopped.output
    assert _last_json(stopped.output)["end_step"] == 4
    resumed = _train(caches, "multi30k_en_de", tmp_path / "resumed", *TRANSLATION)
    assert resumed.exit_code == 0, resumed.output
    assert _last_json(resumed.output)["start_step"] == 4
    assert _last_json(resumed.output)["params_sha256"] == summary["params_sha256"]
    # The digest does tell parameters apart: step 4's are not step 8's.
    assert _last_json(stopped.output)["params_sha256"] != summary["params_sha256"]
    assert _losses(tmp_path / "resumed") == _losses(full)
    saved = json.loads((tmp_path / "resumed" / "8" / "feeder" / "metadata").read_text())
    assert saved["converter"] == {"name": "encdec", "sequence_length": {"inputs": INPUTS, "targets": INPUTS}}


def test_a_model_vocabulary_smaller_than_the_cache_is_refused(caches, tmp_path):
    res = _train(caches, "multi30k_en_de", tmp_path / "small", "--model", "t5-tiny", "--steps", "2",
                 "--sequence-length", str(INPUTS), "--set", "model.vocab_size=100", "--dry-run")
    assert res.exit_code == 2 and "model.vocab_size=100 is smaller than the vocabulary" in res.output, res.output
