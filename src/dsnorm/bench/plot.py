"""The PNG bar chart of a result (``--plot``): GB/s by provider and case (:func:`plot_png`; needs
matplotlib, the ``bench`` extra)."""

from __future__ import annotations

import io

from dsnorm.bench.registry import PROVIDERS
from dsnorm.bench.report import CONTENDED_MARK, _contended


def plot_bars(result: dict) -> list:
    """The bars of :func:`plot_png`: ``(provider, [(case index, GB/s, contended), ...])`` in the
    table's provider order; a case timed under contention has its bars marked."""
    cases = result["cases"]
    order = [name for name, _ in PROVIDERS]
    names = sorted({p["name"] for c in cases for p in c["providers"] if p["available"] and p["gbps"]},
                   key=lambda n: order.index(n) if n in order else len(order))
    bars = []
    for name in names:
        points = []
        for i, c in enumerate(cases):
            p = next((p for p in c["providers"] if p["name"] == name and p["available"] and p["gbps"]), None)
            if p is not None:
                points.append((i, p["gbps"], _contended(c)))
        bars.append((name, points))
    return bars


def plot_png(result: dict) -> bytes:
    """A PNG bar chart: GB/s (byte model) of each provider for each case, log scale, with the
    copy bandwidth as a horizontal line; bars of a case timed under contention are hatched and
    faded, and the case's label starred."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    cases = result["cases"]
    bars = plot_bars(result)
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(cases) + 2), 5.5))
    width = 0.8 / max(1, len(bars))
    cmap = plt.get_cmap("tab10")
    for j, (name, points) in enumerate(bars):
        labelled = False
        for contended in (False, True):
            pts = [(i, g) for i, g, c in points if c is contended]
            if not pts:
                continue
            ax.bar([i - 0.4 + width * (j + 0.5) for i, _ in pts], [g for _, g in pts], width,
                   label=None if labelled else name, color=cmap(j % 10),
                   alpha=0.35 if contended else 1.0, hatch="//" if contended else None,
                   edgecolor="black" if contended else None)
            labelled = True
    ax.axhline(result["copy_gbps"], color="black", linestyle="--", linewidth=1,
               label=f"copy {result['copy_gbps']:.1f} GB/s")
    handles, labels = ax.get_legend_handles_labels()
    if any(_contended(c) for c in cases):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//"))
        labels.append(f"{CONTENDED_MARK} contended: timed while other work held the CPUs")
    ax.set_yscale("log")
    ax.set_ylabel("GB/s (byte model)")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([c["name"] + (f" {CONTENDED_MARK}" if _contended(c) else "") for c in cases],
                       rotation=35, ha="right", fontsize=8)
    ax.set_title(f"dsnorm bench: {result['machine']['cpu']}, {result['machine']['threads']} threads")
    ax.legend(handles, labels, fontsize=8, ncol=2)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    return png.getvalue()
