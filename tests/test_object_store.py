"""Object stores work like local paths: build into s3:// with the CLI, then
info, verify and show read the cache there, with the same numbers, bytes and
examples as a local build of the same input; the feeder refuses a URL with one
clear error; a missing bucket or an endpoint that does not answer is one error
line, not a traceback.

The S3 server is moto's (``moto.server.ThreadedMotoServer``) on 127.0.0.1, on a
free port, for this module only. Object-store options reach the commands as
Beam pipeline options (``--s3_endpoint_url=...``), or as boto3's environment
variables.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile

import pytest
from click.testing import CliRunner

pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")

from seqcache import format as fmt  # noqa: E402
from seqcache.cli.main import main  # noqa: E402
from testsupport import S3_BUCKET, S3_KEY_ID, S3_REGION, S3_SECRET, moto_s3, one_botocore_loader  # noqa: E402

BUCKET, KEY_ID, SECRET, REGION = S3_BUCKET, S3_KEY_ID, S3_SECRET, S3_REGION
NUM_LINES = 300


@pytest.fixture(scope="module")
def s3():
    """An S3 server on 127.0.0.1 with one bucket (``testsupport.moto_s3``)."""
    with moto_s3() as server:
        yield server


@pytest.fixture(scope="module", autouse=True)
def _one_botocore_loader():
    with one_botocore_loader():
        yield


@pytest.fixture(autouse=True)
def _bounded_boto3_retries(monkeypatch):
    """boto3's own retries, bounded (Beam's S3 client is created without a retry config)."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def _build_args(corpus, cache_dir):
    return ["build", "--source", f"text:{corpus}", "--on-error", "empty=skip", "--vocabulary", "byte", "--name", "t",
            "--num-shards", "2", "--cache-dir", cache_dir, "--json"]


@pytest.fixture(scope="module")
def caches(s3, corpora, tmp_path_factory):
    """The same input built twice, into a local folder and into s3://: yields
    {"local": cache folder, "url": s3:// cache URL}."""
    root = tmp_path_factory.mktemp("object-store")
    corpus = root / "in.txt"
    lines = corpora.shakespeare_lines(NUM_LINES)
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    runner = CliRunner()
    local = runner.invoke(main, _build_args(corpus, str(root / "caches")), catch_exceptions=False)
    assert local.exit_code == 0, local.output
    remote = runner.invoke(main, _build_args(corpus, f"s3://{BUCKET}/caches") + s3["options"],
                           catch_exceptions=False)
    assert remote.exit_code == 0, remote.output
    (local_result,), (remote_result,) = json.loads(local.stdout), json.loads(remote.stdout)
    assert remote_result["cache_dir"] == f"s3://{BUCKET}/caches/t/train"
    assert remote_result["reused"] is False and remote_result["skipped_records"] == lines.count("") > 0
    return {"local": local_result["cache_dir"], "url": remote_result["cache_dir"]}


