"""Shared output for the bench scripts: run metadata, percentiles, JSON files, Markdown tables and
matplotlib plots (throughput bars, latency against request rate, KV usage over time).

Every script writes ``<out>/<name>-<device>-<timestamp>.json`` and ``.png`` and prints a Markdown
table; ``meta()`` records the command, commit, date and machine so a figure can be traced back.
"""

from __future__ import annotations

import argparse

import json
import math
import platform
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def meta(device: str = "cpu", dtype: str = "") -> dict:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit + ("+dirty" if dirty else ""),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, {platform.processor() or platform.platform()}",
        "device": device,
        "dtype": dtype,
    }


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default); NaN for an empty list."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(values: Iterable[float | None]) -> dict:
    xs = [float(v) for v in values if v is not None and not math.isnan(v)]
    return {
        "n": len(xs),
        "mean": sum(xs) / len(xs) if xs else math.nan,
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "max": max(xs) if xs else math.nan,
    }


def table(headers: list[str], rows: list[list], align: str | None = None) -> str:
    """A Markdown table; ``align`` is one char per column, 'l' or 'r' (default: first left)."""
    align = align or "l" + "r" * (len(headers) - 1)
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"]
    for r in rows:
        out.append("| " + " | ".join(fmt(v) for v in r) + " |")
    return "\n".join(out)


def fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.2f}" if abs(v) >= 0.1 else f"{v:.3f}"
    return str(v)


def header(r: dict) -> str:
    return f"{r['date']}, commit {r['commit']}, {r['device']} {r['dtype']}, {r['machine']}\n`{r['command']}`"


def parser(doc: str | None, quick_help: str):
    """The arguments every scenario script takes; each script adds its own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--out", default="bench/results")
    return ap


def publish(result: dict, name: str, out_dir: str | Path, plot, markdown) -> Path:
    """Saves JSON + PNG, prints the Markdown table and where the full figures are."""
    path = save(result, name, out_dir, lambda p: plot(p, result))
    print(markdown(result))
    print(f"\nfull figures: {path}")
    return path


def save(result: dict, name: str, out_dir: str | Path, plot=None) -> Path:
    """Writes ``result`` as JSON and, when ``plot(path)`` is given, the PNG; returns the JSON path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-{str(result.get('device', 'cpu')).split(':')[0]}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = out / f"{stem}.json"
    if plot is not None:
        png = out / f"{stem}.png"
        try:
            plot(png)
            result["plot"] = str(png)
        except ImportError:
            pass
    path.write_text(json.dumps(result, indent=2, default=_json_default))
    return path


def _json_default(o):
    if isinstance(o, float) and math.isnan(o):
        return None
    return str(o)


# -- plots -----------------------------------------------------------------------------------------
def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bars(ax, labels: list[str], values: list[float], ylabel: str, title: str, highlight: Iterable[int] = (0,)) -> None:
    hl = set(highlight)
    ax.bar(range(len(labels)), values, color=["tab:green" if i in hl else "tab:gray" for i in range(len(labels))])
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    for i, v in enumerate(values):
        ax.annotate(fmt(float(v)), (i, v), ha="center", va="bottom", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)


def kv_timeline(ax, timelines: dict[str, list[dict]], total_blocks: int, title: str = "KV usage over time", key: str = "kv_blocks_used") -> None:
    """One line per run: fraction of the KV pool in use against seconds since the run began."""
    for label, tl in timelines.items():
        if tl:
            ax.plot([p["t"] for p in tl], [p[key] / total_blocks for p in tl], label=label, lw=1)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("seconds")
    ax.set_ylabel("KV blocks used (fraction of pool)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def latency_vs_rate(ax, rates: list[float], series: dict[str, list[float]], ylabel: str, title: str) -> None:
    for label, ys in series.items():
        ax.plot(rates, ys, marker="o", label=label)
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def run_threaded(fn, *args):
    """Runs ``fn(*args)`` in one fresh thread and returns its result (re-raising its exception).

    The scripts measure everything (engine and HF baselines alike) this way because that is how
    the worker runs the engine: ``AsyncEngine`` steps it in its own thread. On the loaded 2-core
    machine these figures come from, the same decode steps ran 2.5-4x slower in the main thread
    than in a second thread (see docs/benchmarks.md), so the choice must be the same for all.
    Warm up inside ``fn``: parallel work run in another thread first leaves an OpenMP pool there
    that throttles this one's (qworker/engine/transient_thread.py).
    """
    from qworker.engine.transient_thread import in_transient_thread

    return in_transient_thread(fn, *args, name="bench")
