"""``seqcache train`` end to end with the real feeder on a real cache (a packed
byte-level language-modelling cache of tinyshakespeare built by the pipeline),
on the 8 CPU devices: train, evaluate every example once, resume, refuse a
changed global batch."""

import json
import logging
import pathlib
import shutil
import statistics

import pytest
from click.testing import CliRunner

from seqcache import format as fmt
from seqcache.cli.main import main
from seqcache.cli.commands.train import train
from seqcache.training.metrics import read_metrics
from testsupport import SMALL_MODEL, train_shakespeare_lm

L = 64
# The tests' runs share two training programs, compiled once per session (see
# conftest.py): 4 steps and 6 steps of this schedule. Checkpointing and
# evaluation settings are not part of the compiled train step.
WARMUP = "optimizer.warmup_steps=2"


@pytest.fixture(scope="module")
def cache(tmp_path_factory, shakespeare_lm_cache):
    return shakespeare_lm_cache(tmp_path_factory, num_lines=600, sequence_length=L)


def _train(cache, ckpt, *extra):
    return train_shakespeare_lm(cache, ckpt, *extra, sequence_length=L)


def _last_json(output: str) -> dict:
    return json.loads([line for line in output.splitlines() if line.startswith("{")][-1])


def _schedule_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "learning-rate schedule" in r.getMessage()]


