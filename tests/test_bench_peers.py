"""Smoke test of benchmarks/bench_peers.py: it runs, checks exactly-once, prints its tables.

The peers (SPDL, torchdata.nodes) are optional: each one is either measured or
reported as "not installed", so this passes with only torch and aioloader.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import _peers_workloads as W  # noqa: E402

NUMBER = r"[\d,]+"


def test_quick_run_prints_a_table_per_workload() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_peers.py"), "--quick", "--workload", "d,a",
         "--timeout", "30"],
        cwd=ROOT, capture_output=True, text=True, timeout=90, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "(d) per-batch overhead" in out and "(a) I/O-bound" in out
    assert out.count("vs best peer") >= 3  # (d), (a) 64 in flight, (a) 256 in flight
    assert re.search(rf"torch DataLoader, num_workers=0 +{NUMBER} +1\.00", out), out
    for row in ("aioloader for", "aioloader async for", "aioloader async, 64 in flight",
                "aioloader async, 256 in flight"):
        assert re.search(rf"{re.escape(row)} +{NUMBER} +\d+\.\d\d +\d+\.\d\d", out), (row, out)
    for peer, row in (("SPDL", "SPDL"), ("torchdata.nodes", "torchdata")):
        assert re.search(rf"{re.escape(peer)} +not installed", out) or \
            re.search(rf"{row}[^\n]* {NUMBER} +\d+\.\d\d", out), (peer, out)
    assert "FAILED" not in out


def test_exactly_once_check_names_missing_and_duplicated_ids() -> None:
    W.check_exactly_once("ok", [2, 0, 1], 3)
    with pytest.raises(AssertionError, match=r"1 missing .*\[2\].*1 duplicated .*\[1\]"):
        W.check_exactly_once("dup", [0, 1, 1], 3)
    with pytest.raises(AssertionError, match="2 ids for 3 samples"):
        W.check_exactly_once("short", [0, 1], 3)


def test_unknown_workload_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    import bench_peers

    with pytest.raises(SystemExit) as exc:
        bench_peers.main(["--workload", "a,x"])
    assert exc.value.code == 2 and "unknown workload(s) ['x']" in capsys.readouterr().err
