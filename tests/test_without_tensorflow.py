"""Without TensorFlow (the ``tfds`` extra): the pipeline, the feeder and the CLI
import and run, a TFDS source says how to install what it needs, and the tests
of the TF sources skip, except under CI, where they fail.

A fresh process (and every process it starts: Beam's workers) cannot import
``tensorflow`` or ``tensorflow_datasets``: a ``sitecustomize`` on its
``PYTHONPATH`` puts a meta-path finder first that raises ``ImportError`` for
them, as if the extra were not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

BLOCKER = '''
import sys

BLOCKED = ("tensorflow", "tensorflow_datasets")


class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, _Blocked())
'''

SCRIPT = r'''
import json, os, sys

import click

out = {}
from seqcache.cli.main import main
from seqcache.feeders import Feeder
from seqcache.tasks import ByteVocabulary, parse_source_spec
from seqcache.tasks.sources import TfdsSource

root, corpus = sys.argv[1], sys.argv[2]


def build(spec, name, *extra):
    try:
        main(["build", "--source", spec, "--name", name, "--num-shards", "2", "--cache-dir", root, *extra],
             standalone_mode=False)
    except SystemExit as e:
        return e.code
    except click.ClickException as e:  # what standalone mode prints and exits with
        e.show()
        return e.exit_code
    return 0


out["text_build"] = build(f"text:{corpus}", "shk", "--on-error", "empty=skip")
feeder = Feeder(cache=os.path.join(root, "shk", "train"), global_batch_size=4, sequence_length=64, num_epochs=1)
batch = feeder.get_batch(0)
out["batch_shape"] = list(batch["targets"].shape)
out["first_row"] = ByteVocabulary().decode(batch["targets"][0].tolist())

try:
    import google_crc32c  # noqa: F401  (the TFRecord reader's one need)
    from seqcache.tasks.sources.tfrecord import encode_example, write_tfrecords

    lines = [l for l in open(corpus, encoding="utf-8").read().split("\n") if l][:50]
    write_tfrecords(os.path.join(root, "in.tfrecord"), [encode_example({"text": l}) for l in lines])
    out["tfrecord_build"] = build(f"tfrecord:{root}/in.tfrecord#text", "tfr")
except ImportError as e:
    out["tfrecord_error"] = str(e)

try:
    parse_source_spec("tfds:tiny:1.0.0#text")
except ImportError as e:
    out["spec_error"] = str(e)
try:
    TfdsSource("tiny:1.0.0", data_dir=root).list_files()
except ImportError as e:
    out["source_error"] = str(e)
out["tfds_build"] = build("tfds:tiny:1.0.0#text", "t", "--tfds-data-dir", root)
out["loaded"] = sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "tensorflow_datasets"))
print("RESULT " + json.dumps(out))
'''


def test_build_and_feed_without_tensorflow(tmp_path, corpora):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCKER)
    (tmp_path / "run.py").write_text(textwrap.dedent(SCRIPT))
    lines = corpora.shakespeare_lines(400)
    corpus = tmp_path / "a.txt"
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    proc = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tmp_path / "caches"), str(corpus)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and result, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(result[-1][len("RESULT "):])
    assert out["loaded"] == []  # nothing imported TensorFlow or TFDS
    assert out["text_build"] == 0 and out["batch_shape"] == [4, 64]
    assert out["first_row"] and any(out["first_row"][:20] in line for line in lines)
    if "tfrecord_error" in out:  # no google-crc32c either: the extra is not installed at all
        assert "pip install 'seqcache[tfds]'" in out["tfrecord_error"]
    else:
        assert out["tfrecord_build"] == 0
    for key in ("spec_error", "source_error"):
        assert "pip install 'seqcache[tfds]'" in out[key] and "tfds" in out[key]
    assert out["tfds_build"] == 2  # a usage error, with the pip command (checked above)
    assert "pip install 'seqcache[tfds]'" in proc.stderr


def test_tf_source_tests_skip_without_tensorflow_but_fail_under_ci(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCKER)
    tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks", "test_tf_sources.py")
    counts = {}
    for ci in ("", "true"):
        env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"), CI=ci)
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", tests,
                               "-k", "framing or tfds_errors"], env=env, capture_output=True, text=True, timeout=600,
                              cwd=tmp_path)
        counts[ci] = (proc.returncode, proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr)
    assert counts[""][0] == 0 and "2 skipped" in counts[""][1], counts
    # Under CI the fixtures that need the extra fail: the tests error instead of skipping.
    assert counts["true"][0] == 1 and "2 errors" in counts["true"][1], counts
