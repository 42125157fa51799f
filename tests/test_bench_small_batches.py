"""Smoke tests of benchmarks/bench_small_batches.py: the quick run prints every
contender's row, the bare reference delivers what torch collates and reaps its workers,
and one case run in this process leaves no worker, thread or descriptor behind.
No timing is asserted.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_small_batches as B  # noqa: E402

# The bare reference pickles tensors in band; older torch (2.4) unpickles those through
# torch.load, which warns about weights_only (the benchmark's own data: nothing to fix).
pytestmark = pytest.mark.filterwarnings("ignore:You are using `torch.load`:FutureWarning")

NUMBER = r"[\d,]+"
RATIO = r"\d+\.\d\d"


def _reaped(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def test_quick_run_prints_every_contender_and_the_summary() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_small_batches.py"), "--quick", "--workers", "2",
         "--batch-size", "16", "--samples", "200", "--bare-numpy"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for payload in ("ints", "f16"):
        assert f"payload={payload}, workers=2, batch_size=16, 200 samples" in out, out
    for row in (B.BARE, B.BARE_NUMPY, B.FOR, B.ASYNC, B.TORCH):
        assert len(re.findall(rf"{re.escape(row)} +{NUMBER} +\d+\.\d +{RATIO} +{RATIO}",
                              out)) == 2, (row, out)
    assert len(re.findall(rf"^  (ints|f16) +2 +16(?: +{RATIO}){{5}}$", out, re.M)) == 2, out


@pytest.mark.parametrize("payload", ["ints", "f16"])
def test_bare_reference_delivers_torch_default_collate_and_reaps(payload: str) -> None:
    make, collate = B.PAYLOADS[payload]
    ds = make(100)  # batch 16: six full batches and a last one of 4
    for numpy_wire in (False, True):
        with B.BareReference(ds, collate, 2, numpy_wire=numpy_wire) as bare:
            pids = list(bare.pids)
            for _ in range(2):  # the same workers serve a second epoch
                got: list[torch.Tensor] = []
                assert bare.epoch(16, out=got) == 100
                want = [default_collate([ds[i] for i in range(s, min(s + 16, 100))])
                        for s in range(0, 100, 16)]
                assert len(got) == len(want) == 7
                for g, w in zip(got, want, strict=True):
                    assert g.dtype == w.dtype and torch.equal(g, w)
        assert bare.exit_codes == [0, 0]
        assert all(_reaped(pid) for pid in pids)


class _FailsAt(B.Ints):
    def __getitem__(self, i: int) -> int:
        if i == 37:
            raise ValueError("sample 37 is broken")
        return i


def test_a_dying_bare_worker_is_an_error_and_is_reaped() -> None:
    bare = B.BareReference(_FailsAt(64), B.collate_ints, 2)
    pids = list(bare.pids)
    try:
        with pytest.raises(RuntimeError, match=r"bare worker 0 \(pid \d+\) closed its socket"):
            bare.epoch(16)  # batch 2 (samples 32..47) is worker 0's
    finally:
        bare.close()
    assert bare.exit_codes[0] == 1
    assert all(_reaped(pid) for pid in pids)


def test_one_case_in_process_counts_every_sample_and_cleans_up() -> None:
    med = B.run_case("f16", workers=1, batch_size=8, samples=40, repeats=2)
    assert set(med) == {B.BARE, B.FOR, B.ASYNC, B.TORCH}
    assert all(rate > 0 for rate in med.values())


def test_bad_arguments_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        B.main(["--payload", "ints,x"])
    assert exc.value.code == 2 and "unknown payload(s) ['x']" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        B.main(["--workers", "0"])
    assert exc.value.code == 2
