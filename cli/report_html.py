"""``seqcache report``'s pictures: one self-contained HTML file.

Plots are drawn by matplotlib (Agg backend) and embedded as base64 PNG ``data:``
URLs; the page has no script and no external file, so it opens offline. Every
number comes from the dict ``seqcache report --json`` prints (``seqcache.cli.report``);
the summary cells carry ``data-key`` (a dotted path into ``seqcache info --json``)
and ``data-value`` (the exact value), so that a script can read them back. The
markup is Jinja2 templates (``cli/templates/*.html.j2``), autoescaped.
"""

from __future__ import annotations

import base64
import functools
import io
import json
from typing import Any, Mapping

import jinja2
import matplotlib

from seqcache.cli.commands.common import MAX_ROWS, head

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


def _num(value: Any) -> str:
    """A count or a measure as the page shows it: thousands separated, a float to 4
    significant digits (one decimal from 1,000 up), "—" for None."""
    if isinstance(value, bool) or value is None:
        return "—" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.1f}"
    return str(value)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.2f} %"


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


def plot_cluster_sizes(quarantine: Mapping[str, Any]) -> str | None:
    """Clusters of near duplicates by their size (records, the kept one included)."""
    sizes = quarantine.get("cluster_sizes") or []
    if not sizes:
        return None
    fig, ax = plt.subplots(figsize=(8.5, 2.6))
    xs, counts = [s for s, _ in sizes], [n for _, n in sizes]
    ax.bar([str(x) for x in xs], counts, color=_BLUE)
    ax.set_yscale("log")
    ax.set_xlabel("records in the cluster (one kept)")
    ax.set_ylabel("clusters")
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def plot_shards(shards: Mapping[str, Any]) -> str | None:
    """Records and bytes per shard, with the mean."""
    if not shards["num_shards"]:
        return None
    xs = list(range(shards["num_shards"]))
    fig, axes = plt.subplots(1, 2, figsize=(10, 2.8))
    for ax, values, label, color in ((axes[0], shards["records"], "records", _BLUE),
                                     (axes[1], [b / 1e6 for b in shards["num_bytes"]], "MB", _GREEN)):
        if len(xs) > MAX_BARS:  # a bar a shard would take minutes to draw
            ax.plot(xs, values, color=color, linewidth=0.5)
        else:
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


@functools.cache
def _templates() -> jinja2.Environment:
    """The page's templates (``cli/templates``, shipped as package data) and their filters."""
    env = jinja2.Environment(loader=jinja2.PackageLoader("seqcache.cli", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(num=_num, pct=_pct, short=_short, json=json.dumps,
                       fmt=lambda value, spec=",": format(value, spec))
    return env


# The most panels (features) of the lengths plot: one of 5 inches a feature.
MAX_PANELS = 8
# The most shards drawn as bars; more are drawn as one line.
MAX_BARS = 2000


def _first(items, limit: int = MAX_ROWS):
    """(the first ``limit`` entries of a dict or list, as the same type; "… and K more" or None)."""
    shown, more = head(items.items() if isinstance(items, Mapping) else items, limit)
    return (dict(shown) if isinstance(items, Mapping) else shown), more


def bounded(report: Mapping[str, Any]) -> dict:
    """The report as the page shows it: each cache's features (statistics,
    lengths, packing) and skipped or repaired kinds, and the mixture's tasks,
    at most ``MAX_ROWS`` each; ``more`` holds the "… and K more" of each list
    cut (``--json`` prints the whole report)."""
    out = dict(report)
    caches = []
    for c in report["caches"]:
        c, more = dict(c), {}
        summary = dict(c["summary"])
        stats = dict(summary["statistics"])
        for key in ("tokens", "mean_length", "max_length"):
            if isinstance(stats.get(key), Mapping):
                stats[key], more[key] = _first(stats[key])
        summary["statistics"] = stats
        c["summary"] = summary
        c["lengths"], more["lengths"] = _first(c["lengths"])
        c["packing"], more["packing"] = _first(c["packing"])
        quarantine = dict(c["quarantine"])
        quarantine["kinds"], more["kinds"] = _first(quarantine.get("kinds") or [])
        c["quarantine"], c["more"] = quarantine, more
        caches.append(c)
    out["caches"] = caches
    if report.get("mixture"):
        mixture = dict(report["mixture"])
        mixture["tasks"], mixture["more_tasks"] = _first(mixture["tasks"])
        out["mixture"] = mixture
    return out


def render(report: Mapping[str, Any], *, title: str | None = None, elapsed_s: float | None = None) -> str:
    """The HTML page of a report (``seqcache.cli.report.build_report``'s dict), every
    value in it escaped; its lists at most ``MAX_ROWS`` long (``bounded``).
    Raises ``KeyError`` or ``jinja2.UndefinedError`` where the dict lacks a key
    the page shows."""
    report = bounded(report)
    caches, mixture, overlaps = report["caches"], report.get("mixture"), report.get("overlap") or ()
    if title is None:
        title = ("mixture of " + ", ".join(c["summary"]["task"] for c in caches)) if mixture \
            else f"{caches[0]['summary']['task']}/{caches[0]['summary']['split']}"
    plots = [{"lengths": plot_lengths(_first(c["lengths"], MAX_PANELS)[0]), "packing": plot_packing(c["packing"]),
              "sources": plot_sources(c["sources"]), "quarantine": plot_quarantine(c["quarantine"]),
              "clusters": plot_cluster_sizes(c["quarantine"]), "shards": plot_shards(c["shards"])} for c in caches]
    first_reads = [plot_first_reads(ov) if ov.get("run") is not None and ov["first_reads"] else None
                   for ov in overlaps]
    return _templates().get_template("report.html.j2").render(
        title=title, report_version=report.get("report_version"), elapsed_s=elapsed_s, mixture=mixture,
        mixture_plots=(plot_shares(mixture), plot_epochs(mixture)) if mixture else (),
        overlaps=list(zip(overlaps, first_reads)), caches=list(zip(caches, plots)),
        headings=len(caches) > 1 or bool(mixture))
