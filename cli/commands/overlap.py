"""``seqcache overlap``: which examples share n-grams with a benchmark, and when the run reads them."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import click

from seqcache import format as fmt
from seqcache.cli.commands import common
from seqcache.cli.commands.build_run import beam_logging, beam_pipeline_args
from seqcache.cli.commands.which import read_state, resolve
from seqcache.feeders.provenance import open_checked, check_as_feeder
from seqcache.feeders.stream import check_same_features, open_mixture
from seqcache.pipelines import overlap as overlap_lib
from seqcache.pipelines.runner import RunnerError
from seqcache.tasks.contamination import Benchmark


def _open_state(kw: dict, state_path):
    """(state, its file, opened caches checked against it) or (None, None, None)."""
    if "state" in kw:  # CACHE_OR_MIXTURE is the state (or a checkpoint step folder)
        return kw["state"], kw["state_path"], open_checked(kw["state"], cache=None, mixture=None,
                                                                  caches_root=None, split=kw["split"])
    if state_path is None:
        return None, None, None
    state = read_state(state_path, kw.get("global_batch_size"), kw.get("seed"), kw.get("num_epochs"))
    opened = open_checked(state["state"], cache=kw.get("cache"), mixture=kw.get("mixture"),
                           caches_root=kw.get("caches_root"), split=kw["split"])
    return state["state"], state_path, opened


def _open_run(kw: dict, state_path, *, host_count, before_step):
    """(opened caches, stream or None, run dict or None, before_step) for the
    resolved target ``kw`` (``which.resolve``) and an optional ``--state``."""
    state, state_file, opened = _open_state(kw, state_path)
    if state is not None:
        b = state["global_batch_size"]
        stream = opened.stream(seed=state["seed"], num_epochs=state["num_epochs"], global_batch_size=b)
        check_as_feeder(opened, stream, global_batch_size=b, num_epochs=state["num_epochs"],
                        feature=state["feature"], sequence_length=state["sequence_length"])
        step = state["position"] // b
        run = {"state": os.path.abspath(state_file), "state_step": step, "seed": state["seed"],
               "global_batch_size": b, "num_epochs": state["num_epochs"]}
        before_step = step if before_step is None else before_step
    else:
        opened = open_mixture(cache=kw.get("cache"), mixture=kw.get("mixture"), caches_root=kw.get("caches_root"),
                              split=kw["split"])
        b = kw.get("global_batch_size")
        if b is None:
            return opened, None, None, None
        check_same_features(opened.paths, opened.readers)
        seed = 0 if kw.get("seed") is None else kw["seed"]
        stream = opened.stream(seed=seed, num_epochs=kw.get("num_epochs"), global_batch_size=b)
        run = {"state": None, "state_step": None, "seed": seed, "global_batch_size": b,
               "num_epochs": kw.get("num_epochs")}
    run.update(hosts=host_count, mixture=[{"cache": p, "rate": r} for p, r in zip(opened.paths, opened.rates)],
               schedule=opened.stages)
    if b % host_count:
        opened.close()
        raise click.UsageError(f"--hosts {host_count} does not divide the global batch of {b} rows")
    return opened, stream, run, before_step


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
               epilog="Any other --flag is passed to Beam as a pipeline option, as for seqcache build: "
               "--runner=dask --dask_client_address=HOST:PORT, or --direct_num_workers=2 "
               "--direct_running_mode=multi_processing.")
@click.argument("benchmark", metavar="BENCHMARK_SPEC")
@click.argument("target", metavar="CACHE_OR_MIXTURE")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False),
              help="The result: FILE.json, or FILE.parquet (one row per match, the rest in its metadata).")
@click.option("--ngram", "n", type=click.IntRange(min=1), default=13, show_default=True,
              help="n: an item overlaps a segment that shares n consecutive normalised words with it.")
@click.option("--min-words", type=click.IntRange(min=1), default=8, show_default=True,
              help="Items shorter than n but of at least this many words are matched whole; shorter ones are "
              "counted as too short.")
@click.option("--state", "state_path", type=click.Path(exists=True, dir_okay=False),
              help="A saved feeder state (JSON) of the run: when each overlapping example is first read.")
@click.option("--batch-size", type=click.IntRange(min=1), help="Global batch size B of the run (without --state).")
@click.option("--seed", type=click.IntRange(min=0), help="Feeder seed of the run (default 0; without --state).")
@click.option("--num-epochs", type=click.IntRange(min=1), help="For finite runs: epochs per task.")
@click.option("--hosts", "host_count", type=click.IntRange(min=1), default=1, show_default=True,
              help="Hosts H of the run: the host that reads each first occurrence.")
@click.option("--before-step", type=click.IntRange(min=0),
              help="Count the items first read before step N [default with --state: the state's step].")
@click.option("--max-matches", type=click.IntRange(min=0), default=100, show_default=True,
              help="Matches listed per item (the counts are always whole).")
@common.caches_options(common.schedule_option("JSON or YAML {step: {cache path: rate}}; cache paths relative to "
                                              "CACHE_OR_MIXTURE."))
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True, help=common.WORKERS_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("-v", "--verbose", is_flag=True, help="Log Beam's progress.")
def overlap(benchmark, target, args, output, n, min_words, state_path, batch_size, seed, num_epochs, host_count,
            before_step, max_matches, mixture_rates, schedule, cache_dir, split, modules, workers, as_json, verbose):
    """Find the examples of CACHE_OR_MIXTURE that share an n-gram of normalised
    words with an item of BENCHMARK_SPEC, and when a run reads them first.

    BENCHMARK_SPEC is a source spec, as for `seqcache build --source`
    (jsonl:test.jsonl#question, jsonl:test.jsonl#q=question,a=answer,
    parquet:..., text:..., hf:PATH@SPLIT#COLUMN): one item per record.
    CACHE_OR_MIXTURE is what `seqcache which` takes. The caches' examples are
    decoded with their stored vocabularies, segment by segment and text
    feature by text feature, on Beam (the local engine unless --runner).

    With --state, or --batch-size (and --seed, --hosts, --mixture-rate or
    --mixture-schedule, as for `seqcache which`), each example's first read
    (epoch 0: step, row, host) is given, and --before-step N counts the
    items read before step N. See docs/overlap.md.
    """
    t0 = time.perf_counter()
    if not output.lower().endswith((".json", ".parquet")):
        raise click.BadParameter(f"{output}: the output is a .json or a .parquet file", param_hint="--output")
    extra = [a for a in args if not a.startswith("-")]
    if extra:
        raise click.UsageError(f"unexpected argument(s) {extra}: give BENCHMARK_SPEC and CACHE_OR_MIXTURE; Beam "
                               "options take the --flag=value form")
    pipeline_args = common.with_workers(beam_pipeline_args(args, "--runner=dask --dask_client_address=HOST:PORT"),
                                        workers)
    beam_logging(pipeline_args, verbose=verbose)
    kw = resolve(target, mixture_rates, cache_dir, split, modules, batch_size, seed, num_epochs, schedule)
    kw.setdefault("split", split)
    kw.setdefault("seed", seed)
    kw.setdefault("num_epochs", num_epochs)
    if "state" in kw:
        kw["state_path"] = target
    run_asked = state_path is not None or "state" in kw or kw.get("global_batch_size") is not None
    if not run_asked and (seed is not None or num_epochs is not None or before_step is not None or host_count != 1):
        raise click.UsageError("--seed, --num-epochs, --hosts and --before-step describe a run: give --batch-size "
                               "or --state too")
    result = _scan(benchmark, kw, output, pipeline_args=pipeline_args, state_path=state_path, host_count=host_count,
                   before_step=before_step, n=n, min_words=min_words, max_matches=max_matches, verbose=verbose)
    _report(result, output, time.perf_counter() - t0, as_json=as_json)


def _scan(benchmark, kw, output, *, pipeline_args, state_path, host_count, before_step, n, min_words, max_matches,
          verbose) -> dict:
    """Loads the benchmark, opens the run, scans and writes the result; errors
    as one line and exit status 1."""
    try:
        bench = Benchmark.load(benchmark, n=n, min_words=min_words)
    except (ValueError, FileNotFoundError, ImportError) as e:
        common.fail(f"benchmark {benchmark}: {e}")
    try:
        opened, stream, run, before_step = _open_run(kw, state_path, host_count=host_count,
                                                     before_step=before_step)
    except (fmt.CacheError, ValueError) as e:
        common.fail(str(e))
    try:
        refused = _own_input(output, bench, opened.paths)
        if refused:
            common.print_error(refused)
            sys.exit(2)
        _check_writable(output)
        with common.worker_stderr(verbose=verbose):
            result = overlap_lib.find_overlap(
                bench, opened, pipeline_args=pipeline_args, stream=stream, run=run, before_step=before_step,
                max_matches=max_matches, scratch_parent=os.path.dirname(os.path.abspath(output)))
        try:
            overlap_lib.write_result(result, output)
        except OSError as e:
            raise OSError(f"cannot write --output {output}: {e.strerror or e}") from e
    except (fmt.CacheError, ValueError, RuntimeError, RunnerError, OSError) as e:
        common.fail((common.error_line(e).splitlines() or [type(e).__name__])[0])
    finally:
        opened.close()
    return result


def _own_input(output: str, bench, cache_paths) -> str | None:
    """The error line when ``output`` would overwrite what the scan reads: a
    file inside a scanned cache's folder, or a benchmark file; else None."""
    out = os.path.realpath(output)
    for path in cache_paths:
        root = os.path.realpath(path)
        if out == root or out.startswith(root.rstrip(os.sep) + os.sep):
            return f"--output {output} is inside the scanned cache {path}: write the result outside it"
    for path in sorted({item.path for item in bench.items}):
        if out == os.path.realpath(path):
            return f"--output {output} is a file of the benchmark: write the result to another file"
    return None


def _check_writable(output: str) -> None:
    """Makes the output's folder and tries a file there before the scan; an OSError names the output."""
    folder = os.path.dirname(os.path.abspath(output))
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".overlap-"):
            pass
    except OSError as e:
        raise OSError(f"cannot write --output {output}: {e.strerror or e}") from e


def _report(result: dict, output: str, elapsed: float, *, as_json: bool) -> None:
    """One line (or the summary as JSON) on standard output."""
    s = result["summary"]
    if as_json:
        click.echo(json.dumps(dict(s, output=output), indent=2))
        return
    scanned = s["scanned"]
    line = (f"{output}: {s['items_with_overlap']:,} of {s['items']:,} benchmark items overlap "
            f"{s['overlapping_examples']:,} example(s) ({s['matches']:,} match(es); n={result['benchmark']['n']}, "
            f"{s['too_short']:,} item(s) too short to match"
            + (f", {s['empty']:,} empty benchmark record(s) skipped)" if s.get("empty") else ")"))
    if s["items_seen_before_step"] is not None:
        line += f"; {s['items_seen_before_step']:,} first read before step {s['before_step']:,}"
    elif s["items_seen"] is not None:
        line += f"; {s['items_seen']:,} read by the run"
    line += (f"; scanned {scanned['examples']:,} examples, {scanned['characters']:,} characters "
             f"in {elapsed:.1f} s")
    click.echo(line)
