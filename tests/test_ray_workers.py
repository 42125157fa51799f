"""worker_method="ray": the workers run as Ray actors, with local workers' semantics.

Skipped where Ray is not installed (``pip install aioloader[ray]``), except the checks
of the argument itself. One local Ray instance (2 CPUs) serves the whole module.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import re
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
import torch
from conftest import wait_until

import aioloader
from aioloader import DataLoader, Dataset, IterableDataset, get_worker_info
from aioloader._errors import LoaderTimeoutError, WorkerDiedError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "ray_workers.py")

# torch 2.4.0 unpickles a tensor's storage (Ray does, for every batch) with a bare
# torch.load(), which warns about its weights_only default; later torch passes it explicitly.
pytestmark = pytest.mark.filterwarnings(
    "ignore:You are using `torch.load` with `weights_only=False`:FutureWarning")


# --------------------------------------------------------------------------- datasets


class RandomAugmented(Dataset):
    """Each sample draws from random, numpy and torch and reports its worker info."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        ours = get_worker_info()
        theirs = torch.utils.data.get_worker_info()
        assert ours is not None and theirs is not None
        return torch.tensor([
            i, ours.id, ours.num_workers, ours.seed % 2**31, theirs.id, theirs.seed % 2**31,
            random.randrange(10**6), int(np.random.randint(10**6)),
            int(torch.randint(10**6, ())),
        ])


class Sharded(IterableDataset):
    """An iterable dataset split between the workers by id."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = get_worker_info()
        assert info is not None
        return iter(range(info.id, self.n, info.num_workers))


class Counting(Dataset):
    def __init__(self, n: int, stall_at: int | None = None) -> None:
        self.n = n
        self.stall_at = stall_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.stall_at:
            time.sleep(60)  # stuck user code: the actor is killed at close
        return i


def _init_seed(worker_id: int) -> None:
    # worker_init_fn runs after seeding, in the actor: its draws follow the worker seed.
    random.random()


# --------------------------------------------------------------------------- argument checks


def test_unknown_worker_method_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"worker_method should be one of 'multiprocessing', 'thread', 'ray'"):
        DataLoader(Counting(4), num_workers=1, worker_method="procs")


def test_ray_options_without_ray_method_is_an_error() -> None:
    with pytest.raises(ValueError, match="only with worker_method='ray'"):
        DataLoader(Counting(4), num_workers=1, ray_options={"num_cpus": 1})


def test_missing_ray_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if absent
    with pytest.raises(ModuleNotFoundError, match=r"pip install aioloader\[ray\]"):
        DataLoader(Counting(4), num_workers=1, worker_method="ray")


# --------------------------------------------------------------------------- with Ray


@pytest.fixture(scope="module")
def ray() -> Any:
    ray = pytest.importorskip("ray")
    # The actors unpickle this module's datasets: send them by value (this test module is
    # not importable in Ray's worker processes); aioloader itself comes from PYTHONPATH.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    # Ray's driver starts its own threads and sockets on first use: not the tests'.
    list(DataLoader(Counting(2), num_workers=1, worker_method="ray", timeout=60))
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def _no_actor_left(request: pytest.FixtureRequest) -> Any:
    """After each test that used Ray, none of the loader's actors is alive."""
    yield
    if "ray" in request.fixturenames:
        ray = request.getfixturevalue("ray")
        _assert_actors_dead(ray, [n for n in ray.util.list_named_actors()
                                  if n.startswith("aioloader-")])


def _alive(ray: Any, name: str) -> bool:
    try:
        ray.get_actor(name)  # a dead actor's name is released by Ray's control store
    except ValueError:
        return False
    return True


def _actor_names(it: Any) -> list[str]:
    return list(it._core.lease.pool.actor_names)


def _assert_actors_dead(ray: Any, names: list[str]) -> None:
    """Each actor is dead. ray.kill() is asynchronous: Ray's state is checked with a
    bounded wait (conftest.wait_until)."""
    assert wait_until(lambda: not any(_alive(ray, n) for n in names), 30), names




