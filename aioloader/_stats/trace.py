"""A loader's recent batches as a Chrome trace-event file (``loader.record_trace()``).

The recorder keeps spans ``(stage, lane, t0_ns, t1_ns, batch)`` in a bounded ring (a
``deque`` with a ``maxlen``: memory does not grow with epochs); :class:`Trace` is a
snapshot of that ring that :meth:`Trace.events` turns into the trace-event format
``torch.profiler``'s ``export_chrome_trace`` writes (``{"traceEvents": [...]}`` with
complete ``"X"`` events, times in microseconds), which Perfetto and chrome://tracing
open.

Rows: the main process is one ``pid`` with a row per lane (``consumer``: the consumer's
waits, its training step and in-process sampling/fetch/collate; ``loader``: dispatch,
pinning, the device copy); each process worker is its own ``pid`` (its OS pid) with a
``fetch``/``collate`` row and a ``transport`` row (its replies on their way to the main
process); thread workers are rows of the main process. Spans that overlap on one row
(concurrent async fetches) are spread over numbered sub-rows, so that every row nests.
All times come from one monotonic clock (``perf_counter_ns``) that every process shares.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from .recorder import LANE_CONSUMER, LANE_LOADER, STAGES, STEP, TRANSPORT

__all__ = ["Trace"]

_NAMES = (*STAGES, "step")


@dataclass(frozen=True)
class Trace:
    """A snapshot of the trace ring: ``spans`` (oldest first), the main process's pid and
    the workers' ``(pid, tid)`` by worker id (``(None, None)`` where unknown)."""

    spans: tuple[tuple[int, int, int, int, int], ...]
    pid: int
    worker_ids: tuple[tuple[int | None, int | None], ...]

    def events(self) -> list[dict[str, Any]]:
        """The trace events: metadata (process and row names) and one ``"X"`` per span."""
        out: list[dict[str, Any]] = []
        rows: dict[tuple[int, str], list[int]] = {}  # (pid, row) -> sub-row ends (ns)
        tids: dict[tuple[int, str, int], int] = {}
        pids: dict[int, str] = {self.pid: f"aioloader main process (pid {self.pid})"}
        base = min((s[2] for s in self.spans), default=0)
        for stage, lane, t0, t1, batch in sorted(self.spans, key=lambda s: s[2]):
            pid, row, args = self._place(stage, lane, batch, pids)
            ends = rows.setdefault((pid, row), [])
            for k, end in enumerate(ends):  # the first sub-row free at t0
                if end <= t0:
                    ends[k] = t1
                    break
            else:
                k = len(ends)
                ends.append(t1)
            key = (pid, row, k)
            tid = tids.get(key)
            if tid is None:
                tid = tids[key] = len(tids) + 1
                out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                            "args": {"name": row if k == 0 else f"{row} #{k + 1}"}})
                out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                            "args": {"sort_index": tid}})
            out.append({"name": _NAMES[stage], "cat": "aioloader", "ph": "X",
                        "ts": (t0 - base) / 1e3, "dur": max(0, t1 - t0) / 1e3,
                        "pid": pid, "tid": tid, "args": args})
        meta = [{"name": "process_name", "ph": "M", "pid": p, "args": {"name": name}}
                for p, name in pids.items()]
        return meta + out

    def _place(self, stage: int, lane: int, batch: int,
               pids: dict[int, str]) -> tuple[int, str, dict[str, Any]]:
        """The ``(pid, row name, args)`` of one span."""
        args: dict[str, Any] = {"batch": batch} if batch >= 0 else {}
        if lane == LANE_CONSUMER:
            return self.pid, "consumer", args
        if lane == LANE_LOADER:
            return self.pid, "loader", args
        args["worker"] = lane
        pid, tid = self.worker_ids[lane] if lane < len(self.worker_ids) else (None, None)
        what = "transport" if stage == TRANSPORT else "fetch, collate"
        if pid is not None and tid is None and pid != self.pid:  # a worker process
            pids.setdefault(pid, f"worker {lane} (pid {pid})")
            return pid, ("-> main process" if stage == TRANSPORT else "worker"), args
        label = f"worker {lane}" + (f" (tid {tid})" if tid is not None else "")
        return self.pid, f"{label}: {what}", args

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write the trace-event JSON file at ``path``."""
        doc = {"schemaVersion": 1, "displayTimeUnit": "ms", "traceEvents": self.events(),
               "otherData": {"producer": "aioloader", "step_stage": _NAMES[STEP]}}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f)
