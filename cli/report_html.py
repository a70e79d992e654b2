"""``seqcache report``'s pictures: one self-contained HTML file.

Plots are drawn by matplotlib (Agg backend) and embedded as base64 PNG ``data:``
URLs; the page has no script and no external file, so it opens offline. Every
number comes from the dict ``seqcache report --json`` prints (``seqcache.cli.report``);
the summary cells carry ``data-key`` (a dotted path into ``seqcache info --json``)
and ``data-value`` (the exact value), so that a script can read them back.
"""

from __future__ import annotations

import base64
import html
import io
import json
from typing import Any, Mapping

import matplotlib

matplotlib.use("Agg", force=True)
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

# Colours of matplotlib's default cycle, named for the page's legend-free bits.
_BLUE, _ORANGE, _GREEN, _RED, _GREY = "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#7f7f7f"


def _png(fig) -> str:
    """The figure, laid out, as a ``data:image/png;base64,...`` URL; closes the figure."""
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "—" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.1f}"
    return _e(value)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.2f} %"


def _figure(src: str, alt: str, caption: str) -> str:
    return (f'<figure class="plot"><img src="{src}" alt="{_e(alt)}">'
            f"<figcaption>{caption}</figcaption></figure>")


def _cell(key: str, value: Any) -> str:
    """A summary value the page shows, tagged with its path in ``info --json``."""
    raw = json.dumps(value)
    return f'<td class="num" data-key="{_e(key)}" data-value="{_e(raw)}">{_num(value)}</td>'


# --- plots ---------------------------------------------------------------------


def plot_lengths(lengths: Mapping[str, dict]) -> str | None:
    """Histogram of example lengths per feature (one panel each), log-scaled
    lengths, the sequence length as a red line. None when nothing was recorded."""
    recorded = {n: e for n, e in lengths.items() if e.get("histogram")}
    if not recorded:
        return None
    fig, axes = plt.subplots(1, len(recorded), figsize=(8.5 if len(recorded) == 1 else 5 * len(recorded), 3.2),
                             squeeze=False)
    for ax, (name, e) in zip(axes[0], recorded.items()):
        hist = e["histogram"]
        lefts = [max(lo, 0.5) for lo, _, _ in hist]  # a log axis has no 0: length 0 is drawn at [0.5, 1)
        widths = [hi - left for left, (_, hi, _) in zip(lefts, hist)]
        ax.bar(lefts, [c for _, _, c in hist], width=widths, align="edge", color=_BLUE, edgecolor="white",
               linewidth=0.3)
        ax.set_xscale("log")
        L = e.get("sequence_length")
        if L:
            ax.axvline(L, color=_RED, linewidth=1.5, label=f"sequence length {L:,}")
            ax.legend(loc="upper left", fontsize=8)
        ax.set_xlabel(f"{name}: tokens per {e['of'].split(',')[0].rstrip('s')} (log scale)")
        ax.set_ylabel("examples")
        ax.set_title(f"{name}: {e['count']:,} {e['of']}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def plot_packing(packing: Mapping[str, dict]) -> str | None:
    """Tokens against padding per feature, as fractions of the capacity."""
    known = {n: e for n, e in packing.items() if e.get("efficiency") is not None}
    if not known:
        return None
    fig, ax = plt.subplots(figsize=(8.5, 0.6 + 0.5 * len(known)))
    names = list(known)
    eff = [known[n]["efficiency"] for n in names]
    ax.barh(names, eff, color=_GREEN, label="tokens")
    ax.barh(names, [1 - x for x in eff], left=eff, color=_GREY, alpha=0.4, label="padding")
    for y, x in enumerate(eff):
        ax.text(min(x, 0.98), y, f" {100 * x:.2f} %", va="center", ha="right" if x > 0.5 else "left", fontsize=9)
    ax.set_xlim(0, 1)
    ax.set_xlabel("fraction of examples x sequence length")
    ax.legend(loc="lower right", fontsize=8, ncol=2)
    return _png(fig)


def plot_sources(sources: Mapping[str, Any]) -> str | None:
    """Tokens (and examples) per source file: the top files and the rest."""
    rows = sources["top"]
    if not rows:
        return None
    recorded = sources["recorded"]
    labels = [_short(r["path"]) for r in rows]
    if recorded:
        key = next(iter(rows[0]["tokens"]), None)
        tokens = [r["tokens"].get(key, 0) for r in rows]
        examples = [r["examples"] for r in rows]
    else:
        tokens = [r["num_bytes"] or 0 for r in rows]
        examples = None
    other = sources.get("other")
    if other:
        labels.append(f"other {other['files']:,} files")
        tokens.append(other["tokens"].get(key, 0) if recorded else other["num_bytes"])
        if examples is not None:
            examples.append(other["examples"])
    n = len(labels)
    panels = 2 if examples is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(10, 0.8 + 0.28 * n), squeeze=False, sharey=True)
    ys = list(range(n))[::-1]
    colors = [_BLUE] * (n - (1 if other else 0)) + ([_GREY] if other else [])
    axes[0][0].barh(ys, tokens, color=colors)
    axes[0][0].set_yticks(ys, labels, fontsize=7)
    axes[0][0].set_xlabel(f"tokens ({key})" if recorded else "bytes")
    if examples is not None:
        axes[0][1].barh(ys, examples, color=[_ORANGE] * (n - (1 if other else 0)) + ([_GREY] if other else []))
        axes[0][1].set_xlabel("source examples")
    for ax, values in zip(axes[0], (tokens, examples)):
        ax.grid(axis="x", alpha=0.3)
        # The rest of many files dwarfs the top ones: a log scale keeps both readable.
        if other and values and min(values) > 0 and max(values) > 20 * min(values):
            ax.set_xscale("log")
            ax.set_xlabel(ax.get_xlabel() + " (log scale)")
    return _png(fig)


