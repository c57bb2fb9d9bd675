"""The plot of a sweep: latency percentiles and throughput against offered load (matplotlib)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .stats import saturation


def plot_sweep(points: Sequence[dict[str, Any]], path: str | os.PathLike, title: str = "") -> Path:
    """Writes a PNG: latency percentiles (top) and throughput (bottom) against offered load, the
    saturation point marked. Returns the path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    open_loop = points[0]["loop"] == "open"
    pts = sorted(points, key=lambda p: p["rate"] if open_loop else p["concurrency"])
    x = [p["rate"] if open_loop else p["concurrency"] for p in pts]
    fig, (ax_lat, ax_tp) = plt.subplots(2, 1, sharex=True, figsize=(7, 7))
    for key, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^-")):
        ax_lat.plot(x, [p["latency_s"][key] if p["latency_s"][key] is not None else np.nan for p in pts],
                    style, label=f"latency {key}")
    if pts[0]["ttft_s"] is not None:
        ax_lat.plot(x, [p["ttft_s"]["p50"] if p["ttft_s"]["p50"] is not None else np.nan for p in pts], "x:",
                    label="time to first token p50")
    ax_lat.set_ylabel("seconds")
    ax_lat.set_yscale("log")
    ax_lat.grid(True, which="both", alpha=0.3)
    ax_lat.legend(loc="upper left", fontsize=8)
    ax_tp.plot(x, [p["achieved_rate"] for p in pts], "o-", label="achieved requests/s")
    if open_loop:
        ax_tp.plot(x, [p["offered_rate"] for p in pts], "x:", color="gray", label="offered requests/s (measured)")
    ax_tok = ax_tp.twinx()
    ax_tok.plot(x, [p["generated_tokens_per_s"] for p in pts], "d--", color="tab:green", label="generated tokens/s")
    ax_tok.set_ylabel("generated tokens/s")
    ax_tp.set_ylabel("requests/s")
    ax_tp.set_xlabel("offered rate (requests/s, Poisson)" if open_loop else "concurrent users (closed loop)")
    ax_tp.grid(True, alpha=0.3)
    sat = saturation(pts)
    if sat is not None:
        xs = sat["rate"] if open_loop else sat["concurrency"]
        for ax in (ax_lat, ax_tp):
            ax.axvline(xs, color="red", linestyle="--", alpha=0.7)
        ax_tp.annotate(f"saturation: {xs:g}{'/s' if open_loop else ' users'}\n{sat['achieved_rate']:.2f} req/s",
                       (xs, sat["achieved_rate"]), textcoords="offset points", xytext=(8, -28), fontsize=8,
                       color="red")
    lines = ax_tp.get_legend_handles_labels()
    extra = ax_tok.get_legend_handles_labels()
    ax_tp.legend(lines[0] + extra[0], lines[1] + extra[1], loc="lower right", fontsize=8)
    if not open_loop and max(x) >= 8 * min(x):
        ax_tp.set_xscale("log", base=2)
        ax_tp.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    fig.suptitle(title or "translation service under load")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
