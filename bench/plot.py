#!/usr/bin/env python3
"""Plot load results: req/s and p50/p99 latency per target, grouped by concurrency.

Input: a JSON list of {"target", "concurrency", "rps", "p50_ms", "p99_ms"} (one entry per
target and concurrency; when several entries share a target and concurrency, e.g. repetitions,
their median is plotted), or a JSON object holding such lists by name (bench/suite.sh's
suite-<date>.json): --section picks one (default "matrix"). Output: two files in --out-dir:
  <name>-rps.<fmt>      grouped bars, one group per concurrency, one bar per target (req/s)
  <name>-latency.<fmt>  same grouping; solid bar = p50, lighter bar on top = p99 (log scale ms)
Targets keep their order of first appearance in the input.

Usage:
  python3 bench/plot.py results.json [--out-dir bench/results] [--name NAME] [--format svg|png] \
      [--section NAME] [--title TEXT]
NAME defaults to the input's file name without .json, plus -SECTION when --section is given.
matplotlib comes from bench/requirements-plot.txt, installed in bench/.venv on first run.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _venv  # noqa: E402

_venv.ensure()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

FIELDS = ("target", "concurrency", "rps", "p50_ms", "p99_ms")


def load(path, section=None):
    with open(path) as f:
        rows = json.load(f)
    if isinstance(rows, dict):
        section = section or "matrix"
        if section not in rows:
            raise SystemExit(f"{path}: no section {section!r} (has {', '.join(rows)})")
        rows = rows[section]
    elif section:
        raise SystemExit(f"{path}: --section needs a JSON object, this is a list")
    if not isinstance(rows, list) or not rows:
        raise SystemExit(f"{path}: expected a non-empty JSON list")
    cells = {}
    targets, concs = [], set()
    for i, row in enumerate(rows):
        missing = [k for k in FIELDS if k not in row]
        if missing:
            raise SystemExit(f"{path}: entry {i} lacks {', '.join(missing)}")
        t, c = str(row["target"]), int(row["concurrency"])
        if t not in targets:
            targets.append(t)
        concs.add(c)
        cells.setdefault((t, c), []).append(row)
    med = {k: {f: statistics.median(float(r[f]) for r in v) for f in FIELDS[2:]}
           for k, v in cells.items()}
    return targets, sorted(concs), med


def bars(ax, targets, concs, med, field, **kw):
    width = 0.8 / len(targets)
    for i, t in enumerate(targets):
        xs = [j + (i - (len(targets) - 1) / 2) * width for j in range(len(concs))]
        ys = [med[(t, c)][field] if (t, c) in med else 0 for c in concs]
        yield t, i, ax.bar(xs, ys, width * 0.95, color=f"C{i}", **kw)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="JSON list of {target, concurrency, rps, p50_ms, p99_ms}")
    p.add_argument("--out-dir", default=None, help="default: the input's directory")
    p.add_argument("--name", default=None, help="file name stem (default: input name)")
    p.add_argument("--format", choices=("svg", "png"), default="svg")
    p.add_argument("--section", help="list to plot when the input is a JSON object")
    p.add_argument("--title", default="", help="prefix for the chart titles")
    args = p.parse_args()
    targets, concs, med = load(args.results, args.section)
    out_dir = args.out_dir or os.path.dirname(os.path.abspath(args.results))
    name = args.name or os.path.splitext(os.path.basename(args.results))[0] + \
        (f"-{args.section}" if args.section else "")
    prefix = f"{args.title}: " if args.title else ""
    os.makedirs(out_dir, exist_ok=True)
    labels = [f"c={c}" for c in concs]
    written = []

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for _t, _i, container in bars(ax, targets, concs, med, "rps"):
        ax.bar_label(container, fmt=lambda v: f"{v / 1000:.1f}k" if v else "", fontsize=7,
                     padding=2)
    ax.set_xticks(range(len(concs)), labels)
    ax.set_ylabel("requests per second")
    ax.set_title(prefix + "Throughput by target and concurrency")
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=f"C{i}") for i in range(len(targets))], targets,
              loc="upper left", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    fig.tight_layout()
    written.append(os.path.join(out_dir, f"{name}-rps.{args.format}"))
    fig.savefig(written[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    list(bars(ax, targets, concs, med, "p99_ms", alpha=0.35))
    list(bars(ax, targets, concs, med, "p50_ms"))
    ax.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)  # narrow ranges label minor ticks: no 4x10^0
    ax.set_xticks(range(len(concs)), labels)
    ax.set_ylabel("latency, ms (log scale)")
    ax.set_title(prefix + "Latency: p50 (solid) and p99 (light)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{i}") for i in range(len(targets))]
    handles += [plt.Rectangle((0, 0), 1, 1, color="grey"),
                plt.Rectangle((0, 0), 1, 1, color="grey", alpha=0.35)]
    ax.legend(handles, targets + ["p50", "p99"], loc="upper left", fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.set_axisbelow(True)
    fig.tight_layout()
    written.append(os.path.join(out_dir, f"{name}-latency.{args.format}"))
    fig.savefig(written[-1])
    plt.close(fig)
    print("\n".join(written))


if __name__ == "__main__":
    main()
