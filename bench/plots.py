"""The benchmarks' pictures, each drawn from the run that prints its table, by `--plot FILE`.

matplotlib draws them, and only the benchmarks need it: `pip install -r requirements-bench.txt`. A --plot that
could not be written (no matplotlib, no such folder, not a .png) is refused before the run starts.
"""

import argparse
import statistics
from pathlib import Path

from bench.configs import png_file
from runtime.files import write_atomically

FIGSIZE, DPI = (8, 4.5), 130  # inches and dots per inch: 1040 x 585 pixels, readable at a README's width
ERRORBAR = dict(capsize=3, elinewidth=1)  # a seed spread drawn as a bar through its point
FIXED, AGAIN = dict(marker="o", mfc="white"), dict(marker="X")  # the marks of a budget run's plans


def plot_file(text: str) -> Path:
    """An argparse type: a .png file that can be written now, with matplotlib there to draw it."""
    path = png_file(text)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise argparse.ArgumentTypeError("matplotlib draws the pictures and is not installed: "
                                         "pip install -r requirements-bench.txt") from None
    return path


def figure(title: str, xlabel: str, ylabel: str, caption: str):
    """An empty figure and its axes, titled and labelled; the caption (host, date) goes under the axes."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    ax.set_title(title, fontsize=13)
    ax.set_xlabel(xlabel, fontsize=11)
    ax.set_ylabel(ylabel, fontsize=11)
    ax.grid(alpha=0.3)
    fig.supxlabel(caption, fontsize=7, color="0.4", wrap=True)  # under the axes, where the layout keeps room
    return fig, ax


def save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt
    write_atomically(path, lambda file: fig.savefig(file, format="png"))
    plt.close(fig)


def spread(rows: list[list[float]], scale: float = 1.0) -> tuple[list[float], list[float], list[float]]:
    """Per column of rows (one row per repeat): the median, lowest and highest, times scale."""
    columns = list(zip(*rows))
    return ([statistics.median(c) * scale for c in columns], [min(c) * scale for c in columns],
            [max(c) * scale for c in columns])


def cache_buys(path: Path, positions: list[int], cached: list[list[float]], uncached: list[list[float]],
               bound_s: float, block_size: int, note: str, title: str, caption: str) -> None:
    """Milliseconds per generated token against its position: cached, uncached (one list of seconds per repeat,
    one value per position), and the weight-matmul bound as a line; note: what happens past block_size."""
    fig, ax = figure(title, "position of the generated token in the text", "milliseconds per token", caption)
    handles = []
    for name, rows, color in (("uncached: a whole forward over the context", uncached, "tab:red"),
                              ("cached: one token through the KV cache", cached, "tab:blue")):
        median, low, high = spread(rows, 1e3)
        line, = ax.plot(positions, median, color=color, lw=1.5)
        handles.append(((line, ax.fill_between(positions, low, high, color=color, alpha=0.2, lw=0)), name))
    handles.append((ax.axhline(bound_s * 1e3, color="0.2", ls="--", lw=1), "weight-matmul bound: the matmuls alone"))
    ax.axvline(block_size, color="0.5", ls=":", lw=1)
    ax.text(block_size, 0.98, f" block_size {block_size}: {note}", transform=ax.get_xaxis_transform(), ha="left",
            va="top", fontsize=8.5, color="0.3", wrap=True)
    ax.set_xlim(0, positions[-1])
    ax.set_ylim(0, 1.4e3 * max(max(row) for row in uncached + cached))  # every timing, and room for the legend
    ax.legend(*zip(*handles), fontsize=9, loc="upper left", title="line: median of the repeats; band: min-max",
              title_fontsize=8)
    save(fig, path)


def designs(path: Path, points: list[dict], seeds: int, title: str, caption: str) -> None:
    """Loss against cache bytes per token, log scale: one labelled point per design (circles) and per cache over
    the preset's model (squares), over this many seeds. Each point: label, bytes, loss (median), low, high,
    cache (bool); a bar from low to high."""
    from matplotlib.ticker import FuncFormatter
    fig, ax = figure(title, "KV-cache bytes per token (log scale)", "val loss through the decoder (nats)",
                     caption)
    for kind, marker, color in ((False, "o", "tab:blue"), (True, "s", "tab:orange")):
        chosen = [p for p in points if p["cache"] == kind]
        if chosen:
            ax.errorbar([p["bytes"] for p in chosen], [p["loss"] for p in chosen], fmt=marker, color=color,
                        yerr=[[p["loss"] - p["low"] for p in chosen], [p["high"] - p["loss"] for p in chosen]],
                        label="a cache over MHA's model" if kind else "a design, trained", **ERRORBAR)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
    ax.set_xlim(min(p["bytes"] for p in points) / 1.5, max(p["bytes"] for p in points) * 2.5)  # room for labels
    low, high = min(p["low"] for p in points), max(p["high"] for p in points)
    pad = max(high - low, 1e-3) * 0.15
    ax.set_ylim(low - pad, high + pad)
    label_points(ax, points)
    ax.legend(fontsize=9, title=f"median of {seeds} seeds, bar: min-max" if seeds > 1 else "one seed",
              title_fontsize=8)
    save(fig, path)


def label_points(ax, points: list[dict], gap_pt: float = 12) -> None:
    """Each point's label to its right, joined to it by a thin line. Points of nearly one size form a group, whose
    labels stand in the order of their losses, each at its point's height or gap_pt points above the one below."""
    groups = []
    for p in sorted(points, key=lambda p: p["bytes"]):
        if groups and p["bytes"] < 1.3 * groups[-1][-1]["bytes"]:
            groups[-1].append(p)
        else:
            groups.append([p])
    bottom, top = ax.get_ylim()
    gap = gap_pt * (top - bottom) / (ax.get_position().height * ax.figure.get_figheight() * 72)  # in loss units
    for group in groups:
        group.sort(key=lambda p: p["loss"])
        ys = [group[0]["loss"]]
        for p in group[1:]:  # each label at its point, or gap above the one below it
            ys.append(max(p["loss"], ys[-1] + gap))
        shift = sum(y - p["loss"] for y, p in zip(ys, group)) / len(group)  # the stack centred on its points
        x = max(p["bytes"] for p in group) * 1.12
        for y, p in zip(ys, group):
            ax.annotate(p["label"], (p["bytes"], p["loss"]), xytext=(x, y - shift), textcoords="data", ha="left",
                        va="center", fontsize=8.5, arrowprops=dict(arrowstyle="-", color="0.6", lw=0.6,
                                                                   shrinkA=0, shrinkB=3))
        bottom, top = min(bottom, ys[0] - shift - gap), max(top, ys[-1] - shift + gap)
    ax.set_ylim(bottom, top)


