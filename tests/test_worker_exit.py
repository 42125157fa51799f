"""How worker processes leave: their own exit handlers run, the parent's do not."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A dataset that does what tqdm does in a worker (a multiprocessing lock, which for
# spawn/forkserver is a named semaphore known to the resource tracker) and registers an
# atexit handler there. The parent registers one too: it must run in the parent only.
SCRIPT = textwrap.dedent("""
    import atexit, multiprocessing, os, sys

    import torch
    from aioloader import DataLoader, Dataset, get_worker_info

    OUT = sys.argv[2]

    def mark(who):
        with open(os.path.join(OUT, f"{who}-{os.getpid()}"), "w") as f:
            f.write("ran")

    class LockingDataset(Dataset):
        def __init__(self):
            self.lock = None

        def __len__(self):
            return 8

        def __getitem__(self, i):
            if self.lock is None:
                self.lock = multiprocessing.RLock()  # as tqdm.get_lock() in a worker
                atexit.register(mark, f"worker{get_worker_info().id}")
            with self.lock:
                return torch.tensor(i)

    if __name__ == "__main__":
        atexit.register(mark, "parent")
        loader = DataLoader(LockingDataset(), batch_size=2, num_workers=2,
                            multiprocessing_context=sys.argv[1])
        print(sorted(int(x) for b in loader for x in b))
""")


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_worker_runs_its_own_finalizers_and_atexit_handlers(method: str, tmp_path: Path) -> None:
    """No 'leaked semaphore' warning; the worker's atexit handler runs, the parent's does not."""
    script = tmp_path / "prog.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(script), method, str(out)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(list(range(8)))
    assert "leaked semaphore" not in proc.stderr, proc.stderr
    assert "resource_tracker" not in proc.stderr, proc.stderr
    # Once per worker, and the parent's handler once: it did not run in forked workers.
    marks = sorted(p.name.split("-")[0] for p in out.iterdir())
    assert marks == ["parent", "worker0", "worker1"], marks


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("closed", [False, True])
def test_an_iterator_alive_at_interpreter_exit_leaves_quietly(closed: bool, persistent: bool) -> None:
    """torch's ``__del__`` calls ``_shutdown_workers()`` while the interpreter clears module
    globals; it used to print "Exception ignored ... 'NoneType' object is not callable", and
    with persistent workers "... 'NoneType' object has no attribute 'getpid'" (seen when
    Lightning keeps an iterator alive until exit)."""
    # `import aioloader` and a module-level iterator, as a user's script has them (a
    # `from aioloader import DataLoader` changes the teardown order and hid the bug).
    script = textwrap.dedent(f"""
        import torch
        import aioloader

        class Pairs(torch.utils.data.Dataset):
            def __len__(self):
                return 64

            def __getitem__(self, i):
                return torch.zeros(3), i

        loader = aioloader.DataLoader(Pairs(), batch_size=8, num_workers=2,
                                      multiprocessing_context="fork",
                                      persistent_workers={persistent})
        it = iter(loader)
        first = next(it)
        if {closed}:
            it.close()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    for bad in ("Traceback", "Exception ignored", "Error"):
        assert bad not in proc.stderr, proc.stderr