def _one_error_line(result) -> str:
    """The output of a failed command: exit status 1, no traceback, one line
    that starts with 'error:'; returns that line."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    return lines[0]


def test_info_gives_the_numbers_of_the_local_build(s3, caches):
    runner = CliRunner()
    local = json.loads(runner.invoke(main, ["info", caches["local"], "--json"], catch_exceptions=False).stdout)
    out = runner.invoke(main, ["info", caches["url"], "--json"] + s3["options"], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    remote = json.loads(out.stdout)
    assert remote["cache_dir"] == caches["url"] and remote["problem"] is None
    for d in (local, remote):
        d.pop("cache_dir")
        d.pop("created")
    assert remote == local
    assert remote["num_examples"] == NUM_LINES - remote["statistics"]["skipped_records"]
    # The table form reads the same cache.
    table = runner.invoke(main, ["info", caches["url"], "--shards"] + s3["options"])
    assert table.exit_code == 0 and "data.array_record-00001-of-00002" in table.output


def _shard_entries(manifest: dict, checksums: bytes) -> list[dict]:
    """Per shard of a version-2 manifest: file names, record count and checksums
    (from the content of its shard checksum file)."""
    table, sums = manifest["shards"], json.loads(checksums)
    n = table["num_shards"]
    records = fmt.decode_int_column(table["num_records"]).tolist()
    return [{"file": fmt.shard_name(fmt.DATA_PREFIX, i, n), "provenance_file": fmt.shard_name(fmt.PROVENANCE_PREFIX, i, n),
             "num_records": records[i], "sha256": sums["sha256"][i], "provenance_sha256": sums["provenance_sha256"][i]}
            for i in range(n)]


def _local_entries(cache_dir: str) -> list[dict]:
    with open(os.path.join(cache_dir, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    with open(os.path.join(cache_dir, fmt.SHARD_CHECKSUMS_NAME), "rb") as f:
        return _shard_entries(manifest, f.read())


def _bucket_entries(client, prefix: str) -> list[dict]:
    manifest = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/manifest.json")["Body"].read())
    return _shard_entries(manifest, client.get_object(Bucket=BUCKET, Key=f"{prefix}/{fmt.SHARD_CHECKSUMS_NAME}")[
        "Body"].read())


def test_data_shards_are_byte_identical_to_the_local_build(s3, caches):
    manifest = json.loads(s3["client"].get_object(Bucket=BUCKET, Key="caches/t/train/manifest.json")["Body"].read())
    with open(os.path.join(caches["local"], "manifest.json"), encoding="utf-8") as f:
        local_manifest = json.load(f)
    assert manifest["fingerprint"] == local_manifest["fingerprint"]
    assert manifest["shards"] == local_manifest["shards"]  # counts, sizes and the checksum file's sha256
    entries = _bucket_entries(s3["client"], "caches/t/train")
    assert len(entries) == 2
    for shard, local_shard in zip(entries, _local_entries(caches["local"])):
        for name_key, sha_key in (("file", "sha256"), ("provenance_file", "provenance_sha256")):
            assert shard[sha_key] == local_shard[sha_key]
            body = s3["client"].get_object(Bucket=BUCKET, Key=f"caches/t/train/{shard[name_key]}")["Body"].read()
            assert hashlib.sha256(body).hexdigest() == shard[sha_key]
            with open(os.path.join(caches["local"], local_shard[name_key]), "rb") as f:
                assert f.read() == body
    listed = {o["Key"] for o in s3["client"].list_objects_v2(Bucket=BUCKET, Prefix="caches/")["Contents"]}
    # Nothing but the cache is left: no temporary or statistics objects.
    names = ["manifest.json", "quarantine.jsonl", fmt.SHARD_CHECKSUMS_NAME, fmt.SOURCE_TABLE_NAME]
    assert listed == {f"caches/t/train/{n}" for n in names + [s[k] for s in entries for k in ("file", "provenance_file")]}


def _first_source(cache_dir: str) -> str:
    """The path of the first source file of the cache at ``cache_dir`` (its source table)."""
    return fmt.read_manifest(cache_dir).read_source_table()[0]["path"]


def test_sources_at_a_url_give_the_same_shards(s3, caches, tmp_path):
    corpus = _first_source(caches["local"])
    s3["client"].upload_file(corpus, BUCKET, "corpus/in.txt")
    out = CliRunner().invoke(main, _build_args(f"s3://{BUCKET}/corpus/*.txt", str(tmp_path / "c")) + s3["options"],
                             catch_exceptions=False)
    assert out.exit_code == 0, out.output
    cache_dir = json.loads(out.stdout)[0]["cache_dir"]
    assert [s["path"] for s in fmt.read_manifest(cache_dir).read_source_table()] == [f"s3://{BUCKET}/corpus/in.txt"]
    assert [(s["sha256"], s["provenance_sha256"]) for s in _local_entries(cache_dir)] == [
        (s["sha256"], s["provenance_sha256"]) for s in _local_entries(caches["local"])]


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_compressed_sources_at_a_url_give_the_same_shards(s3, caches, tmp_path, suffix):
    """A compressed file at a URL is read through Beam's decompressing file
    (readline, no iteration): the same records, so the same shards."""
    corpus = _first_source(caches["local"])
    data = open(corpus, "rb").read()
    if suffix == ".gz":
        import gzip

        packed = gzip.compress(data)
    else:
        packed = pytest.importorskip("zstandard").ZstdCompressor().compress(data)
    s3["client"].put_object(Bucket=BUCKET, Key=f"packed/in.txt{suffix}", Body=packed)
    out = CliRunner().invoke(main, _build_args(f"s3://{BUCKET}/packed/in.txt{suffix}", str(tmp_path / "c"))
                             + s3["options"], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    cache_dir = json.loads(out.stdout)[0]["cache_dir"]
    assert [(s["sha256"], s["provenance_sha256"]) for s in _local_entries(cache_dir)] == [
        (s["sha256"], s["provenance_sha256"]) for s in _local_entries(caches["local"])]


# Slow (three builds into the bucket): the default suite keeps the rule through
# tests/pipelines/test_overwrite.py::test_overwrite_on_an_object_store (an object-store
# file system whose renames are copies) and this module's builds, verify and atomic writes in S3.
@pytest.mark.slow
def test_overwrite_replaces_a_cache_in_the_bucket(s3, caches, tmp_path):
    corpus = _first_source(caches["local"])
    runner = CliRunner()
    args = _build_args(corpus, f"s3://{BUCKET}/replaced") + ["--name", "r"] + s3["options"]
    assert runner.invoke(main, args, catch_exceptions=False).exit_code == 0
    refused = runner.invoke(main, args + ["--num-shards", "3"])
    assert refused.exit_code == 1 and "--overwrite" in refused.output and "Traceback" not in refused.output
    out = runner.invoke(main, args + ["--num-shards", "3", "--overwrite"], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)[0]["num_shards"] == 3
    keys = {o["Key"] for o in s3["client"].list_objects_v2(Bucket=BUCKET, Prefix="replaced/")["Contents"]}
    assert keys == {f"replaced/r/train/{n}" for n in ["manifest.json", "quarantine.jsonl", fmt.SHARD_CHECKSUMS_NAME,
                                                              fmt.SOURCE_TABLE_NAME]
                    + [f"{p}.array_record-{i:05d}-of-00003" for p in ("data", "provenance") for i in range(3)]}
    assert runner.invoke(main, ["verify", f"s3://{BUCKET}/replaced/r/train"] + s3["options"]).exit_code == 0


def test_verify_says_ok(s3, caches):
    out = CliRunner().invoke(main, ["verify", caches["url"]] + s3["options"], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert out.output.startswith("ok:") and "4 files verified" in out.output
    report = json.loads(CliRunner().invoke(main, ["verify", caches["url"], "--json"] + s3["options"]).stdout)
    assert report["ok"] is True and [s["num_records"] for s in report["shards"]] == [
        s["num_records"] for s in _bucket_entries(s3["client"], "caches/t/train") for _ in (0, 1)
    ]


def test_show_decodes_the_example_of_the_local_build(s3, caches, tmp_path, monkeypatch):
    runner = CliRunner()
    local = json.loads(runner.invoke(main, ["show", caches["local"], "--index", "0", "--json"]).stdout)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the downloaded shards go
    out = runner.invoke(main, ["show", caches["url"], "--index", "0", "--json"] + s3["options"],
                        catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout) == local
    assert local[0]["features"]["targets"]["segments"][0]["text"]  # decoded text, not only ids
    # The last example lies in the last shard: shard 0 is downloaded for its count check, then deleted.
    n = json.loads(runner.invoke(main, ["info", caches["local"], "--json"]).stdout)["num_examples"]
    last_local = json.loads(runner.invoke(main, ["show", caches["local"], "--index", str(n - 1), "--json"]).stdout)
    last = runner.invoke(main, ["show", caches["url"], "--index", str(n - 1), "--json"] + s3["options"])
    assert last.exit_code == 0, last.output
    assert json.loads(last.stdout) == last_local
    assert os.listdir(tmp_path) == []  # every downloaded shard was removed


def test_options_from_boto3_environment_variables(s3, caches):
    from seqcache import fs

    fs.set_options(None)  # as in a fresh process: no Beam options at all
    env = {"AWS_ENDPOINT_URL": s3["endpoint"], "AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET,
           "AWS_DEFAULT_REGION": REGION}
    out = CliRunner().invoke(main, ["info", caches["url"], "--json"], env=env, catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["fingerprint"] == json.loads(
        CliRunner().invoke(main, ["info", caches["local"], "--json"]).stdout)["fingerprint"]
    assert CliRunner().invoke(main, ["verify", caches["url"]], env=env).exit_code == 0


def test_no_credentials_is_one_clear_line(s3, caches):
    from seqcache import fs

    fs.set_options(None)
    env = {"AWS_ENDPOINT_URL": s3["endpoint"], "AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None,
           "AWS_SESSION_TOKEN": None, "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONTAINER_CREDENTIALS_FULL_URI": None,
           "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI": None, "AWS_WEB_IDENTITY_TOKEN_FILE": None}
    line = _one_error_line(CliRunner().invoke(main, ["info", caches["url"]], env=env))
    assert line.startswith(f"error: {caches['url']}") and ": no S3 credentials: pass --s3_access_key_id=" in line


def test_feeder_refuses_a_url_with_one_clear_error_and_without_beam(caches):
    code = (
        "import sys\n"
        "from seqcache.feeders import CacheReader, Feeder\n"
        "for make in (lambda: Feeder(cache=sys.argv[1], global_batch_size=2, sequence_length=8, host_index=0,\n"
        "                            host_count=1), lambda: CacheReader(sys.argv[1])):\n"
        "    try:\n"
        "        make()\n"
        "    except ValueError as e:\n"
        "        print(e)\n"
        "    else:\n"
        "        raise SystemExit('no error')\n"
        "assert 'apache_beam' not in sys.modules, 'the feeder imported Beam'\n"
    )
    out = subprocess.run([sys.executable, "-c", code, caches["url"]], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    messages = out.stdout.strip().splitlines()
    assert len(messages) == 2 and "Traceback" not in out.stderr
    for message in messages:
        assert message.startswith(f"{caches['url']}: the feeder (CacheReader) reads local or mounted paths only")
        assert "mountpoint-s3" in message and "gcsfuse" in message


def test_feeder_refuses_a_url_caches_root():
    from seqcache import tasks
    from seqcache.feeders import Feeder

    mixture = tasks.Mixture("url_root_mix", [("a", 1.0)])
    with pytest.raises(ValueError, match="reads local or mounted paths only"):
        Feeder(mixture=mixture, caches_root=f"s3://{BUCKET}/caches", global_batch_size=2, sequence_length=8,
               host_index=0, host_count=1)


def _closed_port() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1 that does not listen: a
    connection to it is refused at once. The caller closes it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def test_a_missing_bucket_is_one_clear_line(s3, caches):
    runner = CliRunner()
    url = "s3://no-such-bucket/caches/t/train"
    for command in (["info", url], ["verify", url], ["show", url, "--index", "0"]):
        line = _one_error_line(runner.invoke(main, command + s3["options"]))
        assert line.startswith(f"error: s3://no-such-bucket: no such bucket at {s3['endpoint']} (asked for {url}"), command


def test_a_missing_cache_in_a_bucket_is_one_clear_line(s3, caches):
    line = _one_error_line(CliRunner().invoke(main, ["info", f"s3://{BUCKET}/nothing/here"] + s3["options"]))
    assert line == f"error: s3://{BUCKET}/nothing/here: no such cache folder"


def test_an_endpoint_that_does_not_answer_is_one_clear_line(s3, caches, tmp_path):
    sock = _closed_port()
    try:
        endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
        wrong = [f"--s3_endpoint_url={endpoint}"] + s3["options"][1:]
        runner = CliRunner()
        for command in (["info", caches["url"]], ["verify", caches["url"]], ["show", caches["url"]]):
            line = _one_error_line(runner.invoke(main, command + wrong))
            assert line.startswith(f"error: cannot reach the S3 endpoint {endpoint} (asked for {caches['url']}"), command
            assert line.endswith("check --s3_endpoint_url (or AWS_ENDPOINT_URL)"), command
        corpus = tmp_path / "in.txt"
        corpus.write_text("one line\n", encoding="utf-8")
        built = runner.invoke(main, _build_args(corpus, f"s3://{BUCKET}/other") + wrong)
        assert built.exit_code == 1 and "Traceback" not in built.output
        assert f"cannot reach the S3 endpoint {endpoint}" in built.output
    finally:
        sock.close()


def test_a_build_into_a_missing_bucket_is_one_clear_line(s3, tmp_path):
    corpus = tmp_path / "in.txt"
    corpus.write_text("one line\nanother line\n", encoding="utf-8")
    out = CliRunner().invoke(main, _build_args(corpus, "s3://no-such-bucket/caches") + s3["options"])
    assert out.exit_code == 1 and "Traceback" not in out.output
    assert f"error: s3://no-such-bucket: no such bucket at {s3['endpoint']}" in out.output


def test_beam_options_of_the_reading_commands_are_checked(s3, caches):
    runner = CliRunner()
    typo = runner.invoke(main, ["info", caches["url"], f"--s3_endpoint_ur={s3['endpoint']}"])
    assert typo.exit_code == 2 and "no such option: --s3_endpoint_ur=" in typo.output
    spaced = runner.invoke(main, ["verify", "--s3_endpoint_url", s3["endpoint"], caches["url"]])
    assert spaced.exit_code == 2 and "--flag=value" in spaced.output


def _without_aws_credentials(monkeypatch):
    """No AWS credentials anywhere boto3 looks (in this process and the worker
    processes it starts): a client without options has none."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
                 "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                 "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_build_task_hands_its_pipeline_args_to_filesystems(s3, caches, monkeypatch):
    from seqcache import fs
    from seqcache.cli.commands.adhoc import adhoc_task
    from seqcache.pipelines import BuildConfig, build_task

    _without_aws_credentials(monkeypatch)
    fs.set_options(None)  # a fresh process: only build_task's own arguments
    corpus = _first_source(caches["local"])
    task = adhoc_task(name="api", source_spec=f"text:{corpus}", on_error={"empty": "skip"}, vocabulary_spec="byte",
                      extra_ids=0, sequence_length=None, pack=False)
    result = build_task(task, cache_dir=f"s3://{BUCKET}/api", config=BuildConfig(num_shards=2),
                        pipeline_args=s3["options"])
    assert result.manifest.num_examples > 0


