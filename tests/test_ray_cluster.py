"""worker_method="ray" across Ray nodes (issue 40): actors placed by resources, a lost
node under each failure policy, and Ray never started again behind the program's back.

A cluster simulated on this machine with ``ray.cluster_utils.Cluster``, small enough for
CI's 2 cores: the driver's head node (1 CPU) and a data node (2 CPUs and the custom
resource ``data``), shared by the module. A test that loses a node adds its own (2 CPUs
and a resource of its own) and removes it. The last test shuts Ray down (the module's
fixture then only removes the nodes). Skipped where Ray is not installed.

They run in a pytest process of their own, which the one test of the outer run starts: a
driver that joined a multi-node cluster keeps Ray's threads and sockets for its life, and a
worker forked from it afterwards can crash (a later test file's fork workers died of
SIGSEGV when these ran in the suite's own process).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import anyio
import numpy as np
import pytest
import torch
from conftest import wait_until
from test_ray_workers import _actor_names, _assert_actors_dead

from aioloader import DataLoader, Dataset, SkippedSamplesWarning, get_worker_info
from aioloader._errors import WorkerDiedError

ray = pytest.importorskip("ray")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = os.uname().nodename
#: Set in the process the outer run starts for these tests.
INNER_ENV = "AIOLOADER_RAY_CLUSTER_TESTS"
INNER = os.environ.get(INNER_ENV) == "1"

# As in test_ray_workers.py: torch 2.4 rebuilds a returned tensor's storage with a bare
# torch.load(), which warns about its weights_only default.
pytestmark = pytest.mark.filterwarnings(
    "ignore:You are using `torch.load` with `weights_only=False`:FutureWarning")


# --------------------------------------------------------------------------- datasets


class Draws(Dataset):
    """Each sample draws from random, numpy and torch (worker seeds show). Given a Ray
    node id, it checks that it runs there, in a Ray actor on that node."""

    def __init__(self, n: int, node: str | None = None) -> None:
        self.n = n
        self.node = node

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.node is not None:
            import ray as ray_here

            here = ray_here.get_runtime_context().get_node_id()
            if here != self.node:
                raise RuntimeError(f"sample {i} was fetched on Ray node {here}, not on "
                                   f"{self.node}")
        info = get_worker_info()
        return torch.tensor([i, -1 if info is None else info.id, random.randrange(10**6),
                             int(np.random.randint(10**6)), int(torch.randint(10**6, ()))])


class Where(Dataset):
    """Sample ``i`` is ``(i, pid, Ray node id)`` of the actor that fetched it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int, str]:
        import ray as ray_here

        return i, os.getpid(), ray_here.get_runtime_context().get_node_id()


def _init_draw(worker_id: int) -> None:
    random.random()  # worker_init_fn runs after seeding, in the actor


# --------------------------------------------------------------------------- the cluster


class Nodes(NamedTuple):
    cluster: Any
    data: str  # the data node's id


@pytest.mark.skipif(INNER, reason="the outer run's test")
@pytest.mark.slow  # a simulated cluster of 3 Ray nodes: minutes; Ray's own paths are covered
@pytest.mark.timeout(1500)  # on every Python by test_ray_workers.py
def test_the_cluster_tests_pass_in_a_process_of_their_own() -> None:
    env = dict(os.environ, **{INNER_ENV: "1"})
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-k", "not process_of_their_own", os.path.abspath(__file__)],
                         cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1440)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    if not INNER:
        pytest.skip("runs in the cluster tests' own process (the test above)")
    from ray.cluster_utils import Cluster

    # The actors unpickle this module's datasets: sent by value; aioloader from PYTHONPATH.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        data = cluster.add_node(num_cpus=2, resources={"data": 2})
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path}})
        cluster.wait_for_nodes()
        # The driver's first call to an actor on another node opens what it keeps for the
        # process (threads, sockets): not the tests'.
        list(DataLoader(Draws(2, data.node_id), num_workers=1, worker_method="ray",
                        ray_options={"resources": {"data": 1}}, timeout=120))
        yield Nodes(cluster, data.node_id)
    finally:
        ray.shutdown()
        cluster.shutdown()


def _add_node(nodes: Nodes, resource: str) -> Any:
    """A node with 2 CPUs and 2 of ``resource``, registered with the cluster."""
    node = nodes.cluster.add_node(num_cpus=2, resources={resource: 2})
    nodes.cluster.wait_for_nodes()
    return node


