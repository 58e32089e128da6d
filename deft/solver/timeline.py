"""Timeline pictures like Figs. 11-13 of the DeFT paper: compute stream and links, one panel per scheme.

Each panel shows a few steady-state iterations of one :class:`~deft.solver.simulate.SimResult`: a row
for the compute stream (forward bars light, backward bars dark, labelled with the bucket id) and one
row per link (each all-reduce labelled with its bucket; ``b(k)`` = the bucket of the group that ended
``k`` iterations before the stage that launched it; ``'`` = a piece of a partitioned bucket).
Iterations are shaded alternately; optimizer steps that apply an update are thin red marks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from deft.solver.simulate import SimResult

if TYPE_CHECKING:  # pragma: no cover - matplotlib is imported where a picture is drawn
    from matplotlib.axes import Axes

FORWARD = "#9ecae1"
BACKWARD = "#3182bd"
UPDATE = "#d62728"
CODEC = "#636363"  # a comm hook's encode/decode on the compute stream
COMM = ("#fdae6b", "#a1d99b", "#bcbddc", "#fc9272", "#9e9ac8", "#fdd0a2", "#c7e9c0", "#dadaeb")


def _rows(result: SimResult) -> list[str]:
    links = list(result.link_utilization)
    extra = sorted({e.row for e in result.events} - {"compute", *links})
    return ["compute", *links, *extra]


def draw_timeline(results: Mapping[str, SimResult] | Sequence[SimResult], path: str | Path, *,
                  iterations: int | None = None, title: str = "") -> Path:
    """Draw one panel per result into a PNG at ``path``; returns the path.

    ``iterations``: how many steady-state iterations to show (default: a whole cycle, at least 2, at
    most 6). All panels share the time axis (milliseconds from the first shown forward start) so the
    schemes compare at a glance.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    items = list(results.values()) if isinstance(results, Mapping) else list(results)
    if not items:
        raise ValueError("nothing to draw: no simulation results")
    spans = [_shown(r, iterations) for r in items]
    width_ms = max(t1 - t0 for _, _, t0, t1 in spans) * 1e3
    heights = [len(_rows(r)) for r in items]
    fig, axes = plt.subplots(len(items), 1, figsize=(14, 1.1 + 0.75 * sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, r, span in zip(axes[:, 0], items, spans, strict=True):
        _draw_panel(ax, r, span, width_ms)
    axes[-1, 0].set_xlabel("time (ms) from the start of a steady-state iteration")
    handles = [Patch(color=FORWARD, label="forward"), Patch(color=BACKWARD, label="backward"),
               Patch(color=COMM[0], label="all-reduce (bucket; (k): k iterations old)"),
               Patch(color=UPDATE, label="optimizer step applying an update")]
    if any(e.kind == "codec" for r in items for e in r.events):
        handles.append(Patch(color=CODEC, label="codec (compression encode/decode)"))
    fig.legend(handles=handles, loc="upper right", ncol=4, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out = Path(path)
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def _shown(r: SimResult, iterations: int | None) -> tuple[int, int, float, float]:
    """(first, last) shown iteration and their forward starts: from the start of the measured
    steady-state window, ``iterations`` of them (default: a whole cycle, at least 2, at most 6)."""
    k = iterations or min(6, max(2, r.cycle))
    starts = r.iteration_starts
    first = min(range(len(starts)), key=lambda i: abs(starts[i] - r.window[0]))
    last = min(first + k, len(starts) - 1)
    return first, last, starts[first], starts[last]


def _draw_panel(ax: Axes, r: SimResult, span: tuple[int, int, float, float], width_ms: float) -> None:
    """One scheme's panel: shaded iterations, the bars of the compute stream and of every link clipped
    to the shown span, optimizer steps that apply an update, and the scheme's figures as its title."""
    first, last, t0, t1 = span
    rows = _rows(r)
    y = {name: len(rows) - 1 - i for i, name in enumerate(rows)}
    for i in range(first, last):
        a, b = (r.iteration_starts[i] - t0) * 1e3, (r.iteration_starts[i + 1] - t0) * 1e3
        ax.axvspan(a, b, color="#f0f0f0" if (i - first) % 2 == 0 else "white", zorder=0)
        ax.text((a + b) / 2, len(rows) - 0.35, f"iteration {i - first + 1}", ha="center", va="bottom",
                fontsize=7, color="#555555")
    for e in r.events:
        s, f = (e.start_s - t0) * 1e3, (e.end_s - t0) * 1e3
        if f <= 0 or s >= (t1 - t0) * 1e3 or e.row not in y:
            continue
        s, f = max(s, 0.0), min(f, (t1 - t0) * 1e3)
        if e.kind in ("update", "step", "launch"):
            if e.kind == "update":
                ax.plot([s, s], [y[e.row] - 0.4, y[e.row] + 0.4], color=UPDATE, lw=1.2, zorder=3)
            continue
        color = {"forward": FORWARD, "backward": BACKWARD, "codec": CODEC}.get(e.kind, COMM[e.bucket % len(COMM)])
        ax.broken_barh([(s, f - s)], (y[e.row] - 0.35, 0.7), facecolors=color, edgecolors="black",
                       linewidth=0.4, zorder=2)
        if (f - s) > width_ms / 120:
            ax.text((s + f) / 2, y[e.row], e.label, ha="center", va="center", fontsize=6.5,
                    color="white" if e.kind == "backward" else "black", zorder=4, clip_on=True)
    ax.set_yticks([y[n] for n in rows])
    util = r.link_utilization
    ax.set_yticklabels([n if n == "compute" else f"{n} ({util.get(n, 0.0):.0%})" for n in rows], fontsize=8)
    ax.set_xlim(0, width_ms)
    ax.set_ylim(-0.6, len(rows) - 0.05 + 0.45)
    ax.set_title(f"{r.scheme}: {r.iteration_s * 1e3:.1f} ms/iteration, bubbles {r.bubble_ratio:.0%}, "
                 f"{r.updates_per_iteration:.2f} updates/iteration (compute bound "
                 f"{r.compute_bound_s * 1e3:.1f} ms)", fontsize=9, loc="left")
    ax.tick_params(axis="x", labelsize=8)
