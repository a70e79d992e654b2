"""``seqcache report`` on a real cache (the C4 sample, byte vocabulary): its
numbers against ``info --json`` and the build's own counts, older manifests,
mixtures, and the page as a person sees it, in headless Chromium."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from seqcache.cli.main import main

SEQUENCE_LENGTH = 512


def _invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def c4_cache(tmp_path_factory, corpora) -> str:
    """The C4 sample (2,000 documents) packed to 512 bytes, 4 shards; its
    control characters repaired (so the quarantine file has entries)."""
    root = tmp_path_factory.mktemp("report-c4")
    _invoke("build", "--source", f"parquet:{corpora.c4}#text",
            "--vocabulary", "byte", "--name", "c4", "--sequence-length", SEQUENCE_LENGTH, "--pack",
            "--num-shards", 4, "--on-error", "replace", "--cache-dir", root, "--json")
    return str(root / "c4" / "train")


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d[part]
    return d


def test_report_json_matches_info_and_the_corpus(c4_cache, corpora):
    info = json.loads(_invoke("info", c4_cache, "--json").stdout)
    rep = json.loads(_invoke("report", c4_cache, "--json").stdout)
    assert rep["mixture"] is None and len(rep["caches"]) == 1
    c = rep["caches"][0]
    s = c["summary"]
    for key in ("task", "split", "fingerprint", "num_examples", "num_shards", "num_bytes", "num_sources", "packing",
                "sequence_length", "seed"):
        assert s[key] == info[key], key
    for key, value in s["statistics"].items():
        assert value == info["statistics"][key], key

    # The length histogram counts every source example once, by its true length.
    docs = corpora.c4_texts().to_pylist()
    lengths = c["lengths"]["targets"]
    assert lengths["recorded"] and lengths["count"] == info["statistics"]["source_examples"] == len(docs)
    from seqcache.pipelines.stats import bucket_hi, bucket_lo

    # Byte vocabulary: one token a UTF-8 byte, plus EOS; the repaired records keep their length in characters,
    # each control character becoming U+FFFD (3 bytes), so their buckets are taken from the cache's own counts.
    want = {}
    for n in (len(d.encode("utf-8")) + 1 for d in docs):
        lo = int(bucket_lo(np.array([n]))[0])
        want[lo] = want.get(lo, 0) + 1
    got = {lo: count for lo, hi, count in lengths["histogram"]}
    assert all(hi == bucket_hi(lo) for lo, hi, _ in lengths["histogram"])
    assert sum(got.values()) == sum(want.values())
    assert sum(abs(got.get(k, 0) - want.get(k, 0)) for k in set(got) | set(want)) <= 2 * s["statistics"][
        "replaced_records"]
    assert lengths["longer_than_sequence_length_at_least"] == sum(
        1 for d in docs if bucket_lo(np.array([len(d.encode()) + 1]))[0] > SEQUENCE_LENGTH)

    packing = c["packing"]["targets"]
    tokens = info["statistics"]["tokens"]["targets"]
    assert packing["efficiency"] == tokens / (info["num_examples"] * SEQUENCE_LENGTH)
    assert packing["padding_tokens"] == info["num_examples"] * SEQUENCE_LENGTH - tokens

    sources = c["sources"]
    assert sources["recorded"] and sources["num_files"] == 1 and sources["other"] is None
    assert sources["top"][0]["examples"] == len(docs) and sources["top"][0]["tokens"]["targets"] == tokens

    q = c["quarantine"]
    lines = [json.loads(x) for x in open(os.path.join(c4_cache, "quarantine.jsonl"), encoding="utf-8")]
    assert q["replaced_records"] == len(lines) == sum(k["records"] for k in q["kinds"]) > 0
    first = q["kinds"][0]["first"][0]
    assert first["record_number"] == lines[0]["record_number"]
    assert first["location"] == f"row {lines[0]['record_number']:,}"

    sh = c["shards"]
    assert sh["records"] == [x["num_records"] for x in info["shards"]]
    assert sh["num_bytes"] == [x["num_bytes"] for x in info["shards"]]
    assert sh["records_skew"]["max_over_mean"] == max(sh["records"]) / (sum(sh["records"]) / 4)


def test_report_without_overlap_does_not_import_beam(c4_cache, tmp_path):
    probe = ("import sys\nfrom click.testing import CliRunner\nfrom seqcache.cli.main import main\n"
             "out = CliRunner().invoke(main, ['report', sys.argv[1], '--output', sys.argv[2]])\n"
             "assert out.exit_code == 0, out.output\n"
             "print('apache_beam' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe, c4_cache, str(tmp_path / "r.html")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_steps_past_any_run_are_refused_as_which_refuses_them(c4_cache):
    for option in ("--steps", "--at-step"):
        out = CliRunner().invoke(main, ["report", c4_cache, "--batch-size", "8", option, str(10**20), "--json"])
        assert out.exit_code == 2 and "global position 2^62 or beyond, past any run" in out.output, out.output
        assert option in out.output


def test_report_of_a_cache_built_before_the_new_statistics(c4_cache, tmp_path):
    """A manifest without length histograms or per-file counts still reports
    everything else, and says what is missing."""
    from testsupport import rewrite_as_format_2

    old = tmp_path / "old"
    shutil.copytree(c4_cache, old)
    raw = rewrite_as_format_2(old)  # per-file counts were in the manifest then
    del raw["statistics"]["length_histogram"], raw["statistics"]["source_files"]
    (old / "manifest.json").write_text(json.dumps(raw))
    rep = json.loads(_invoke("report", old, "--json").stdout)["caches"][0]
    assert rep["lengths"]["targets"]["recorded"] is False and "rebuild" in rep["lengths"]["targets"]["reason"]
    assert rep["sources"]["recorded"] is False and rep["sources"]["ranked_by"] == "bytes"
    assert rep["packing"]["targets"]["efficiency"] > 0.99
    out = tmp_path / "old.html"
    _invoke("report", old, "--output", out)
    page = out.read_text()
    assert "not recorded by the build" in page and page.count("<img ") == 4  # packing, files, quarantine, shards


def test_report_of_a_manifest_whose_source_table_does_not_fit_its_sources(c4_cache, tmp_path):
    from testsupport import rewrite_as_format_2

    bad = tmp_path / "bad"
    shutil.copytree(c4_cache, bad)
    raw = rewrite_as_format_2(bad)
    raw["statistics"]["source_files"]["examples"].append(7)
    (bad / "manifest.json").write_text(json.dumps(raw))
    result = CliRunner().invoke(main, ["report", str(bad), "--json"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "statistics.source_files.examples has 2 entries for 1 source files" in result.output


def test_report_of_a_mixture(c4_cache, tmp_path):
    """Shares and epochs follow the feeder's own assignment of positions."""
    from seqcache.feeders import mixing
    from seqcache.feeders.stream import open_mixture

    root = tmp_path / "mix"
    root.mkdir()
    os.symlink(c4_cache, root / "a")
    other = tmp_path / "b"
    shutil.copytree(c4_cache, other)
    os.symlink(other, root / "b")
    B, steps = 8, 300
    rep = json.loads(_invoke("report", root, "--mixture-rate", "a=3", "--mixture-rate", "b=1", "--batch-size", B,
                             "--steps", steps, "--at-step", 2000, "--json").stdout)
    mx = rep["mixture"]
    assert len(rep["caches"]) == 2 and mx["global_batch_size"] == B and mx["at_step"] == 2000
    opened = open_mixture(mixture=[(str(root / "a"), 3.0), (str(root / "b"), 1.0)])
    try:
        weights, n = opened.weights, [r.num_examples for r in opened.readers]
    finally:
        opened.close()
    tasks, _ = mixing.Mixer(weights).locate_many(np.arange(steps * B, dtype=np.int64))
    at = mixing.Mixer(weights).locate_many(np.arange(2000 * B, dtype=np.int64))[0]
    for t, entry in enumerate(mx["tasks"]):
        assert entry["target_share"] == pytest.approx([0.75, 0.25][t])
        assert entry["share_at_steps"][-1] == np.count_nonzero(tasks == t) / (steps * B)
        assert entry["max_share_error"] < 1 / B  # at most one row off over any prefix (two tasks)
        given = int(np.count_nonzero(at == t))
        assert entry["positions_at_step"] == given and entry["epoch_at_step"] == given // n[t]
        assert entry["epochs_at_step"] == given / n[t]
    out = tmp_path / "mix.html"
    _invoke("report", root, "--mixture-rate", "a=3", "--mixture-rate", "b=1", "--batch-size", B, "-o", out)
    assert out.read_text().count("<img ") == 2 + 2 * 5


