"""Smoke tests of benchmarks/bench_loop.py and benchmarks/bench_gpu_train.py: each runs
(quick), checks what it counts, and prints its table; GPU rows are skipped without CUDA.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
MS = r"\d+\.\d\d"


def _run(script: str, *args: str) -> str:
    # The checkout's aioloader, installed or not (the script's own folder is on its path).
    # One OpenMP thread: on a busy 2-core machine torch's spinning intra-op threads made
    # the CPU training steps take three times as long (the table is under test, not speed).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, str(BENCH / script), "--quick", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_bench_loop_quick_prints_every_phase_for_both_loaders() -> None:
    out = _run("bench_loop.py")
    for label in ("torch DataLoader (to_thread)", "aioloader async for"):
        assert re.search(rf"{re.escape(label)} +start-up +{MS} +{MS} +{MS}", out), out
    assert len(re.findall(rf"\n +(steady|teardown) +{MS} +{MS} +{MS}", out)) == 4, out
    assert re.search(rf"plain +\d+\.\d\d\d +\d+\.\d\d\d +{MS}", out), out
    if not torch.cuda.is_available():
        assert "rows are skipped" in out


def test_bench_gpu_train_quick_prints_the_share_of_the_ideal() -> None:
    # Small batches of small images: the table, not the model's speed, is under test (the
    # CPU's defaults, 16 images of 3x64x64, cost a ResNet-18 about 20 s here).
    out = _run("bench_gpu_train.py", "--batch-size", "4", "--side", "32")
    assert re.search(rf"data already on the device \(ideal\) +[\d,]+ +1\.00 +{MS}", out), out
    for row in ("torch DataLoader", "aioloader for", "aioloader async for"):
        assert re.search(rf"{re.escape(row)} \(.*\) +[\d,]+ +{MS} +{MS}", out), (row, out)
    if not torch.cuda.is_available():
        assert "GPU rows were not run" in out