def _short(path: str | None, width: int = 48) -> str:
    path = path or "?"
    return path if len(path) <= width else "…" + path[-(width - 1):]


def plot_quarantine(quarantine: Mapping[str, Any]) -> str | None:
    """Records per (action, kind)."""
    kinds = quarantine["kinds"]
    if not kinds:
        return None
    fig, ax = plt.subplots(figsize=(8.5, 0.8 + 0.35 * len(kinds)))
    labels = [f"{k['action']}: {k['kind']}" for k in kinds][::-1]
    counts = [k["records"] for k in kinds][::-1]
    colors = [_RED if k["action"] == "skipped" else _ORANGE for k in kinds][::-1]
    ax.barh(labels, counts, color=colors)
    for y, c in enumerate(counts):
        ax.text(c, y, f" {c:,}", va="center", fontsize=8)
    ax.set_xlabel("source records")
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def plot_shards(shards: Mapping[str, Any]) -> str | None:
    """Records and bytes per shard, with the mean."""
    if not shards["num_shards"]:
        return None
    xs = list(range(shards["num_shards"]))
    fig, axes = plt.subplots(1, 2, figsize=(10, 2.8))
    for ax, values, label, color in ((axes[0], shards["records"], "records", _BLUE),
                                     (axes[1], [b / 1e6 for b in shards["num_bytes"]], "MB", _GREEN)):
        ax.bar(xs, values, color=color, width=0.9 if len(xs) < 200 else 1.0)
        mean = sum(values) / len(values)
        ax.axhline(mean, color=_RED, linewidth=1, label=f"mean {mean:,.1f}")
        ax.set_xlabel("shard")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(label)
        ax.legend(loc="lower right", fontsize=8)
    return _png(fig)


def plot_shares(mixture: Mapping[str, Any]) -> str:
    """Each task's share of the first s steps, against its target (dashed)."""
    fig, ax = plt.subplots(figsize=(8.5, 3.2))
    steps = mixture["curve_steps"]
    for i, t in enumerate(mixture["tasks"]):
        color = f"C{i % 10}"
        ax.plot(steps, t["share_at_steps"], color=color, label=t["name"])
        ax.axhline(t["target_share"], color=color, linestyle="--", linewidth=0.8)
    if len(steps) > 1 and steps[-1] / steps[0] > 50:
        ax.set_xscale("log")
    if mixture.get("state_step") is not None and mixture["state_step"] > 0:
        ax.axvline(mixture["state_step"], color=_GREY, linewidth=1, label=f"saved state: step {mixture['state_step']:,}")
    ax.set_xlabel(f"first s steps (global batch {mixture['global_batch_size']:,})")
    ax.set_ylabel("share of rows")
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    return _png(fig)


