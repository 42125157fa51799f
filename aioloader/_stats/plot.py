"""``loader.stats().plot(path)``: the statistics as a picture (PNG) or a page (HTML).

Six panels: throughput, the consumer's wait share and the queues over the latest epoch
(from its timeline, :mod:`aioloader._stats.timeline`), the workers' busy and CPU shares
over it, each stage's busy share, and each worker's CPU, idle and run-queue shares; the
hint is the title. matplotlib is an optional extra (``pip install aioloader[plot]``),
imported only here and only when a picture is asked for. Headless and without side
effects: a :class:`matplotlib.figure.Figure` drawn by the Agg canvas, never ``pyplot``
(whose global state and backend belong to the user).

The statistics are taken by duck typing (a ``LoaderStats``): this module sits below
:mod:`aioloader._stats.report`, which imports it.
"""

from __future__ import annotations

import base64
import html
import io
import os
import textwrap
from typing import Any

from .timeline import Series

__all__ = ["SUFFIXES", "render_png", "write_plot"]

#: What :func:`write_plot` writes, by the path's suffix.
SUFFIXES = (".png", ".html")
_INSTALL = "pip install aioloader[plot]"

# Stages whose work is spread over the workers (their busy share is per worker).
_PER_WORKER = ("fetch", "collate", "transport")


def _figure_class() -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(f"loader.stats().plot() needs matplotlib, an optional extra of "
                          f"aioloader: {_INSTALL}") from exc
    return Figure, FigureCanvasAgg


def write_plot(stats: Any, path: str | os.PathLike[str]) -> None:
    """Write ``stats`` to ``path``: ``.png`` a picture, ``.html`` a page holding it."""
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix not in SUFFIXES:
        raise ValueError(f"plot(path={os.fspath(path)!r}): the suffix says what to write: "
                         f"'.png' (a picture) or '.html' (a page with the picture and the "
                         f"table), not {suffix or 'none'!r}")
    png = render_png(stats)
    if suffix == ".png":
        with open(path, "wb") as f:
            f.write(png)
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(_page(stats, png))


def _page(stats: Any, png: bytes) -> str:
    """A self-contained HTML page: the hint, the picture inline (base64), the table."""
    hint = html.escape(stats.hint or "")
    return (
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
        f"<title>aioloader stats: {hint}</title>"
        "<style>body{font-family:sans-serif;margin:1em}pre{font-size:12px}"
        "img{max-width:100%}</style></head><body>\n"
        f"<h2>{hint}</h2>\n"
        f"<img alt=\"aioloader stats\" src=\"data:image/png;base64,"
        f"{base64.b64encode(png).decode('ascii')}\">\n"
        f"<pre>{html.escape(str(stats))}</pre>\n</body></html>\n")


def render_png(stats: Any, dpi: int = 90) -> bytes:
    """The picture of ``stats`` as PNG bytes."""
    figure_cls, canvas_cls = _figure_class()
    fig = figure_cls(figsize=(13, 8.5), dpi=dpi)
    canvas_cls(fig)
    axes = fig.subplots(3, 2)
    series = stats.timeline.series() if stats.timeline is not None else None
    workers = len(stats.workers)
    _throughput(axes[0][0], stats, series)
    _wait(axes[0][1], series)
    _queues(axes[1][0], series)
    _workers_over_time(axes[1][1], series, workers)
    _stage_shares(axes[2][0], stats)
    _worker_bars(axes[2][1], stats)
    title = "\n".join(textwrap.wrap(f"hint: {stats.hint}", 120)[:3])
    fig.suptitle(title, fontsize=11, fontweight="bold", x=0.01, ha="left")
    fig.text(0.01, 0.005, stats.line().split("; ")[0] + f"; {stats.startup_s:.3f}s to the "
             f"first batch", fontsize=8, color="dimgray")
    # Fixed margins: tight_layout() measures every label (a third of the render time).
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.07, top=0.9, hspace=0.45,
                        wspace=0.22)
    out = io.BytesIO()
    fig.savefig(out, format="png")
    return out.getvalue()


def _title(ax: Any, title: str, y_ticks: bool = True) -> None:
    """A panel's title at a fixed height (matplotlib otherwise measures every tick label
    to place it) and few ticks (``y_ticks``: on a numeric y axis): text and ticks are
    most of the render time."""
    ax.set_title(title, fontsize=10, y=1.0, pad=4)
    ax.locator_params(axis="x", nbins=6)
    if y_ticks:
        ax.locator_params(axis="y", nbins=4)
    ax.tick_params(labelsize=8)