#: Ray's driver keeps a socket, for the process's life, for each lost node where an object
#: it owns (the loader's dataset, put once) was in use: Ray's own, not the loader's (plain
#: ray.put and actors taking the object do the same). Tests that lose a node allow it.
keeps_lost_nodes_socket = pytest.mark.keeps_fds("socket:")


def _flat(batches: list[list[Any]]) -> list[int]:
    return [i for batch in batches for i in batch[0].tolist()]


# --------------------------------------------------------------------------- placement


def test_actors_on_the_data_node_give_torchs_batches(nodes: Nodes) -> None:
    """Actors asked for the data node's resource run there (the dataset checks it), and
    a persistent loader's epochs, by ``for`` then ``async for``, are torch's."""
    kwargs: dict[str, Any] = {"batch_size": 3, "shuffle": True, "num_workers": 2,
                              "worker_init_fn": _init_draw, "persistent_workers": True}
    # forkserver: forking next to Ray's client threads (gRPC) can hang.
    reference = torch.utils.data.DataLoader(
        Draws(24), multiprocessing_context="forkserver",
        generator=torch.Generator().manual_seed(7), **kwargs)
    want = [list(reference), list(reference)]
    del reference  # its workers stop
    loader = DataLoader(Draws(24, nodes.data), worker_method="ray",
                        ray_options={"resources": {"data": 1}}, timeout=120,
                        generator=torch.Generator().manual_seed(7), **kwargs)

    async def async_epoch() -> list[torch.Tensor]:
        async with aiter(loader) as it:
            return [batch async for batch in it]

    try:
        ours = [list(loader), asyncio.run(async_epoch())]
    finally:
        loader.close()
    assert [len(e) for e in ours] == [len(e) for e in want] == [8, 8]
    for got, expected in zip(ours, want):
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert sorted(torch.cat(ours[0])[:, 0].tolist()) == list(range(24))


# --------------------------------------------------------------------------- node loss


@keeps_lost_nodes_socket
@pytest.mark.gc_off
def test_node_lost_without_a_policy_names_the_actor_pid_and_host(nodes: Nodes) -> None:
    """The node of the actors is removed: WorkerDiedError at once (no timeout set but
    a guard), naming the actor, its pid, host and node, and Ray's reason."""
    node = _add_node(nodes, "lost_a")
    loader = DataLoader(Where(200), batch_size=2, num_workers=2, worker_method="ray",
                        ray_options={"resources": {"lost_a": 1}}, timeout=120)
    it = iter(loader)
    seen = [next(it), next(it)]  # one batch from each actor: both are up
    names = _actor_names(it)
    assert [n for batch in seen for n in batch[2]] == [node.node_id] * 4
    nodes.cluster.remove_node(node)
    with pytest.raises(WorkerDiedError) as died:
        for batch in it:
            seen.append(batch)
    message = str(died.value)
    pid = died.value.pid
    assert pid is not None and f"pid {pid}" in message  # the pid the actor reported ...
    assert pid == seen[died.value.worker_id][1][0]  # ... that fetched its batches
    assert names[died.value.worker_id] in message
    assert f"on {HOST} ({node.node_ip_address}, Ray node {node.node_id})" in message
    assert "its node has died" in message  # Ray's reason
    assert _flat(seen) == list(range(len(_flat(seen))))  # in order, none twice, up to it
    it._shutdown_workers()
    _assert_actors_dead(ray, names)


@keeps_lost_nodes_socket
@pytest.mark.gc_off
def test_node_lost_with_respawn_and_a_spare_node_delivers_every_index_once(
        nodes: Nodes) -> None:
    """respawn_workers=True, another node with the resource: the replacements run there
    and every index arrives once, in order."""
    node = _add_node(nodes, "lost_b")
    loader = DataLoader(Where(60), batch_size=2, num_workers=2, worker_method="ray",
                        ray_options={"resources": {"lost_b": 1}}, respawn_workers=True,
                        timeout=120)
    it = iter(loader)
    seen = [next(it)]
    first = _actor_names(it)
    spare = _add_node(nodes, "lost_b")
    nodes.cluster.remove_node(node)
    names: list[str] = []

    def drain() -> None:
        for batch in it:
            seen.append(batch)
            names[:] = _actor_names(it)

    with pytest.warns(SkippedSamplesWarning, match="respawn"):
        drain()
    assert _flat(seen) == list(range(60))  # in order, exactly once
    assert loader.failures is not None and loader.failures.respawns == 2
    on = [n for batch in seen for n in batch[2]]
    assert set(on) == {node.node_id, spare.node_id} and on[-1] == spare.node_id
    assert all(name.endswith("-r1") for name in names)
    nodes.cluster.remove_node(spare)
    _assert_actors_dead(ray, first + names)


