"""Exact resume with ``worker_method="ray"``: worker randomness included (issue 22).

Skipped where Ray is not installed. Ray actors are worker processes: their global torch,
``random`` and numpy RNGs are captured after each batch and restored at a resume.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from _resume_datasets import Augment, collate_with_draw
from test_resume import _check

from aioloader import DataLoader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# As in test_ray_workers.py: on torch 2.4 Ray rebuilds a returned tensor's storage with
# torch.load(), which warns about its weights_only default; later torch passes it explicitly.
pytestmark = pytest.mark.filterwarnings(
    "ignore:You are using `torch.load` with `weights_only=False`:FutureWarning")


@pytest.fixture(scope="module")
def ray() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    import _resume_datasets

    # The actors unpickle the test datasets: sent by value; aioloader from PYTHONPATH.
    ray.cloudpickle.register_pickle_by_value(_resume_datasets)
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    # Ray's driver starts its own threads and sockets on first use: not the tests'.
    list(DataLoader(Augment(2), num_workers=1, worker_method="ray", timeout=60))
    yield ray
    ray.shutdown()


def test_ray_worker_randomness_resumes_bit_for_bit(ray: Any) -> None:
    """Regression test for issue 22: Ray actors' draws (torch, random, numpy) resume exactly."""
    def make() -> DataLoader[Any]:
        return DataLoader(Augment(23), batch_size=3, shuffle=True, num_workers=2,
                          worker_method="ray", collate_fn=collate_with_draw, timeout=60,
                          persistent_workers=True)
    _check(make, [3])  # each k starts actors twice: one k (others: test_resume.py)
