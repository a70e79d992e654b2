"""Test-wide set-up and fixtures.

Eight host-platform devices let sharding tests run on CPU; the flag must be set
before JAX is first imported, so it is set here, at collection time. The tests'
programs are compiled without LLVM's optimization passes
(``--xla_backend_optimization_level=0``): they are tiny, so compiling dominates
their cost, and this halves it; every comparison the tests make (sharded against
one device, resumed against uninterrupted, several processes against one) is
between programs compiled with the same flags, which processes the tests start
inherit; ``make test-slow`` sets ``XLA_FLAGS`` without it. This folder
goes on ``sys.path`` so that test modules can import the plain helpers of
``testsupport.py``.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

SHARED_DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"


# The modules that cost the most CPU time in the default suite, costliest first.
HEAVY_FIRST = (
    "tests/test_object_store.py", "tests/training/test_sharding.py", "tests/training/test_t5_cli.py",
    "tests/training/test_cli.py", "tests/training/test_multihost.py", "tests/training/test_t5.py",
    "tests/training/test_resume.py", "tests/pipelines/test_runners.py", "tests/pipelines/test_runners_g1.py",
    "tests/test_cli_beam_workers.py",
    "tests/training/test_step.py", "tests/training/test_attention.py",
)


# The costliest tests of what was the default suite (10 to 50 s each on 2 cores,
# their module fixtures included), marked ``heavy``: ``make test`` leaves them out
# so that the default suite stays under 5 minutes on 2 cores, ``make test-heavy``
# runs them, and so does CI (.ci/run). Each area keeps cheaper tests of the same
# guarantee in the default suite (the local engine and Prism against each other,
# one-process training, a resume, a fit on the CPU). Node ids, or their start.
HEAVY = (
    "tests/pipelines/test_dataflow_graph.py::",
    "tests/pipelines/test_exclude.py::test_dask_writes_the_same_cache_as_the_local_engine",
    "tests/pipelines/test_jvm_runners.py::test_span_corruption_first_fit_sentencepiece_is_the_same_on_flink_and_spark",
    "tests/pipelines/test_near_duplicates.py::test_the_same_bytes_on_every_run_runner_and_split",
    "tests/pipelines/test_overlap_runners.py::",
    "tests/pipelines/test_quarantine.py::test_skipped_records_cost_no_more_memory_than_kept_ones",
    "tests/pipelines/test_runners.py::test_every_runner_and_exchange_writes_the_same_shards",
    "tests/pipelines/test_runners.py::test_a_build_that_loses_its_worker_for_good_fails_in_one_line",
    "tests/pipelines/test_runners.py::test_span_corruption_first_fit_writes_the_same_shards_on_every_runner",
    "tests/pipelines/test_runners_g1.py::test_every_runner_writes_the_local_engines_bytes[dask x2]",
    "tests/pipelines/test_runners_g1.py::test_every_runner_writes_the_local_engines_bytes[multi_processing x2]",
    "tests/training/test_attention.py::test_prefix_lm_splash_agrees_with_the_einsum_path",
    "tests/training/test_attention.py::test_biased_flash_matches_the_masked_reference_and_gives_the_bias_its_gradient"
    "[bidirectional]",
    "tests/training/test_cli.py::test_train_eval_resume_and_refuse",
    "tests/training/test_decoding.py::test_an_8_device_mesh_decodes_and_scores_like_one_device",
    "tests/training/test_evaluation.py::test_decoder_learns_to_copy_and_seqcache_eval_scores_it",
    "tests/training/test_evaluation.py::test_translation_reports_bleu_and_chrf_with_source_lines",
    "tests/training/test_evaluation_multihost.py::test_two_processes_predict_each_example_once_like_one",
    "tests/training/test_fit.py::test_real_compiles_against_a_given_memory_size",
    "tests/training/test_multihost.py::test_two_processes_read_their_rows_and_train_like_one",
    "tests/training/test_multihost.py::test_eval_over_two_processes_reads_every_example_once",
    "tests/training/test_optimizer.py::test_adafactor_trains_on_8_devices_like_on_one",
    "tests/training/test_optimizer.py::test_adafactor_first_step_by_hand",
    "tests/training/test_sharding.py::test_t5_preset_on_8_devices_matches_one_device",
    "tests/training/test_t5_cli.py::test_t5_trains_on_translation",
    "tests/training/test_t5_cli.py::test_t5_stop_and_resume_on_a_real_cache_matches_an_uninterrupted_run",
    "tests/training/test_t5_cli.py::test_decoder_only_model_reads_an_inputs_targets_cache_as_a_prefix_lm",
    "tests/training/test_evaluation.py::test_a_failing_metric_stops_the_eval_and_writes_nothing",
    "tests/training/test_cli.py::test_stop_at_step_then_resume_matches_an_uninterrupted_run",
    "tests/training/test_compile_cache.py::test_a_resumed_run_loads_its_train_step_from_the_cache",
    "tests/training/test_fit.py::test_seqcache_train_on_a_cpu_fits_nothing_and_a_resume_keeps_the_saved_settings",
    "tests/training/test_decoding.py::test_greedy_with_the_cache_equals_the_full_forward_pass[prefix_lm]",
    "tests/training/test_decoding.py::test_greedy_with_the_cache_equals_the_full_forward_pass[lm_prompt]",
    "tests/pipelines/test_overlap.py::test_a_damaged_shard_is_one_line_under_any_number_of_workers[2]",
    "tests/pipelines/test_resume_runners.py::test_a_failed_build_resumes_and_a_grown_corpus_reads_only_its_new_file_"
    "on_every_runner[prism]",
    "tests/training/test_sharding.py::test_fsdp_tp_fit_on_8_devices_matches_one_device",
    "tests/pipelines/test_runners.py::test_every_runner_skips_the_same_duplicates",
    "tests/pipelines/test_sizes.py::test_one_very_long_line_is_truncated_exactly_in_bounded_memory[sentencepiece",
    "tests/pipelines/test_content.py::test_fresh_worker_processes_get_the_sentencepiece_model",
    "tests/test_benchmark_scripts.py::test_overlap_benchmark_builds_scans_and_measures_memory",
    "tests/test_benchmark_scripts.py::test_startup_benchmark_counts_modules_and_times_each_command",
    "tests/test_object_store.py::test_multi_processing_workers_get_the_s3_options",
    "tests/training/test_tensorboard.py::test_event_files_hold_the_metrics",
    "tests/training/test_evaluation.py::test_a_failing_metric_during_training_stops_the_run_after_its_checkpoint",
)


def pytest_collection_modifyitems(config, items):
    """Marks the tests of ``HEAVY`` ``heavy``. In a pytest-xdist worker, the
    modules of ``HEAVY_FIRST`` come first, each module's tests in their order.
    ``make test`` runs each module in one worker (``--dist loadscope``, which
    builds a module-scoped fixture once) and hands the modules out in this
    order (``--no-loadscope-reorder``), so that both workers finish at about
    the same time."""
    for item in items:
        if item.nodeid.startswith(HEAVY):
            item.add_marker(pytest.mark.heavy)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {module: i for i, module in enumerate(HEAVY_FIRST)}
        items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session", autouse=True)
def _run_outside_the_source_tree(tmp_path_factory):
    """Every test (and every process it starts: Beam workers, resume checks) runs
    from an empty folder, so that nothing of the working directory comes before
    the installed package on sys.path (the repository root has no ``seqcache/``
    folder: tests/test_cli_beam_workers.py runs from there on purpose)."""
    old = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(old)


@pytest.fixture(autouse=True)
def _signal_state_is_restored(request):
    """Each test ends with this process's SIGINT/SIGTERM handling as it began
    (dispositions and the main thread's signal mask): child processes inherit
    both, and a test that stops a build with Ctrl-C needs its child to receive
    the signal. A test that leaves them changed is named on stderr."""
    import signal

    watched = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.getsignal(s) for s in watched}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    after = {s: signal.getsignal(s) for s in watched}
    now = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    if after != before or now != mask:
        print(f"\n{request.node.nodeid} left the signal state changed (handlers {after} instead of {before}, "
              f"blocked {sorted(now)} instead of {sorted(mask)}); restored", file=sys.__stderr__)
        for s, handler in before.items():
            if handler is not None:
                signal.signal(s, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    """The real corpora in ../shared/data (never copied into the repository).

    Outside CI a checkout without the corpora skips the tests that need them; under
    CI (``CI`` set to a true value) a missing folder fails those tests instead, so
    that a run without the data can never pass while testing little."""
    if not SHARED_DATA.is_dir():
        message = f"shared corpora not found at {SHARED_DATA}"
        if _under_ci():
            pytest.fail(message + " (CI is set: the corpora are required)", pytrace=False)
        pytest.skip(message)
    return SHARED_DATA


def _under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")


class Corpora:
    """Where each corpus of ../shared/data that the tests read lies (``pathlib.Path``
    attributes), and readers of the parts that several tests take."""

    def __init__(self, root: pathlib.Path):
        self.shakespeare = root / "tinyshakespeare" / "input.txt"
        self.sentencepiece_data = root / "sentencepiece_data"
        self.botchan = self.sentencepiece_data / "botchan.txt"
        self.unicode_edge = root / "unicode_edge"
        self.blns = self.unicode_edge / "blns.txt"
        self.c4 = root / "c4" / "c4_validation_2k.parquet"
        self.multi30k = root / "multi30k"
        self.ntrex = root / "ntrex128"
        self.dolma = root / "dolma_cc"
        self.wikitext = root / "wikitext2"

    def shakespeare_lines(self, n: int | None = None) -> list[str]:
        """The lines of tinyshakespeare split on ``\\n``, ``[:n]`` of them (all when
        None; the last of all is the empty text after the final line end)."""
        return self.shakespeare.read_text(encoding="utf-8").split("\n")[:n]

    def c4_texts(self, n: int | None = None):
        """The ``text`` column of the C4 validation sample, its first ``n`` rows (all
        when None), as a pyarrow ChunkedArray of strings."""
        import pyarrow.parquet as pq

        return pq.read_table(self.c4, columns=["text"]).column("text")[:n]


@pytest.fixture(scope="session")
def corpora(shared_data) -> Corpora:
    """``Corpora`` of ../shared/data; skips or fails like ``shared_data`` when absent."""
    return Corpora(shared_data)


@pytest.fixture(scope="session")
def shakespeare_lm_cache(corpora):
    """``build(tmp_path_factory, num_lines=..., sequence_length=..., num_shards=2)``:
    builds the first ``num_lines`` lines of tinyshakespeare (one file,
    ``play.txt``) as the packed task ``shakespeare_lm`` (byte vocabulary) and
    returns the caches root (a ``pathlib.Path``; the cache is
    ``root/shakespeare_lm/train``). For module-scoped cache fixtures."""

    def build(tmp_path_factory, *, num_lines: int, sequence_length: int, num_shards: int = 2):
        from seqcache import pipelines
        from testsupport import shakespeare_lm_task, write_lines

        src = tmp_path_factory.mktemp("corpus")
        write_lines(src / "play.txt", corpora.shakespeare_lines(num_lines))
        root = tmp_path_factory.mktemp("caches")
        pipelines.build_task(shakespeare_lm_task(str(src / "*.txt")), cache_dir=str(root),
                             config=pipelines.BuildConfig(num_shards=num_shards,
                                                          sequence_length={"targets": sequence_length}))
        return root

    return build