def plot_epochs(mixture: Mapping[str, Any]) -> str:
    """Epochs read by each task over the steps; the reported step marked."""
    fig, ax = plt.subplots(figsize=(8.5, 3.2))
    steps = mixture["epoch_curve_steps"]
    for i, t in enumerate(mixture["tasks"]):
        ax.plot(steps, t["epochs_over_steps"], color=f"C{i % 10}", label=t["name"])
    ax.axvline(mixture["at_step"], color=_RED, linewidth=1, label=f"step {mixture['at_step']:,}")
    ax.set_xlabel("step")
    ax.set_ylabel("epochs read (positions / examples)")
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    return _png(fig)


def plot_first_reads(ov: Mapping[str, Any]) -> str:
    """Benchmark items whose first overlapping example the run has read by step s."""
    fig, ax = plt.subplots(figsize=(8.5, 3.0))
    steps = ov["first_reads"]
    ax.step([0, *steps], range(len(steps) + 1), where="post", color=_BLUE)
    before = (ov.get("summary") or {}).get("before_step")
    if before is not None:
        ax.axvline(before, color=_RED, linewidth=1, label=f"step {before:,}")
        ax.legend(fontsize=8, loc="lower right")
    ax.set_xlabel(f"step (global batch {ov['run']['global_batch_size']:,})")
    ax.set_ylabel("items read")
    ax.grid(alpha=0.3)
    return _png(fig)


# --- page ----------------------------------------------------------------------

_STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2em auto; max-width: 72em;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
h3 { font-size: 1.05em; }
table { border-collapse: collapse; margin: .5em 0 1em; }
td, th { border: 1px solid #ddd; padding: .2em .6em; vertical-align: top; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f4f4f4; }
figure.plot { margin: .5em 0 1em; } figure.plot img { max-width: 100%; height: auto; }
figcaption, .note { color: #555; font-size: .92em; }
code { font-size: .92em; } .warn { color: #a00; }
"""


def render(report: Mapping[str, Any], *, title: str | None = None, elapsed_s: float | None = None) -> str:
    """The HTML page of a report (``seqcache.cli.report.build_report``'s dict)."""
    caches = report["caches"]
    if title is None:
        title = ("mixture of " + ", ".join(c["summary"]["task"] for c in caches)) if report.get("mixture") \
            else f"{caches[0]['summary']['task']}/{caches[0]['summary']['split']}"
    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>seqcache report: {_e(title)}"
             f"</title><style>{_STYLE}</style></head><body>", f"<h1>seqcache report: {_e(title)}</h1>"]
    if report.get("mixture"):
        parts.append(_mixture_section(report["mixture"]))
    for ov in report.get("overlap") or ():
        parts.append(_overlap_section(ov))
    for c in caches:
        parts.append(_cache_section(c, heading=len(caches) > 1 or bool(report.get("mixture"))))
    foot = f"report format {report.get('report_version')}"
    if elapsed_s is not None:
        foot += f", computed in {elapsed_s:.2f} s"
    parts.append(f'<p class="note">{_e(foot)}; the numbers come from each manifest and quarantine file '
                 "(<code>seqcache report --json</code> prints them).</p></body></html>")
    return "\n".join(parts)


def _cache_section(c: Mapping[str, Any], *, heading: bool) -> str:
    """One cache's part of the page: summary, lengths, packing, sources, skips, shards."""
    parts = [_summary_part(c, heading=heading), _lengths_part(c), _packing_part(c), _sources_part(c),
             _quarantine_part(c), _shards_part(c)]
    return "\n".join(p for part in parts for p in part)


def _summary_part(c: Mapping[str, Any], *, heading: bool) -> list[str]:
    s = c["summary"]
    st = s["statistics"]
    out = []
    if heading:
        out.append(f"<h2>{_e(s['task'])}/{_e(s['split'])}</h2>")
    out.append(f'<p>Cache <code>{_e(c["cache_dir"])}</code>, fingerprint <code>{_e(s["fingerprint"][:16])}</code>…, '
               f'built {_e(s.get("created"))} by seqcache {_e(s.get("seqcache_version"))}.</p>')
    if c.get("problem"):
        out.append(f'<p class="warn">warning: {_e(c["problem"])}</p>')
    rows = [("examples", "num_examples", s["num_examples"]), ("shards", "num_shards", s["num_shards"]),
            ("bytes (data shards)", "num_bytes", s["num_bytes"]), ("source files", "num_sources", s["num_sources"]),
            ("seed", "seed", s["seed"])]
    for key in ("source_records", "source_examples", "segments", "truncated_tokens", "skipped_records",
                "replaced_records"):
        if key in st:
            rows.append((key.replace("_", " "), f"statistics.{key}", st[key]))
    for name, n in st.get("tokens", {}).items():
        rows.append((f"tokens ({name})", f"statistics.tokens.{name}", n))
        if name in st.get("mean_length", {}):
            rows.append((f"mean length ({name})", f"statistics.mean_length.{name}", st["mean_length"][name]))
        if name in st.get("max_length", {}):
            rows.append((f"max length ({name})", f"statistics.max_length.{name}", st["max_length"][name]))
    out.append('<table class="summary"><tbody>' + "".join(
        f"<tr><th>{_e(label)}</th>{_cell(key, value)}</tr>" for label, key, value in rows) + "</tbody></table>")
    out.append(f"<p>Sequence length <code>{_e(json.dumps(s['sequence_length']))}</code>, packing "
               f"<code>{_e(s['packing'])}</code>.</p>")
    return out


def _lengths_part(c: Mapping[str, Any]) -> list[str]:
    s = c["summary"]
    out = ["<h3>Example lengths</h3>"]
    img = plot_lengths(c["lengths"])
    lines = []
    for name, e in c["lengths"].items():
        if not e["recorded"]:
            lines.append(f"<li>{_e(name)}: histogram {_e(e['reason'])}; mean {_num(e['mean_length'])}, "
                         f"max {_num(e['max_length'])} tokens.</li>")
            continue
        text = (f"<li>{_e(name)}: {e['count']:,} {_e(e['of'])}; median at most {e['p50_at_most']:,}, 90 % at most "
                f"{e['p90_at_most']:,}, 99 % at most {e['p99_at_most']:,} tokens; mean {_num(e['mean_length'])}, "
                f"max {_num(e['max_length'])}")
        if "longer_than_sequence_length_at_least" in e:
            text += (f"; at least {e['longer_than_sequence_length_at_least']:,} longer than the sequence length "
                     f"{e['sequence_length']:,}" + (" (split by packing)" if s["packing"] else " (trimmed)"))
        lines.append(text + ".</li>")
    if img:
        out.append(_figure(img, "histogram of example lengths",
                           "Examples per length bucket (buckets about 9 % wide, exact below 16 tokens); the red line "
                           "is the sequence length."))
    out.append("<ul>" + "".join(lines) + "</ul>")
    return out


def _packing_part(c: Mapping[str, Any]) -> list[str]:
    out = ["<h3>Packing efficiency</h3>"]
    img = plot_packing(c["packing"])
    if img:
        out.append(_figure(img, "packing efficiency", "Tokens against padding in examples x sequence length: what a "
                                                      "feeder at the cache's sequence length fills."))
    items = []
    for name, e in c["packing"].items():
        if e["efficiency"] is None:
            items.append(f"<li>{_e(name)}: {_e(e['reason'])}.</li>")
        else:
            extra = (f"; {e['segments_per_example']:.2f} segments per example"
                     if "segments_per_example" in e else "")
            items.append(f"<li>{_e(name)}: {_pct(e['efficiency'])} ({e['tokens']:,} tokens in {e['examples']:,} x "
                         f"{e['sequence_length']:,}; {e['padding_tokens']:,} padding tokens){extra}; "
                         f"{e['truncated_tokens']:,} tokens trimmed by the build.</li>")
    out.append("<ul>" + "".join(items) + "</ul>")
    return out


def _sources_part(c: Mapping[str, Any]) -> list[str]:
    src = c["sources"]
    out = [f"<h3>Source files ({src['num_files']:,})</h3>"]
    img = plot_sources(src)
    if not src["recorded"]:
        out.append(f'<p class="note">Tokens and examples per file: {_e(src["reason"])}. Shown: file sizes.</p>')
    if img:
        out.append(_figure(img, "tokens and examples per source file",
                           (f"The {len(src['top'])} files with the most {_e(src['ranked_by'])}"
                            if len(src["top"]) > 1 else f"The only file, by {_e(src['ranked_by'])}")
                           + (", then the rest in one bar." if src.get("other") else ".")))
    out.append(_sources_table(src))
    return out


def _quarantine_part(c: Mapping[str, Any]) -> list[str]:
    q = c["quarantine"]
    out = [f"<h3>Skipped and repaired records ({q['skipped_records']:,} skipped, "
           f"{q['replaced_records']:,} repaired)</h3>"]
    img = plot_quarantine(q)
    if not img:
        out.append('<p class="note">None: every source record gave its examples as read.</p>')
        return out
    out.append(_figure(img, "skipped and repaired records by kind",
                       f"From <code>{_e(q['file'])}</code>: red skipped (no example), orange repaired (cached)."))
    for k in q["kinds"]:
        out.append(f"<p><b>{_e(k['action'])}: {_e(k['kind'])}</b>, {k['records']:,} records; the first "
                   f"{len(k['first'])}:</p><table><thead><tr><th>file</th><th>where</th><th>what</th></tr>"
                   "</thead><tbody>" + "".join(
                       f"<tr><td><code>{_e(f['path'])}</code></td><td>{_e(f['location'])}</td>"
                       f"<td>{_e(f['error'])}</td></tr>" for f in k["first"]) + "</tbody></table>")
    return out


def _shards_part(c: Mapping[str, Any]) -> list[str]:
    sh = c["shards"]
    out = [f"<h3>Shards ({sh['num_shards']:,})</h3>"]
    img = plot_shards(sh)
    if img:
        rs, bs = sh["records_skew"], sh["bytes_skew"]
        out.append(_figure(img, "records and bytes per shard", "Records and megabytes per shard; the red line is the "
                                                               "mean."))
        out.append(f"<p>Records per shard {rs['min']:,} to {rs['max']:,} (largest / mean "
                   f"{_num(rs['max_over_mean'])}); bytes {bs['min']:,} to {bs['max']:,} (largest / mean "
                   f"{_num(bs['max_over_mean'])}).</p>")
    return out


def _sources_table(src: Mapping[str, Any]) -> str:
    recorded = src["recorded"]
    names = list(src["top"][0]["tokens"]) if recorded and src["top"] else []
    head = "<tr><th>#</th><th>file</th><th>bytes</th>" + ("<th>examples</th>" if recorded else "") + "".join(
        f"<th>tokens ({_e(n)})</th>" for n in names) + "</tr>"
    body = []
    for r in src["top"]:
        body.append(f"<tr><td class=\"num\">{r['source_index']}</td><td><code>{_e(r['path'])}</code></td>"
                    f"<td class=\"num\">{_num(r['num_bytes'])}</td>"
                    + (f"<td class=\"num\">{r['examples']:,}</td>" if recorded else "")
                    + "".join(f"<td class=\"num\">{r['tokens'][n]:,}</td>" for n in names) + "</tr>")
    other = src.get("other")
    if other:
        body.append(f"<tr><td></td><td>other {other['files']:,} files</td><td class=\"num\">{other['num_bytes']:,}</td>"
                    + (f"<td class=\"num\">{other['examples']:,}</td>" if recorded else "")
                    + "".join(f"<td class=\"num\">{other['tokens'][n]:,}</td>" for n in names) + "</tr>")
    return f"<table><thead>{head}</thead><tbody>{''.join(body)}</tbody></table>"


def _mixture_section(mx: Mapping[str, Any]) -> str:
    out = ["<h2>Mixture</h2>",
           f"<p>Global batch {mx['global_batch_size']:,}; the first {mx['steps']:,} steps"
           + (f"; {mx['num_epochs']} epochs per task (then padding rows)" if mx.get("num_epochs") else "")
           + (f"; the saved state is at step {mx['state_step']:,}" if mx.get("state_step") is not None else "")
           + ".</p>"]
    out.append(_figure(plot_shares(mx), "each task's share of the stream over the first steps",
                       "Share of the rows of the first s steps (solid) against the target rate (dashed): exact, "
                       "from the feeder's mixing."))
    out.append(_figure(plot_epochs(mx), "epochs read by each task over the steps",
                       f"Epochs read by each task; the red line is step {mx['at_step']:,}."))
    rows = "".join(
        f"<tr><td>{_e(t['name'])}</td><td class=\"num\">{_num(t['rate'])}</td><td class=\"num\">"
        f"{_pct(t['target_share'])}</td><td class=\"num\">{_pct(t['share_at_steps'][-1])}</td><td class=\"num\">"
        f"{100 * t['max_share_error']:.3f} pp</td><td class=\"num\">{t['num_examples']:,}</td>"
        f"<td class=\"num\">{t['epoch_at_step']:,}</td><td class=\"num\">{t['epochs_at_step']:.3f}</td></tr>"
        for t in mx["tasks"])
    out.append("<table><thead><tr><th>task</th><th>rate</th><th>target share</th>"
               f"<th>share of {mx['steps']:,} steps</th><th>largest gap</th><th>examples</th>"
               f"<th>epoch at step {mx['at_step']:,}</th><th>epochs read</th></tr></thead>"
               f"<tbody>{rows}</tbody></table>")
    return "\n".join(out)


def _overlap_section(ov: Mapping[str, Any]) -> str:
    """A result of ``seqcache overlap``: its counts, the curve of items read by
    step, and its first items."""
    b, s, run = ov["benchmark"], ov["summary"], ov.get("run")
    out = [f"<h2>Benchmark overlap: {_e(b['name'])}</h2>",
           f"<p>{s['items_with_overlap']:,} of {s['items']:,} items share an n-gram of {b['n']} normalised words "
           f"with {s['overlapping_examples']:,} example(s) ({s['matches']:,} match(es)); {s['too_short']:,} item(s) "
           f"too short to match (under {b['min_words']} words)"
           + (f", {s['empty']:,} empty benchmark record(s) skipped" if s.get("empty") else "")
           + ". Benchmark fingerprint "
           f"<code>{_e(b['fingerprint'][:16])}</code>….</p>"]
    if run is not None:
        out.append(f"<p>Run: seed {run['seed']}, global batch {run['global_batch_size']:,}"
                   + (f", saved state at step {run['state_step']:,}" if run.get("state_step") is not None else "")
                   + f": {s['items_seen']:,} item(s) read"
                   + (f", {s['items_seen_before_step']:,} before step {s['before_step']:,}"
                      if s.get("items_seen_before_step") is not None else "") + ".</p>")
        if ov["first_reads"]:
            out.append(_figure(plot_first_reads(ov), "benchmark items read by step",
                               "Items whose first overlapping example the run has read by step s (epoch 0)."))
    if ov.get("problem"):
        out.append(f'<p class="warn">warning: {_e(ov["problem"])}</p>')
    rows = []
    for it in ov["items"]:
        first, m = it.get("first_seen"), it.get("first_match") or {}
        rows.append(f"<tr><td class=\"num\">{it['item']:,}</td><td>{_e(it.get('location'))}</td>"
                    f"<td class=\"num\">{_num(it.get('num_examples'))}</td>"
                    f"<td class=\"num\">{_num(None if first is None else first['step'])}</td>"
                    f"<td>{_e(m.get('task'))} #{_num(m.get('cache_index'))} ({_e(m.get('feature'))}): "
                    f"{_e(_short(m.get('source')))} {_e(m.get('location'))}</td><td>{_e(m.get('span'))}</td></tr>")
    if rows:
        out.append("<table><thead><tr><th>item</th><th>where</th><th>examples</th><th>first step</th>"
                   "<th>first match: task #index (feature): source</th><th>matched span</th></tr></thead>"
                   f"<tbody>{''.join(rows)}</tbody></table>")
    return "\n".join(out)