def _empty(ax: Any, title: str, why: str) -> None:
    _title(ax, title)
    ax.text(0.5, 0.5, why, ha="center", va="center", fontsize=9, color="dimgray",
            transform=ax.transAxes, wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def _known(t: list[float], values: list[float | None]) -> tuple[list[float], list[float]]:
    pairs = [(x, v) for x, v in zip(t, values, strict=True) if v is not None]
    return [x for x, _ in pairs], [v for _, v in pairs]


def _throughput(ax: Any, stats: Any, s: Series | None) -> None:
    title = "throughput over the epoch"
    if s is None or not s.t_s:
        _empty(ax, title, "no batch delivered yet")
        return
    ax.plot(s.t_s, s.samples_per_s, color="tab:blue", lw=1.2, drawstyle="steps-mid")
    ax.set_ylabel("samples/s")
    ax.set_ylim(bottom=0)
    _title(ax, f"{title}: {stats.batches_per_s:,.1f} batches/s, "
           f"{stats.samples_per_s:,.0f} samples/s")
    ax.set_xlabel("seconds")


def _wait(ax: Any, s: Series | None) -> None:
    title = "consumer's wait (share of the time)"
    t, wait = _known(s.t_s, s.wait_share) if s is not None else ([], [])
    if not t:
        _empty(ax, title, "no timed wait yet")
        return
    pct = [100 * w for w in wait]
    ax.fill_between(t, pct, color="tab:red", alpha=0.35, step="mid")
    ax.plot(t, pct, color="tab:red", lw=0.8, drawstyle="steps-mid")
    ax.set_ylim(0, 105)
    ax.set_ylabel("% waiting")
    ax.set_xlabel("seconds")
    _title(ax, title)


def _queues(ax: Any, s: Series | None) -> None:
    title = "queues at each ask"
    if s is None:
        _empty(ax, title, "no batch delivered yet")
        return
    t1, flight = _known(s.t_s, s.in_flight)
    t2, ready = _known(s.t_s, s.ready)
    if not t1:
        _empty(ax, title, "no window (an in-process epoch: one batch at a time)")
        return
    ax.plot(t1, flight, lw=1.0, label="in flight (dispatched, not back)",
            drawstyle="steps-mid")
    ax.plot(t2, ready, lw=1.0, label="ready in the reorder buffer", drawstyle="steps-mid")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("batches")
    ax.set_xlabel("seconds")
    ax.legend(fontsize=8, loc="best", framealpha=0.7)
    _title(ax, title)


def _workers_over_time(ax: Any, s: Series | None, workers: int) -> None:
    title = "workers over time (share per worker)"
    if not workers:
        _empty(ax, title, "no workers: loading runs in the main process")
        return
    t, busy = _known(s.t_s, s.busy_share) if s is not None else ([], [])
    if t:
        ax.plot(t, [100 * b for b in busy], lw=1.0, color="tab:green",
                label="busy (fetch + collate)", drawstyle="steps-mid")
    if s is not None and s.cpu_t_s:
        ax.plot(s.cpu_t_s, [100 * c for c in s.cpu_share], lw=1.2, color="tab:purple",
                marker=".", ms=3, label="CPU (/proc)")
    if not t and (s is None or not s.cpu_t_s):
        _empty(ax, title, "no worker timing yet")
        return
    ax.set_ylim(bottom=0)
    ax.set_ylabel("% of each worker's time")
    ax.set_xlabel("seconds")
    ax.legend(fontsize=8, loc="best", framealpha=0.7)
    _title(ax, title)


def _stage_shares(ax: Any, stats: Any) -> None:
    title = "each stage's busy share of the wall time (step: the training step)"
    wall = stats.wall_s
    if wall <= 0:
        _empty(ax, title, "no batch delivered yet")
        return
    lanes = max(len(stats.workers), 1)
    names, shares = [], []
    for st in stats.stages.values():
        if not st.count:
            continue
        per = lanes if st.name in _PER_WORKER and stats.workers else 1
        names.append(st.name + (" /worker" if per > 1 else ""))
        shares.append(100 * st.seconds / wall / per)
    names.append("step")
    shares.append(100 * stats.step_s / wall)
    ypos = list(range(len(names)))
    colors = ["tab:red" if n == "consumer_wait" else "tab:gray" if n == "step"
              else "tab:blue" for n in names]
    ax.barh(ypos, shares, color=colors)
    ax.set_yticks(ypos, names, fontsize=8)
    ax.invert_yaxis()
    for y, v in zip(ypos, shares, strict=True):
        ax.text(v, y, f" {v:.0f}%", va="center", fontsize=8)
    ax.set_xlabel("% of the wall time (async fetches overlap: may pass 100%)")
    ax.set_xlim(0, max(105.0, 1.15 * max(shares)))
    _title(ax, title, y_ticks=False)  # one per stage


def _worker_bars(ax: Any, stats: Any) -> None:
    title = "workers: CPU, waiting for a core, idle"
    if not stats.workers:
        _empty(ax, title, "no workers: loading runs in the main process")
        return
    ids = [w.worker_id for w in stats.workers]
    width = 0.27
    cols = (("CPU", "cpu_fraction", "tab:purple"), ("run queue", "runq_fraction", "tab:olive"),
            ("idle", "idle_fraction", "tab:gray"))
    for k, (name, attr, color) in enumerate(cols):
        values = [getattr(w, attr) for w in stats.workers]
        ax.bar([i + (k - 1) * width for i in range(len(ids))],
               [100 * v if v is not None else 0.0 for v in values], width,
               label=name + (" (unknown)" if all(v is None for v in values) else ""),
               color=color)
    ax.set_xticks(range(len(ids)), [str(i) for i in ids])
    ax.set_xlabel("worker")
    ax.set_ylabel("% of the epoch")
    ax.set_ylim(0, 110)
    ax.legend(fontsize=8, loc="upper right", ncol=3)
    _title(ax, title)