def test_same_batches_and_worker_info_as_process_workers(ray: Any) -> None:
    """Same seeds, same worker ids, same batches, two epochs of persistent workers."""
    def epochs(method: str) -> list[list[torch.Tensor]]:
        # forkserver, not fork: forking a process whose Ray client threads (gRPC) run can
        # leave the child stuck in their fork handlers.
        context = "forkserver" if method == "multiprocessing" else None
        loader = DataLoader(RandomAugmented(), batch_size=3, shuffle=True, num_workers=2,
                            worker_init_fn=_init_seed, persistent_workers=True,
                            generator=torch.Generator().manual_seed(7), worker_method=method,
                            multiprocessing_context=context, timeout=60)
        try:
            return [list(loader), list(loader)]
        finally:
            loader.close()

    ray_batches, local = epochs("ray"), epochs("multiprocessing")
    for got, want in zip(ray_batches, local):
        assert len(got) == len(want) == 8
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    first = torch.cat(ray_batches[0])
    assert sorted(first[:, 0].tolist()) == list(range(24))  # exactly once
    assert set(first[:, 1].tolist()) == {0, 1}
    assert (first[:, 2] == 2).all()
    assert torch.equal(first[:, 1], first[:, 4]) and torch.equal(first[:, 3], first[:, 5])


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_iterable_sharding_async_for(ray: Any, backend: str) -> None:
    """Each actor yields its own shard; together every element once, in torch's order."""
    async def main() -> list[list[int]]:
        loader = DataLoader(Sharded(11), batch_size=2, num_workers=2, worker_method="ray",
                            timeout=60)
        async with aiter(loader) as it:
            return [b.tolist() async for b in it]

    got = pytest.importorskip("trio").run(main) if backend == "trio" else asyncio.run(main())
    # torch's order: round robin over the workers, a worker whose shard ended drops out.
    assert got == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9]]


def test_datapipe_shards_and_reseeds_as_torch_workers(ray: Any) -> None:
    """Regression test for issue 18: an IterDataPipe's sharding_filter splits over the actors and
    each epoch's shared seed reaches them (persistent: through the reset), as torch's workers."""
    from torch.utils.data import DataLoader as TorchDataLoader
    from torch.utils.data.datapipes.iter import IterableWrapper

    def epochs(loader_cls: Any, **kwargs: Any) -> list[list[list[int]]]:
        torch.manual_seed(11)
        pipe = IterableWrapper(range(17)).shuffle().sharding_filter()
        loader = loader_cls(pipe, batch_size=3, shuffle=True, num_workers=2,
                            persistent_workers=True, timeout=60, **kwargs)
        try:
            return [[b.tolist() for b in loader] for _ in range(2)]
        finally:
            if hasattr(loader, "close"):
                loader.close()

    ours = epochs(DataLoader, worker_method="ray")
    # forkserver: forking next to Ray's client threads can hang (see above).
    assert ours == epochs(TorchDataLoader, multiprocessing_context="forkserver")
    assert sorted(x for b in ours[1] for x in b) == list(range(17))


@pytest.mark.gc_off
def test_actor_killed_mid_epoch_is_named(ray: Any) -> None:
    loader = DataLoader(Counting(200), batch_size=2, num_workers=2, worker_method="ray",
                        timeout=60)
    it = iter(loader)
    seen = [next(it).tolist(), next(it).tolist()]  # both actors are up: they answered
    name = _actor_names(it)[1]
    names = _actor_names(it)
    ray.kill(ray.get_actor(name))
    with pytest.raises(WorkerDiedError) as info:
        for batch in it:
            seen.append(batch.tolist())
    assert info.value.worker_id == 1
    assert name in str(info.value) and "exited unexpectedly" in str(info.value)
    # Regression test for issue 40: the pid and host the actor reported are named.
    assert info.value.pid is not None and info.value.pid != os.getpid()
    assert f"(pid {info.value.pid}) on {os.uname().nodename} (" in str(info.value)
    assert ", Ray node " in str(info.value)
    flat = [x for b in seen for x in b]
    assert flat == list(range(len(flat)))  # in order, nothing twice, up to the death
    _assert_actors_dead(ray, names)


@pytest.mark.gc_off
def test_break_then_gc_kills_the_actors(ray: Any) -> None:
    loader = DataLoader(Counting(100), batch_size=2, num_workers=1, worker_method="ray",
                        timeout=60)
    it = iter(loader)
    for _ in it:
        break
    names = _actor_names(it)
    del it
    _assert_actors_dead(ray, names)


@pytest.mark.gc_off
def test_close_and_error_exit_kill_the_actors(ray: Any) -> None:
    class Boom(Exception):
        pass

    async def main() -> None:
        loader = DataLoader(Counting(100), batch_size=2, num_workers=1, worker_method="ray",
                            timeout=60)
        it = aiter(loader)
        assert (await anext(it)).tolist() == [0, 1]
        names = _actor_names(it)
        await it.aclose()
        _assert_actors_dead(ray, names)

        with pytest.raises(Boom):
            async with aiter(loader) as it:
                async for _ in it:
                    names = _actor_names(it)
                    raise Boom
        _assert_actors_dead(ray, names)

    asyncio.run(main())