def test_multi_processing_workers_get_the_s3_options(s3, caches, monkeypatch, tmp_path):
    """Worker processes have no AWS credentials but the build's S3 options: with
    them they write the shards into the bucket, and read the vocabulary model,
    which the build's steps carry as the URL of the copy it stores in the cache
    (here s3://): the same shards as a local build."""
    from seqcache import tasks

    _without_aws_credentials(monkeypatch)
    corpus = _first_source(caches["local"])
    with open(corpus, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    model = tmp_path / "spm.model"
    tasks.train_sentencepiece(lines, output_path=str(model), vocab_size=500)
    common = ["build", "--source", f"text:{corpus}", "--on-error", "empty=skip", "--vocabulary", str(model),
              "--name", "sp", "--num-shards", "2", "--json"]
    local = CliRunner().invoke(main, common + ["--cache-dir", str(tmp_path / "local")], catch_exceptions=False)
    assert local.exit_code == 0, local.output
    remote = CliRunner().invoke(main, common + ["--cache-dir", f"s3://{BUCKET}/sp"] + s3["options"] + [
        "--direct_num_workers=2", "--direct_running_mode=multi_processing"], catch_exceptions=False)
    assert "Traceback" not in remote.output
    assert remote.exit_code == 0, remote.output
    with open(tmp_path / "local" / "sp" / "train" / "manifest.json", encoding="utf-8") as f:
        local_manifest = json.load(f)
    manifest = json.loads(s3["client"].get_object(Bucket=BUCKET, Key="sp/sp/train/manifest.json")["Body"].read())
    assert manifest["shards"] == local_manifest["shards"] and manifest["num_examples"] > 0


def test_atomic_writes_to_a_bucket(s3, tmp_path):
    """seqcache.fs's atomic writes on an object store: a finished write is the
    whole object, a failed one leaves no object; ``atomic_path`` uploads the
    local file a writer made and leaves no local temporary file."""
    from seqcache import fs

    fs.set_options(s3["options"])
    base = f"s3://{BUCKET}/atomic"
    fs.write_bytes_atomic(f"{base}/a.json", b'{"a": 1}\n')
    with pytest.raises(RuntimeError, match="interrupted"):
        with fs.open_write_atomic(f"{base}/b.json") as f:
            f.write(b"partial")
            raise RuntimeError("interrupted")
    with fs.atomic_path(f"{base}/c.bin") as tmp:
        assert os.path.dirname(tmp) == tempfile.gettempdir()
        with open(tmp, "wb") as f:
            f.write(b"written by name")
    assert not os.path.exists(tmp)
    keys = sorted(o["Key"] for o in s3["client"].list_objects_v2(Bucket=BUCKET, Prefix="atomic/")["Contents"])
    assert keys == ["atomic/a.json", "atomic/c.bin"]
    assert fs.read_bytes(f"{base}/a.json") == b'{"a": 1}\n' and fs.read_bytes(f"{base}/c.bin") == b"written by name"