def training(path: Path, runs: list[dict], title: str, caption: str) -> None:
    """Val loss against wall-clock seconds, one line per run (label, seconds, val), with each change of its plan
    (plans: seconds, steps) marked on its line: the first where the run fixed its length, the others where it
    planned again, the steps each planned in its legend entry; load: the second from which one core was busy
    (None: idle), a dotted line. The untrained model's first evaluation is left off the lines."""
    import numpy as np
    fig, ax = figure(title, "wall-clock seconds since the run started", "val loss (nats)", caption)
    drawn = []  # every loss on the axes: the limits hold them all
    for i, run in enumerate(runs):
        color = f"C{i % 10}"  # matplotlib's colour cycle
        first = 1 if len(run["val"]) > 1 else 0  # the untrained loss would squeeze the rest into a few pixels
        planned = ", ".join(f"{steps:,}" for _, steps in run["plans"])
        ax.plot(run["seconds"][first:], run["val"][first:], color=color, lw=1.5, marker=".", ms=5,
                label=run["label"] + (f"; steps planned: {planned}" if planned else ""))
        drawn += run["val"][first:]
        if run["load"] is not None:  # where the machine got busy
            ax.axvline(run["load"], color=color, ls=":", lw=1.2)
        for j, (seconds, _) in enumerate(run["plans"]):
            loss = float(np.interp(seconds, run["seconds"], run["val"]))  # on the line, between two evaluations
            ax.plot([seconds], [loss], color=color, ms=8, **(FIXED if j == 0 else AGAIN))
            drawn.append(loss)
    ax.plot([], [], color="0.3", ls="none", label="the run fixes its length", **FIXED)
    ax.plot([], [], color="0.3", ls="none", label="the run plans again", **AGAIN)
    if any(run["load"] is not None for run in runs):
        ax.plot([], [], color="0.3", ls=":", lw=1.2, label="one core gets busy")
    ax.set_xlim(0, max(s for run in runs for s in run["seconds"]) * 1.03)
    pad = max(max(drawn) - min(drawn), 1e-3) * 0.05
    ax.set_ylim(min(drawn) - pad, max(drawn) + pad)
    untrained = [run["val"][0] for run in runs if len(run["val"]) > 1]
    span = sorted({f"{v:.2f}" for v in (min(untrained), max(untrained))}) if untrained else []
    note = f"not drawn: step 0, val {'-'.join(span)}" if span else None
    ax.legend(fontsize=8.5, loc="upper right", title=note, title_fontsize=8)
    save(fig, path)