@keeps_lost_nodes_socket
@pytest.mark.gc_off
def test_node_lost_with_respawn_and_no_node_left_is_a_bounded_error(nodes: Nodes) -> None:
    """No node offers the resource any more: after placement_timeout the epoch fails
    with a WorkerDiedError that says so and names what the replacement asked for; the
    loader has no timeout (the test's own guard would turn a hang into a failure)."""
    node = _add_node(nodes, "lost_c")
    loader = DataLoader(Where(200), batch_size=2, num_workers=2, worker_method="ray",
                        ray_options={"resources": {"lost_c": 1}, "placement_timeout": 2},
                        respawn_workers=True)
    seen: list[list[Any]] = []
    names: list[str] = []

    async def main() -> None:
        with anyio.fail_after(120):  # the test's guard, not the loader's timeout
            async with aiter(loader) as it:
                async for batch in it:
                    seen.append(batch)
                    names[:] = _actor_names(it)
                    if len(seen) == 1:
                        nodes.cluster.remove_node(node)  # blocks the loop: fine here

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedSamplesWarning)  # respawns were tried
        with pytest.raises(WorkerDiedError, match="could not be placed") as error:
            asyncio.run(main())
    message = str(error.value)
    assert "the replacement for DataLoader worker" in message
    assert "within 2 s (ray_options['placement_timeout'])" in message
    assert "{'CPU': 1, 'lost_c': 1}" in message and "PENDING_CREATION" in message
    assert _flat(seen) == list(range(len(_flat(seen))))
    _assert_actors_dead(ray, names)


# --------------------------------------------------------------------------- Ray shut down
# Last in this module: Ray stays down after it (the fixture then removes the nodes).


@keeps_lost_nodes_socket
@pytest.mark.gc_off
@pytest.mark.timeout(480)
def test_ray_shutdown_while_replacements_wait_keeps_ray_down(nodes: Nodes) -> None:
    """Regression test for issue 40: ray.shutdown() while a consumer waits for batches
    that replacement actors (waiting for a node) owe. The loader neither respawns nor
    connects again: the consumer gets a clear error, so do the loader's next epoch and a
    persistent loader's, and Ray stays down."""
    persistent = DataLoader(Draws(4, nodes.data), batch_size=2, num_workers=1,
                            worker_method="ray", ray_options={"resources": {"data": 1}},
                            persistent_workers=True, timeout=120)
    assert len(list(persistent)) == 2
    node = _add_node(nodes, "lost_d")
    loader = DataLoader(Where(200), batch_size=2, num_workers=2, worker_method="ray",
                        ray_options={"resources": {"lost_d": 1}, "placement_timeout": 120},
                        respawn_workers=True, timeout=120)  # the replacements wait
    it = iter(loader)
    next(it)
    errors: list[BaseException] = []

    def consume() -> None:  # waits for the dead actors' batches
        try:
            for _ in it:
                pass
        except BaseException as exc:
            errors.append(exc)

    consumer = threading.Thread(target=consume, name="test-consumer")
    nodes.cluster.remove_node(node)
    consumer.start()
    replaced = False
    try:
        # The actor that owes the consumer's next batch dies and its replacement waits for a
        # node. (The other one is replaced only once the loader calls it again: with its
        # batches delivered and the consumer waiting in order for the first actor's, it may
        # not be called before the shutdown.) Ray notices the lost node by its health
        # checks, later on a loaded machine: a generous bound, and a replacement made before
        # Ray noticed may have been placed on the dying node and replaced again (-r2). Ray
        # is shut down whatever happened: the consumer never outlives the test.
        replaced = wait_until(
            lambda: any(re.search(r"-r[0-9]+$", n) for n in _actor_names(it)), 240)
    finally:
        ray.shutdown()
        consumer.join(60)
    assert replaced, f"no lost actor was replaced within 240 s: {_actor_names(it)}"
    assert not consumer.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], WorkerDiedError), errors
    assert "ray.shutdown()" in str(errors[0])
    assert not ray.is_initialized()
    with pytest.raises(RuntimeError, match=r"ray\.shutdown\(\)"):
        list(loader)  # a new epoch of a loader that started actors: no ray.init()
    with pytest.raises(WorkerDiedError, match=r"ray\.shutdown\(\)"):
        list(persistent)  # its kept actor went with Ray
    assert not ray.is_initialized()