def test_the_page_escapes_what_files_and_users_wrote(c4_cache):
    """A path, an error and a warning with markup in them are text on the page
    (the templates autoescape), and a data-value attribute holds any JSON."""
    from seqcache.cli import report_html

    rep = json.loads(_invoke("report", c4_cache, "--json").stdout)
    c = rep["caches"][0]
    mark = "<script>alert('x')</script> & \"q\""
    c["cache_dir"] += mark
    c["problem"] = "odd manifest " + mark
    c["quarantine"]["kinds"][0]["first"][0]["error"] += mark
    c["sources"]["top"][0]["path"] += mark
    c["summary"]["seed"] = mark  # a string where a number belongs: its JSON, quoted, in an attribute
    page = report_html.render(rep, title=mark)
    assert "<script>" not in page and "&lt;script&gt;" in page
    escaped = page.count("&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &#34;q&#34;")
    assert escaped == 2 + 5, escaped  # the title twice; the folder, warning, error, file and seed
    assert 'data-key="seed" data-value="&#34;&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; ' \
           '\\&#34;q\\&#34;&#34;"' in page
    assert page.count("<img ") == 5 and page.count("data:image/png;base64,") == 5


# --- in a browser ---------------------------------------------------------------


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


# Runs in the page: every plot's image decoded, its size and how many colours a
# grid of its pixels holds; and every tagged summary number with its text.
_INSPECT = """(() => {
  const plots = [...document.querySelectorAll('figure.plot img')].map(img => {
    const out = {alt: img.alt, complete: img.complete, width: img.naturalWidth, height: img.naturalHeight,
                 src: img.src.slice(0, 22)};
    const c = document.createElement('canvas');
    c.width = img.naturalWidth; c.height = img.naturalHeight;
    const g = c.getContext('2d'); g.drawImage(img, 0, 0);
    const data = g.getImageData(0, 0, c.width, c.height).data;
    const colours = new Set();
    for (let y = 0; y < c.height; y += 4) for (let x = 0; x < c.width; x += 4) {
      const i = 4 * (y * c.width + x); colours.add(data[i] << 16 | data[i + 1] << 8 | data[i + 2]);
    }
    out.colours = colours.size;
    return out;
  });
  const cells = [...document.querySelectorAll('[data-key]')].map(td =>
    ({key: td.dataset.key, value: JSON.parse(td.dataset.value), text: td.textContent}));
  return {plots, cells, title: document.title, height: document.documentElement.scrollHeight,
          scripts: document.scripts.length, links: document.querySelectorAll('link').length};
})()"""


