"""seqcache overlap on every runner of the build: Beam's local engine, its
multi_processing mode with 2 worker processes, and Beam's DaskRunner against a
``dask.distributed`` cluster of 2 worker processes on 127.0.0.1: the same
result, byte for byte, however many workers and units."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from seqcache import tasks
from seqcache.cli.main import main
from seqcache.pipelines import BuildConfig, build_task
from testsupport import MULTI_PROCESSING, byte_task, dask_args

pytest.importorskip("distributed")

@pytest.fixture(scope="module")
def cache(tmp_path_factory, corpora):
    """120 C4 documents in 3 shards, 4 of them holding an NTREX line."""
    folder = tmp_path_factory.mktemp("runners")
    lines = (corpora.ntrex / "newstest2019-src.eng.txt").read_text(encoding="utf-8").splitlines()
    docs = corpora.c4_texts(120).to_pylist()
    for row, line in ((2, 10), (30, 11), (31, 10), (99, 12)):
        docs[row] += " " + lines[line]
    pq.write_table(pa.table({"text": docs}), folder / "c4.parquet")
    task = byte_task("c4_runners", tasks.ParquetSource(str(folder / "c4.parquet"), column="text"))
    return build_task(task, cache_dir=str(folder / "caches"), config=BuildConfig(num_shards=3)).cache_dir


def test_every_runner_writes_the_same_result(tmp_path, corpora, cache, dask_cluster):
    spec = f"text:{corpora.ntrex / 'newstest2019-src.eng.txt'}"
    runs = {"local": [], "multi_processing x2": MULTI_PROCESSING, "dask x2": dask_args(dask_cluster)}
    outputs = {}
    for name, args in runs.items():
        out = tmp_path / f"{name.split()[0]}.json"
        res = CliRunner().invoke(main, ["overlap", spec, cache, "-o", str(out), "--batch-size", "8", "--seed", "3",
                                        "--before-step", "6", *args])
        assert res.exit_code == 0, (name, res.output)
        outputs[name] = out.read_bytes()
    assert len(set(outputs.values())) == 1
    import json

    result = json.loads(outputs["local"])
    assert {(it["item"], m["record_number"]) for it in result["items"] for m in it["matches"]} == {
        (10, 2), (11, 30), (10, 31), (12, 99)}
