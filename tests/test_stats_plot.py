"""loader.stats().plot(): the timeline it draws (bounded, exact counts) and the files it
writes (PNG, HTML), headless; a clear error without matplotlib or with a bad suffix."""

from __future__ import annotations

import asyncio
import html
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
from _loader_datasets import ASleep, Sleep

from aioloader import DataLoader
from aioloader._stats.timeline import Point, Timeline, TimelineData

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

_MPL = importlib.util.find_spec("matplotlib")
#: matplotlib keeps the font files it has read open for the process's life (its font
#: cache, not the loader's): the leak check allows them.
keeps_fonts = pytest.mark.keeps_fds(
    _MPL.submodule_search_locations[0] if _MPL and _MPL.submodule_search_locations
    else "/nonexistent")


def _run(loader: DataLoader[Any], use_async: bool = False) -> int:
    async def consume() -> int:
        return sum([1 async for _ in loader])
    return asyncio.run(consume()) if use_async else sum(1 for _ in loader)


def _point(t: int, delivered: int, **kw: Any) -> Point:
    fields: dict[str, Any] = {"timed": delivered, "wait_ns": 0, "samples": 4 * delivered,
                              "asks": 0, "in_flight": 0, "ready": 0, "busy_ns": 0,
                              "cpu_s": -1.0}
    fields.update(kw)
    return Point(t, delivered, **fields)


def test_timeline_stays_bounded_and_keeps_the_totals() -> None:
    """A million snapshots' worth of batches keep at most SLOTS + 1 points, and the
    rates over the intervals add back up to every batch delivered."""
    tl = Timeline(_point(0, 0))
    due = tl.FIRST_WIDTH_NS
    t = 0
    for n in range(1, 1_000_001):
        t += 100_000  # a batch every 0.1 ms
        if t >= due:
            due = tl.add(_point(t, n))
            assert len(tl.points) <= Timeline.SLOTS + 1
    data = tl.data(_point(t, 1_000_000), workers=0)
    assert data.points[0].t_ns == 0 and data.points[-1].delivered == 1_000_000
    s = data.series(bins=50)
    assert len(s.t_s) <= 51
    # Sum of rate x interval = batches (the intervals tile the timeline).
    times = [p.t_ns for p in data.points]
    assert s.t_s == sorted(s.t_s)
    total = sum(r * w for r, w in zip(s.batches_per_s, _widths(s.t_s, times)))
    assert total == pytest.approx(1_000_000, rel=1e-6)


def _widths(mids: list[float], times: list[int]) -> list[float]:
    """Each interval's width from its middle (they tile from 0 to the last point)."""
    widths, start = [], 0.0
    for m in mids:
        width = 2 * (m - start)
        widths.append(width)
        start += width
    assert start == pytest.approx(times[-1] / 1e9)
    return widths


def test_series_rates_shares_and_queues() -> None:
    """The rates between points: a sampled epoch's waits scaled from its timed batches,
    the queues per ask, the workers' busy and CPU shares per worker."""
    s_ = 1_000_000_000
    data = TimelineData((
        _point(0, 0, cpu_s=1.0),
        _point(s_, 100, timed=10, wait_ns=s_ // 20, asks=100, in_flight=300, ready=50,
               busy_ns=s_, cpu_s=1.5),
    ), workers=2)
    s = data.series()
    assert s.t_s == [0.5]
    assert s.batches_per_s == [100.0] and s.samples_per_s == [400.0]
    assert s.wait_share == [pytest.approx(0.5)]  # 10 timed waits of 5 ms stand for 100
    assert s.in_flight == [3.0] and s.ready == [0.5]
    assert s.busy_share == [0.5] and s.cpu_share == [0.25] and s.cpu_t_s == [0.5]


@pytest.mark.parametrize(("num_workers", "use_async", "async_ds"),
                         [(0, False, False), (0, True, False), (0, True, True),
                          (2, False, False)])
def test_the_timeline_counts_every_batch(num_workers: int, use_async: bool,
                                         async_ds: bool) -> None:
    """Its last point has every delivered batch and sample, whatever the epoch's kind
    (a sampled in-process epoch included); epochs with a window see their queues."""
    ds: Any = ASleep(160, 0.0005) if async_ds else Sleep(160, 0.0005)
    loader = DataLoader(ds, batch_size=4, num_workers=num_workers)
    assert loader.stats().timeline is None  # before the first epoch
    assert _run(loader, use_async) == 40
    tl = loader.stats().timeline
    assert tl is not None
    assert tl.points[-1].delivered == 40 and tl.points[-1].samples == 160
    assert tl.points[0].delivered == 0
    windowed = num_workers > 0 or async_ds
    assert (tl.points[-1].asks > 0) == windowed
    assert tl.workers == num_workers


