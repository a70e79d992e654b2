"""A manifest and a build's result print as one short line (task, split,
fingerprint, features, shard count), not as the whole manifest JSON."""

from seqcache import format as fmt
from seqcache.pipelines import BuildResult


def test_manifest_and_build_result_print_short(tmp_path, fx):
    fx.write_fixture_cache(tmp_path / "a", n=30, task="a")
    m = fmt.read_manifest(str(tmp_path / "a"))
    assert len(m.shards) >= 1 and m.source_table is not None
    text = repr(BuildResult(cache_dir=str(tmp_path / "a"), manifest=m, reused=False, seconds=1.5))
    assert f"ShardTable({len(m.shards)} shards, 30 records)" in text
    assert m.fingerprint in text and "task='a'" in text
    assert "'sources'" not in text and "source_table" not in text and "format_version" not in text
    assert len(text) < 600