class DevTools:
    """A small client of Chromium's DevTools protocol over its websocket: one
    page target, commands answered in order, events kept."""

    def __init__(self, url: str):
        import websocket

        self.ws = websocket.create_connection(url, timeout=60, suppress_origin=True)
        self.next_id = 0
        self.events: list[dict] = []
        self.session = None

    def send(self, method: str, **params):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params}
        if self.session:
            msg["sessionId"] = self.session
        self.ws.send(json.dumps(msg))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str) -> dict:
        for e in self.events:
            if e.get("method") == method:
                return e
        while True:
            e = json.loads(self.ws.recv())
            self.events.append(e)
            if e.get("method") == method:
                return e


def _start_chromium(binary: str, profile: pathlib.Path):
    import subprocess

    proc = subprocess.Popen(
        [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--remote-debugging-address=127.0.0.1",
         "--remote-debugging-port=0", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:  # Chromium prints where its DevTools listen, then keeps logging
        lines.append(line)
        if "DevTools listening on " in line:
            return proc, line.split("DevTools listening on ", 1)[1].strip()
    proc.wait()
    raise RuntimeError(f"{binary} exited ({proc.returncode}) before opening its DevTools port:\n" + "".join(lines))


def test_report_in_headless_chromium(c4_cache, tmp_path):
    """The page loads offline with no console error, no request beyond the file
    itself, every plot a decoded, non-blank image, and the summary numbers those
    of `info --json`. Outside CI, the screenshot is kept in bench-out/report/."""
    binary = _chromium()
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail("Chromium is not installed; .ci/run installs it (apt-get install -y chromium)")
        pytest.skip("Chromium is not installed (apt-get install -y chromium); CI installs it and runs this test")
    page_path = tmp_path / "report.html"
    _invoke("report", c4_cache, "--output", page_path)
    info = json.loads(_invoke("info", c4_cache, "--json").stdout)

    proc, url = _start_chromium(binary, tmp_path / "profile")
    try:
        dt = DevTools(url)
        target = dt.send("Target.createTarget", url="about:blank")["targetId"]
        dt.session = dt.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            dt.send(f"{domain}.enable")
        dt.send("Emulation.setDeviceMetricsOverride", width=1280, height=1000, deviceScaleFactor=1, mobile=False)
        dt.send("Page.navigate", url=page_path.as_uri())
        dt.wait_for("Page.loadEventFired")
        got = dt.send("Runtime.evaluate", expression=_INSPECT, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in got, got["exceptionDetails"]
        page = got["result"]["value"]
        dt.send("Emulation.setDeviceMetricsOverride", width=1280, height=page["height"], deviceScaleFactor=1,
                mobile=False)
        shot = dt.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        events = list(dt.events)
        dt.ws.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    errors = [e for e in events if e.get("method") == "Runtime.exceptionThrown"
              or (e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "assert"))
              or (e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")
              or e.get("method") == "Network.loadingFailed"]
    assert not errors, errors
    requests = [e["params"]["request"]["url"] for e in events if e.get("method") == "Network.requestWillBeSent"]
    assert requests and all(u == page_path.as_uri() or u.startswith("data:") for u in requests), requests
    assert page["scripts"] == 0 and page["links"] == 0

    # lengths, packing, source files, quarantine, shards
    assert len(page["plots"]) == 5, page["plots"]
    for plot in page["plots"]:
        assert plot["complete"] and plot["width"] > 300 and plot["height"] > 50, plot
        assert plot["src"] == "data:image/png;base64," and plot["colours"] >= 3, plot

    cells = {c["key"]: c for c in page["cells"]}
    for key in ("num_examples", "num_shards", "num_bytes", "num_sources", "seed", "statistics.tokens.targets",
                "statistics.source_records", "statistics.source_examples", "statistics.segments",
                "statistics.skipped_records", "statistics.replaced_records", "statistics.truncated_tokens",
                "statistics.max_length.targets", "statistics.mean_length.targets"):
        assert cells[key]["value"] == _get(info, key), key
    for key, cell in cells.items():
        assert cell["value"] == _get(info, key), key
        if isinstance(cell["value"], int):  # what the reader sees: the same number, with thousands separators
            assert int(cell["text"].replace(",", "")) == cell["value"], cell

    import base64

    png = base64.b64decode(shot)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    if os.environ.get("CI") != "true":
        out = pathlib.Path(__file__).resolve().parents[1] / "bench-out" / "report"
        out.mkdir(parents=True, exist_ok=True)
        (out / "report-c4.png").write_bytes(png)
        shutil.copyfile(page_path, out / "report-c4.html")