def test_no_timeline_with_stats_off() -> None:
    """collect_stats=False keeps nothing."""
    loader = DataLoader(Sleep(16, 0.0), batch_size=4, collect_stats=False)
    assert _run(loader) == 4
    assert loader.stats().timeline is None


def test_bad_suffix_is_refused_before_anything_is_drawn(tmp_path: Path) -> None:
    """The suffix says what to write: anything but .png/.html is a ValueError naming it."""
    loader = DataLoader(Sleep(8, 0.0), batch_size=4)
    _run(loader)
    with pytest.raises(ValueError, match=r"plot\(path=.*x\.jpg.*'\.png'.*'\.html'"):
        loader.stats().plot(tmp_path / "x.jpg")
    assert not (tmp_path / "x.jpg").exists()


def test_missing_matplotlib_names_the_extra(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Without matplotlib: an ImportError that says which extra to install."""
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    loader = DataLoader(Sleep(8, 0.0), batch_size=4)
    _run(loader)
    with pytest.raises(ImportError, match=r"pip install aioloader\[plot\]"):
        loader.stats().plot(tmp_path / "x.png")


@keeps_fonts
@pytest.mark.parametrize("num_workers", [0, 2])
def test_png_and_html_are_written_headless(tmp_path: Path, num_workers: int) -> None:
    """A PNG file and a self-contained HTML page (the picture inline, the hint, the table);
    pyplot is never imported (the user's backend and figures are left alone)."""
    pytest.importorskip("matplotlib")
    had_pyplot = "matplotlib.pyplot" in sys.modules
    loader = DataLoader(Sleep(64, 0.0005), batch_size=4, num_workers=num_workers)
    _run(loader)
    stats = loader.stats()
    png = tmp_path / "stats.png"
    stats.plot(png)
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    page = tmp_path / "stats.html"
    stats.plot(str(page))
    text = page.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    assert '<img alt="aioloader stats" src="data:image/png;base64,' in text
    assert html.escape(stats.hint) in text and "consumer_wait" in text
    assert ("matplotlib.pyplot" in sys.modules) == had_pyplot


@keeps_fonts
def test_an_empty_loader_still_draws(tmp_path: Path) -> None:
    """Before any batch every panel says why it is empty; the file is still written."""
    pytest.importorskip("matplotlib")
    loader = DataLoader(Sleep(8, 0.0), batch_size=4)
    loader.stats().plot(tmp_path / "empty.png")
    assert (tmp_path / "empty.png").read_bytes().startswith(PNG_MAGIC)


def test_saved_statistics_round_trip_through_json() -> None:
    """to_json()/from_json(): every field comes back (the trace left out, the autotuner's
    decisions as text), the timeline included; anything else is a ValueError."""
    loader = DataLoader(Sleep(64, 0.0005), batch_size=4, num_workers=2, prefetch_factor="auto")
    _run(loader)
    stats = loader.stats()
    assert stats.workers
    back = type(stats).from_json(stats.to_json())
    assert back == stats and back.timeline == stats.timeline and back.trace is None
    assert str(back) == str(stats)
    for bad in ("[]", "{}", '{"aioloader_stats": 2}', "not json",
                '{"aioloader_stats": 1, "timeline": null}'):
        with pytest.raises(ValueError, match=r"^LoaderStats\.from_json\(\): not statistics"):
            type(stats).from_json(bad)


@keeps_fonts
def test_the_command_line_draws_a_saved_file(tmp_path: Path) -> None:
    """python -m aioloader.plot stats.json out.png draws what plot() would; a bad file is
    a usage error (exit status 2) that says why."""
    pytest.importorskip("matplotlib")
    from aioloader.plot import main

    loader = DataLoader(Sleep(32, 0.0005), batch_size=4)
    _run(loader)
    saved = tmp_path / "stats.json"
    saved.write_text(loader.stats().to_json(), encoding="utf-8")
    assert main([str(saved), str(tmp_path / "out.png")]) == 0
    assert (tmp_path / "out.png").read_bytes().startswith(PNG_MAGIC)
    (tmp_path / "bad.json").write_text("{}", encoding="utf-8")
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "bad.json"), str(tmp_path / "bad.png")])
    assert exit_.value.code == 2