@pytest.mark.gc_off
def test_timeout_then_close_kills_a_stuck_actor(ray: Any) -> None:
    loader = DataLoader(Counting(8, stall_at=0), batch_size=2, num_workers=1, timeout=3,
                        worker_method="ray")
    it = iter(loader)
    with pytest.raises(LoaderTimeoutError, match="timed out after 3"):
        next(it)
    names = _actor_names(it)
    it._shutdown_workers()
    _assert_actors_dead(ray, names)


@pytest.mark.gc_off
def test_an_actor_ray_cannot_place_is_a_named_error(ray: Any) -> None:
    """Regression test for issue 40: no node has the resource; no timeout set, yet the
    epoch fails after placement_timeout, saying what the actor asked for."""
    loader = DataLoader(Counting(4), num_workers=1, worker_method="ray",
                        ray_options={"resources": {"nowhere": 1}, "placement_timeout": 1})
    it = iter(loader)
    with pytest.raises(WorkerDiedError, match=r"worker 0 could not be placed") as error:
        next(it)
    assert "{'CPU': 1, 'nowhere': 1}" in str(error.value)
    assert "ray_options['placement_timeout']" in str(error.value)
    _assert_actors_dead(ray, _actor_names(it))


def test_reserved_and_bad_ray_options(ray: Any) -> None:
    with pytest.raises(ValueError, match="max_restarts"):
        DataLoader(Counting(4), num_workers=1, worker_method="ray",
                   ray_options={"max_restarts": 3})
    with pytest.raises(ValueError):  # Ray's own validation, at construction
        DataLoader(Counting(4), num_workers=1, worker_method="ray",
                   ray_options={"no_such_option": 1})
    for bad, error in ((0, ValueError), (float("inf"), ValueError), ("60", TypeError)):
        with pytest.raises(error, match=r"ray_options\['placement_timeout'\] should be"):
            DataLoader(Counting(4), num_workers=1, worker_method="ray",
                       ray_options={"placement_timeout": bad})


def test_example_goes_from_local_workers_to_ray_by_one_argument(
        ray: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """examples/ray_workers.py: same checksum with local processes and with Ray actors."""
    args = ["--n", "64", "--work", "2", "--batch-size", "8", "--epochs", "1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    local = subprocess.run([sys.executable, "-W", "error", EXAMPLE, *args], env=env,
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert "local processes: num_workers=2" in local
    # With Ray: in this process, which already runs Ray ("local" then means "use it").
    spec = importlib.util.spec_from_file_location("ray_workers_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        ray.cloudpickle.register_pickle_by_value(module)
        assert module.main([*args, "--ray-address", "local"]) == 0  # its own comparison
    finally:
        del sys.modules[spec.name]
    on_ray = capsys.readouterr().out
    assert "Ray (local): num_workers=2" in on_ray
    assert "and Ray actors" in on_ray  # the example compared the two epochs itself

    def checksum(out: str) -> str:
        return re.search(r"checksum of epoch 0: ([0-9.]+)", out).group(1)  # type: ignore[union-attr]

    assert checksum(on_ray) == checksum(local)


@pytest.mark.gc_off
def test_killed_actor_is_respawned_and_every_index_arrives_once(ray: Any) -> None:
    """respawn_workers=True: the killed actor's unanswered batches go to its replacement."""
    loader = DataLoader(Counting(60), batch_size=2, num_workers=2, worker_method="ray",
                        respawn_workers=True, timeout=60)
    it = iter(loader)
    seen = [next(it).tolist()]
    first_names = _actor_names(it)
    ray.kill(ray.get_actor(first_names[1]))
    names: list[str] = []

    def drain() -> None:
        for batch in it:
            seen.append(batch.tolist())
            names[:] = _actor_names(it)

    with pytest.warns(aioloader.SkippedSamplesWarning, match="respawn"):
        drain()
    assert [x for b in seen for x in b] == list(range(60))  # in order, exactly once
    assert loader.failures is not None and loader.failures.respawns == 1
    assert first_names[1] in loader.failures.deaths[0]
    assert names[0] == first_names[0] and names[1] != first_names[1]  # a new actor
    _assert_actors_dead(ray, first_names + names)


def test_resume_on_ray_actors_equals_an_uninterrupted_run(ray: Any) -> None:
    """state_dict after k batches, loaded into a new loader: the rest of the epoch matches."""
    def make() -> DataLoader:
        return DataLoader(Counting(30), batch_size=4, shuffle=True, num_workers=2,
                          worker_method="ray", generator=torch.Generator().manual_seed(3),
                          timeout=60)

    full = [b.tolist() for b in make()]
    first = make()
    it = iter(first)
    head = [next(it).tolist() for _ in range(3)]
    state = first.state_dict()
    it.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert head + [b.tolist() for b in resumed] == full