def test_train_eval_resume_and_refuse(cache, tmp_path, caplog):
    ckpt = tmp_path / "ckpt"
    manifest = fmt.read_manifest(str(cache / "shakespeare_lm" / "train"))

    first = _train(cache, ckpt, "--steps", "4", "--eval-split", "train", "--set", f"checkpoint.every_steps=2 {WARMUP}")
    assert first.exit_code == 0, first.output
    out = _last_json(first.output)
    assert out["start_step"] == 0 and out["end_step"] == 4
    # Derived quantities up front: 8 x 64 tokens per step, steps per epoch from the manifest.
    assert "tokens per step" in first.output and "512" in first.output
    assert "steps per epoch" in first.output and str(-(-manifest.num_examples // 8)) in first.output
    # Throughput: medians over the steps but the first; the CPU's MFU is unknown (null).
    lines = read_metrics(str(ckpt / "metrics.jsonl"))
    steps = [m for m in lines if "loss" in m][1:]
    for name in ("tokens_per_s", "tflops_per_s_per_device"):
        assert out[name] == statistics.median(m[name] for m in steps)
    assert out["model_flops_per_token"] == steps[0]["model_flops_per_token"] > 0 and out["mfu"] is None
    assert "model flops per token" in first.output
    # Evaluation read every example of the split once: its weighted tokens are the
    # cache's token count, and its batches cover the examples (the last one padded).
    assert out["eval_tokens"] == manifest.statistics.tokens["targets"]
    assert out["eval_batches"] == -(-manifest.num_examples // 8)
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model"]["vocab_size"] == 259 and config["global_batch_size"] == 8
    assert config["mesh"] == {"data": -1, "fsdp": 1, "model": 1}

    assert _schedule_warnings(caplog) == []
    second = _train(cache, ckpt, "--steps", "6", "--set", f"checkpoint.every_steps=2 {WARMUP}")
    assert second.exit_code == 0, second.output
    # Extending the run changes the cosine schedule's length: allowed, but said.
    (warning,) = _schedule_warnings(caplog)
    assert warning.startswith(f"resuming at step 4 with another learning-rate schedule or optimizer than the run's "
                              f"{ckpt / 'config.json'}: steps 4 -> 6 (saved -> now)")
    out = _last_json(second.output)
    assert out["start_step"] == 4 and out["end_step"] == 6
    metrics = [m for m in read_metrics(str(ckpt / "metrics.jsonl")) if "loss" in m]
    assert [m["step"] for m in metrics] == list(range(6))
    feeder_state = json.loads((ckpt / "6" / "feeder" / "metadata").read_text())
    assert feeder_state["position"] == 6 * 8 and feeder_state["global_batch_size"] == 8
    # `seqcache which` reads the feeder state of a checkpoint step folder.
    which = CliRunner().invoke(main, ["which", str(ckpt / "6"), "--step", "5", "--row", "7", "--json"])
    assert which.exit_code == 0, which.output
    assert json.loads(which.output)["position"] == 5 * 8 + 7

    refused = _train(cache, ckpt, "--steps", "8", "--batch-size", "16")
    assert refused.exit_code == 1
    assert "global batch size 8, the current config has global_batch_size=16" in refused.output
    assert json.loads((ckpt / "config.json").read_text())["global_batch_size"] == 8  # untouched

    # The resume reads the feeder state with the bounded reader: a key given twice
    # (Orbax's JsonRestore kept the last one) is one line naming the step and the file.
    metadata = ckpt / "6" / "feeder" / "metadata"
    metadata.write_text(json.dumps(feeder_state)[:-1] + ', "seed": 1}')
    damaged = _train(cache, ckpt, "--steps", "8")
    assert damaged.exit_code == 1
    (line,) = [line for line in damaged.output.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: checkpoint step 6: {metadata}: the feeder state has the key 'seed' twice"), line
    assert "Traceback" not in damaged.output, damaged.output


def test_bad_flags_are_usage_errors(cache, tmp_path):
    (tmp_path / "file").write_text("x")
    not_a_folder = _train(cache, tmp_path / "file", "--dry-run")
    assert not_a_folder.exit_code == 2 and f"--checkpoint-dir {tmp_path / 'file'}: not a folder" in not_a_folder.output
    bad_mesh = _train(cache, tmp_path / "a", "--mesh", "data=3,model=2")
    assert bad_mesh.exit_code == 2 and "has 6 devices but 8 are available" in bad_mesh.output
    bad_set = _train(cache, tmp_path / "b", "--set", "model.d_modle=3")
    assert bad_set.exit_code == 2 and "no field 'd_modle'" in bad_set.output
    bad_task = _train(cache, tmp_path / "c", "--task", "no_such_task")
    assert bad_task.exit_code == 2 and "no_such_task" in bad_task.output
    # 4 heads cannot be split over a 'model' axis of 8 devices: named parameter.
    bad_rule = _train(cache, tmp_path / "d", "--mesh", "data=1,model=8", "--rules", "tp")
    assert bad_rule.exit_code == 2 and "blocks/0/attn/w" in bad_rule.output and "'model' of size 8" in bad_rule.output
    # A sequence length longer than the cache's packed one: one error line naming
    # the cache, the feature and both lengths, in a dry run too, before anything is compiled.
    for extra in ((), ("--dry-run",)):
        long = _train(cache, tmp_path / "e", "--sequence-length", str(2 * L), *extra)
        assert long.exit_code == 1, long.output
        assert long.output == (f"error: {cache / 'shakespeare_lm' / 'train'}: sequence length {2 * L} for feature "
                               f"'targets' is longer than the cache's, {L} tokens; leave --sequence-length out to "
                               f"read rows of {L}, or give at most {L}\n")
        assert not (tmp_path / "e").exists()
    bad_length = _train(cache, tmp_path / "f", "--sequence-length", "targets=x")
    assert bad_length.exit_code == 2 and "'targets=x': expected N or FEATURE=N" in bad_length.output


def test_the_sequence_length_defaults_to_the_cache_s_and_a_given_one_cuts_rows(cache):
    args = ["--cache-dir", str(cache), "--task", "shakespeare_lm", "--batch-size", "8", "--model", "tiny",
            "--dry-run"]
    lengths = []
    for extra in ((), ("--sequence-length", "targets=32"), ("--sequence-length", "32")):
        res = CliRunner().invoke(train, args + list(extra), catch_exceptions=False)
        assert res.exit_code == 0, res.output
        lines = res.output.splitlines()
        lengths.append(json.loads("\n".join(lines[lines.index("{"):]))["sequence_length"])
    assert lengths == [{"targets": L}, {"targets": 32}, {"targets": 32}]


def test_feeder_errors_are_messages_not_tracebacks(cache, tmp_path):
    # A damaged shard (another size than the manifest's) is found when the feeder
    # opens the cache: "error: ..." and exit status 1, in a dry run too.
    damaged = tmp_path / "caches"
    shutil.copytree(cache, damaged)
    shard = damaged / "shakespeare_lm" / "train" / "data.array_record-00001-of-00002"
    shard.write_bytes(shard.read_bytes()[:-10])
    for extra in ((), ("--dry-run",)):
        res = _train(damaged, tmp_path / "ckpt", "--steps", "4", "--set", WARMUP, *extra)
        assert res.exit_code == 1, res.output
        assert f"error: {shard}: shard file has" in res.output and "Traceback" not in res.output


def test_stop_at_step_then_resume_matches_an_uninterrupted_run(cache, tmp_path, monkeypatch, caplog):
    """--stop-at-step stops like a preemption (same config, same schedule); the
    same command without it resumes in a new invocation. Per-step losses and the
    final parameter digest equal the uninterrupted run's. The resumed invocation
    reads a copy of the caches through a relative --cache-dir: caches are matched
    by fingerprint, not by path."""
    common = ("--steps", "6", "--set", f"checkpoint.every_steps=3 {WARMUP}")
    full = _train(cache, tmp_path / "full", *common)
    assert full.exit_code == 0, full.output
    stopped = _train(cache, tmp_path / "resumed", *common, "--stop-at-step", "3")
    assert stopped.exit_code == 0, stopped.output
    assert _last_json(stopped.output)["end_step"] == 3
    shutil.copytree(cache, tmp_path / "moved" / "caches")
    monkeypatch.chdir(tmp_path / "moved")
    resumed = _train(pathlib.Path("caches"), tmp_path / "resumed", *common)
    assert resumed.exit_code == 0, resumed.output
    assert _schedule_warnings(caplog) == []  # --stop-at-step keeps the schedule
    saved = json.loads((tmp_path / "resumed" / "6" / "feeder" / "metadata").read_text())
    assert saved["mixture"][0]["path"] == str(tmp_path / "moved" / "caches" / "shakespeare_lm" / "train")
    a, b = _last_json(full.output), _last_json(resumed.output)
    assert b["start_step"] == 3 and b["end_step"] == 6
    assert a["params_sha256"] == b["params_sha256"]
    losses = lambda d: [m["loss"] for m in read_metrics(str(d / "metrics.jsonl")) if "loss" in m]  # noqa: E731
    assert losses(tmp_path / "full") == losses(tmp_path / "resumed")
    # And the digest does tell parameters apart: those of step 3 (the stopped run's)
    # are other parameters than those of step 6.
    assert _last_json(stopped.output)["params_sha256"] != a["params_sha256"]


def test_a_non_finite_loss_fails_the_run(cache, tmp_path):
    out = _train(cache, tmp_path / "nan", "--steps", "3", "--set", "optimizer.lr=1e30 optimizer.warmup_steps=0 optimizer.clip_norm=null")
    assert out.exit_code == 1, out.output
    assert "the loss is not finite from step" in out.output
    # The summary line is strict JSON: the non-finite loss is null (not NaN, which only Python reads).
    line = [line for line in out.output.splitlines() if line.startswith('{"')][-1]
    summary = json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in the summary line: {line}"))
    assert summary["final_loss"] is None and summary["end_step"] == 3


def _dry_run_config(cache, *extra) -> dict:
    res = CliRunner().invoke(train, ["--cache-dir", str(cache), "--task", "shakespeare_lm", "--batch-size", "8",
                                     "--sequence-length", str(L), "--model", "tiny", "--dry-run", *extra],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    return json.loads("\n".join(lines[lines.index("{"):]))


def test_a_dry_run_refuses_a_checkpoint_the_run_would_refuse(cache, tmp_path):
    """A checkpoint of scanned layers asked for unrolled ones; of another global
    batch; of another data stream; whose feeder state is at another step; of
    other arrays, without its config.json: the dry run stops with the run's one
    line, reading config.json, Orbax's metadata and the feeder state; with the
    saved settings it passes, as it does before any step is saved."""
    runs = tmp_path / "runs"
    base = ["--cache-dir", str(cache), "--task", "shakespeare_lm", "--sequence-length", str(L), "--model", "tiny",
            "--checkpoint-dir", str(runs), "--dry-run", "--set", SMALL_MODEL]

    def refused(*extra) -> str:
        res = CliRunner().invoke(train, base + list(extra))
        lines = [x for x in res.output.splitlines() if x.startswith("error:")]
        assert res.exit_code == 1 and len(lines) == 1 and "Traceback" not in res.output, res.output
        return lines[0]

    assert CliRunner().invoke(train, base + ["--batch-size", "8"]).exit_code == 0  # nothing saved yet
    scanned = _train(cache, runs, "--steps", "4", "--set", f"checkpoint.every_steps=2 {WARMUP} model.scan_layers=true")
    assert scanned.exit_code == 0, scanned.output
    assert CliRunner().invoke(train, base + ["--batch-size", "8"]).exit_code == 0  # the layout of its config.json
    assert refused("--batch-size", "8", "--set", "model.scan_layers=false") == (
        f"error: {runs}: the checkpoint was saved with model.scan_layers=true and this run has "
        "model.scan_layers=false, which lays the parameters out otherwise (stacked layers or one per layer); resume "
        "with --set model.scan_layers=true")
    # The feeder state, as the restore reads it: another global batch, another stream.
    line = refused("--batch-size", "16")
    assert line.startswith(f"error: {runs / '4'}: ") and (
        "global batch size 8, the current config has global_batch_size=16;") in line and (
        "Use --batch-size 8, or start a new run") in line
    line = refused("--batch-size", "8", "--set", "data.seed=7")
    assert line.startswith(f"error: {runs / '4'}: ") and "seed" in line
    # The latest step as Orbax finds it (not every name of digits).
    (runs / "9").write_text("")
    (runs / "\u00b2").mkdir()
    assert CliRunner().invoke(train, base + ["--batch-size", "8"]).exit_code == 0
    # Without config.json, the arrays themselves (Orbax's metadata): the dry run and the run say the same line.
    (runs / "config.json").rename(tmp_path / "config.json")
    for extra in ([], ["--steps", "6"]):
        args = ["--batch-size", "8", *extra]
        if extra:
            base.remove("--dry-run")
        line = refused(*args)
        assert line.startswith(f"error: {runs / '4'}: the checkpoint does not hold this run's model and optimizer: ")
        assert "of this run's arrays are not in it (first: params/blocks/0/" in line
    base.append("--dry-run")
    (tmp_path / "config.json").rename(runs / "config.json")
    # A feeder state that restores to another step than its checkpoint's.
    metadata = runs / "4" / "feeder" / "metadata"
    metadata.write_text(metadata.read_text().replace('"position": 32', '"position": 16'))
    assert refused("--batch-size", "8") == (f"error: {runs / '4'}: the feeder state restores to global batch 2, "
                                            "but the checkpoint is at step 4; the checkpoint is inconsistent")


def test_a_length_for_a_feature_the_converter_does_not_read_is_refused(cache):
    res = CliRunner().invoke(train, ["--cache-dir", str(cache), "--task", "shakespeare_lm", "--batch-size", "8",
                                     "--sequence-length", f"{L},inputs=64", "--model", "tiny", "--dry-run"])
    assert res.exit_code != 0 and "sequence length given for 'inputs' (inputs=64), which converter 'lm' does not " \
        "read (it reads ['targets'])" in res.output, res.output


def test_the_init_seed_alone_leaves_the_data_stream_unchanged(cache):
    import numpy as np

    from seqcache.training import config as C
    from seqcache.training import data as D

    a, b = _dry_run_config(cache, "--seed", "0"), _dry_run_config(cache, "--seed", "7")
    # Both seeds are written into the resolved config; the data seed is not the init seed.
    assert (a["seed"], a["data"]["seed"]) == (0, C.DEFAULT_DATA_SEED)
    assert (b["seed"], b["data"]["seed"]) == (7, C.DEFAULT_DATA_SEED)
    other = _dry_run_config(cache, "--seed", "7", "--set", "data.seed=3")
    assert other["data"]["seed"] == 3

    def stream(raw):
        cfg = C.config_from_dict(raw)
        source = D.resolve_source(cfg.data, cfg.data.split)
        with D.make_feeder(cfg, source, seed=cfg.data.seed) as feeder:
            return [b"".join(np.ascontiguousarray(v).tobytes() for _, v in sorted(next(feeder).items()))
                    for _ in range(3)]

    assert stream(a) == stream(b)
    assert stream(other) != stream(a)  # the data seed does change it
