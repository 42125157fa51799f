"""Real clients: Lightning, Fabric, accelerate, HF datasets, tqdm (skipped where not installed).

Install them with ``pip install "torch==2.13.0" -e ".[integrations]"``.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port

import aioloader
from aioloader import DataLoader, TensorDataset

HERE = Path(__file__).resolve().parent

# Lightning's advice for small CPU runs; not what these tests are about.
LIGHTNING_ADVICE = [
    "ignore:.*does not have many workers.*",
    "ignore:.*`max_epochs` was not set.*",
    "ignore:.*The number of training batches.*",
    "ignore:.*GPU available but not used.*",
    "ignore::DeprecationWarning",
    "ignore:.*isinstance\\(treespec, LeafSpec\\)` is deprecated.*:FutureWarning",
]


def _indexed(n: int = 24) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g),
                         torch.arange(n))


def test_is_a_torch_dataloader_and_reinstantiable_from_attributes() -> None:
    loader = DataLoader(_indexed(), batch_size=4, num_workers=2, fetch_concurrency=8,
                        fetch_threads=2, device_prefetch=3)
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert isinstance(loader.sampler, torch.utils.data.SequentialSampler)
    assert isinstance(loader.batch_sampler, torch.utils.data.BatchSampler)
    # What Lightning does without saved init args: public attributes back into __init__.
    attrs = {k: v for k, v in vars(loader).items() if not k.startswith("_")}
    attrs["multiprocessing_context"] = loader.multiprocessing_context
    attrs.update(sampler=None, batch_sampler=None, shuffle=False)
    again = type(loader)(**attrs)
    assert (again.fetch_concurrency, again.fetch_threads, again.device_prefetch) == (8, 2, 3)
    assert [b[2].tolist() for b in again] == [b[2].tolist() for b in loader]
    with pytest.raises(ValueError, match="batch_size attribute should not be set"):
        loader.batch_size = 3


def _recreated(update, loader, sampler) -> dict:
    """What a framework's re-created loader looks like: the attributes it and ported code read."""
    again = update(loader, sampler)
    return {"type": type(again), "batch_size": again.batch_size, "drop_last": again.drop_last,
            "sampler": again.sampler, "batch_sampler": type(again.batch_sampler),
            "len": len(again), "len_sampler": len(again.sampler),
            "batches": [b[2].tolist() for b in again]}


@pytest.mark.parametrize("module", ["lightning.fabric.utilities.data",
                                    "lightning.pytorch.utilities.data"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["attributes", "captured_init_args"])
@pytest.mark.filterwarnings(*LIGHTNING_ADVICE)
def test_lightning_sampler_injection_recreates_like_torch(module: str, wrapped: bool) -> None:
    """Regression test for issue 18: Lightning's re-created loader keeps batch_size and its sampler."""
    pytest.importorskip("lightning")
    import importlib

    from lightning.fabric.utilities.data import _replace_dunder_methods

    update = importlib.import_module(module)._update_dataloader
    ds = _indexed(96)
    kwargs = {"batch_size": 8, "shuffle": True}
    extras = {"fetch_concurrency": 8, "fetch_threads": 2, "collect_stats": False}
    if wrapped:  # what Fabric.launch(fn) and the Trainer's *_dataloader hooks do
        with _replace_dunder_methods(torch.utils.data.DataLoader, "dataset"), \
                _replace_dunder_methods(torch.utils.data.BatchSampler):
            ours = DataLoader(ds, **kwargs, **extras)
            theirs = torch.utils.data.DataLoader(ds, **kwargs)
    else:
        ours = DataLoader(ds, **kwargs, **extras)
        theirs = torch.utils.data.DataLoader(ds, **kwargs)
    assert type(ours.batch_sampler) is torch.utils.data.BatchSampler  # what Lightning checks
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=1, seed=5)
    got, want = _recreated(update, ours, sampler), _recreated(update, theirs, sampler)
    assert got.pop("type") is DataLoader and want.pop("type") is torch.utils.data.DataLoader
    assert got == want
    assert (want["batch_size"], want["len"], want["len_sampler"]) == (8, 6, 48)
    assert want["sampler"] is sampler
    again = update(ours, sampler)
    assert {k: getattr(again, k) for k in extras} == extras  # aioloader's own arguments survive


def _lightning_model(L):
    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
            self.seen: list[int] = []

        def training_step(self, batch, batch_idx):
            x, y, idx = batch
            self.seen.extend(idx.tolist())
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Model()


def _lightning_fit(L, loader_cls):
    L.seed_everything(3)
    model = _lightning_model(L)
    loader = loader_cls(_indexed(), batch_size=4, shuffle=True, num_workers=2,
                        persistent_workers=True)
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, enable_progress_bar=False,
                        logger=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(model, loader)
    left = multiprocessing.active_children()
    return model.seen, model.layer.weight.detach().clone(), left


@pytest.mark.filterwarnings(*LIGHTNING_ADVICE)
def test_lightning_fit_matches_torch_and_stops_persistent_workers() -> None:
    L = pytest.importorskip("lightning")
    seen_t, weight_t, left_t = _lightning_fit(L, torch.utils.data.DataLoader)
    seen_a, weight_a, left_a = _lightning_fit(L, DataLoader)
    assert left_t == []
    assert left_a == []  # Lightning shut the persistent workers down at the end of fit()
    assert seen_a == seen_t  # same seed_everything, same sample order (no extra iter())
    assert sorted(seen_a[:24]) == list(range(24))
    torch.testing.assert_close(weight_a, weight_t)


def _installed(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def framework_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One 2-rank gloo job (tests/_framework_ddp_script.py) with every installed framework.

    With Lightning, only rank 0 is started here and the first ``Trainer.fit`` starts rank 1
    (Lightning's own launcher); without it both ranks are started here, as torchrun would.
    Returns each rank's cases: ``{"path/loader/sampler/data": {"epochs", "sizes",
    "describe", ...}}``.
    """
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    sections = [name for name, module in [("trainer", "lightning"), ("fabric", "lightning"),
                                          ("accelerate", "accelerate"),
                                          ("datasets", "datasets")] if _installed(module)]
    if not {"trainer", "accelerate"} & set(sections):
        pytest.skip("needs lightning or accelerate")
    out = tmp_path_factory.mktemp("frameworks")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # The aioloader under test, not whatever copy is installed.
    root = str(Path(aioloader.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    ranks = [0] if "trainer" in sections else [0, 1]
    if len(ranks) == 2:
        env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [sys.executable, str(HERE / "_framework_ddp_script.py"), str(out), ",".join(sections)]
    procs = []
    try:
        for rank in ranks:
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank)) if len(ranks) == 2 else env
            procs.append(subprocess.Popen(cmd, env=rank_env, start_new_session=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            try:  # a rank Lightning launched is in the session of the rank that launched it
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    for p, output in zip(procs, outputs):
        assert p.returncode == 0, output.decode(errors="replace")[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _reference(case: str) -> str:
    """The torch run an aioloader (or mixed) case must equal: same path, torch's classes."""
    path, _, sampler, data = case.split("/")
    return f"{path}/torch/{'default' if sampler == 'default' else 'torch_ds'}/{data}"


def _check_like_torch(runs: list[dict], paths: tuple[str, ...], data: str = "") -> list[str]:
    """Every case under ``paths`` equals its torch reference on both ranks; returns the cases.

    Per rank and epoch: the sample indices, the batch sizes; and what the framework's
    loader looks like: batch_size, drop_last, sampler type, len(loader), len(sampler),
    the sampler's epoch, set_epoch. The sampler's class is torch's injected one, or the
    explicit sampler passed (aioloader's where aioloader's was passed).
    """
    cases = [c for c in runs[0]
             if c.split("/")[0] in paths and c.split("/")[3].startswith(data)]
    assert cases, f"no cases ran for {paths}"
    for rank in runs:
        for case in cases:
            got, want = rank[case], rank[_reference(case)]
            assert "error" not in got, f"{case}: {got.get('error')}"
            assert "error" not in want, f"{_reference(case)}: {want.get('error')}"
            assert got["epochs"] == want["epochs"], case
            assert got["sizes"] == want["sizes"], case
            described, expected = dict(got["describe"]), dict(want["describe"])
            if case.split("/")[2] == "aioloader_ds" and described["sampler"] != expected["sampler"]:
                assert described.pop("sampler") == "aioloader.distributed.DistributedSampler"
                expected.pop("sampler")
            assert described == expected, case
            if "weight" in want:
                assert got["weight"] == pytest.approx(want["weight"]), case
    return cases


def _check_full_shards(runs: list[dict], case: str) -> None:
    """Each rank trains on its own half of the 96 samples, every epoch, reshuffled by epoch."""
    shards = [rank[case]["epochs"] for rank in runs]
    for epoch in range(2):
        assert len(shards[0][epoch]) == len(shards[1][epoch]) == 48, case
        assert sorted(shards[0][epoch] + shards[1][epoch]) == list(range(96)), case
    assert shards[0][0] != shards[0][1], case  # set_epoch reached the sampler
    for rank in runs:
        d = rank[case]["describe"]
        assert (d["batch_size"], d["len_loader"], d["len_sampler"]) == (8, 6, 48), case
        assert d["sampler_is_torch_ds"] and d["set_epoch"] and d["sampler_epoch"] == 1, case


@pytest.mark.slow
def test_lightning_trainer_ddp_two_cpu_processes_like_torch(framework_runs: list[dict]) -> None:
    """Regression test for issue 18: Trainer(ddp, devices=2) gives aioloader torch's shards."""
    pytest.importorskip("lightning")
    for case in _check_like_torch(framework_runs, ("trainer", "trainer_hook")):
        _check_full_shards(framework_runs, case)


@pytest.mark.slow
def test_fabric_ddp_two_cpu_processes_like_torch(framework_runs: list[dict]) -> None:
    """Regression test for issue 18: Fabric setup_dataloaders on 2 ranks gives torch's shards."""
    pytest.importorskip("lightning")
    for case in _check_like_torch(framework_runs, ("fabric", "fabric_launch")):
        _check_full_shards(framework_runs, case)


@pytest.mark.slow
def test_accelerate_prepare_two_processes_like_torch(framework_runs: list[dict]) -> None:
    """Regression test for issue 18: accelerate prepare on 2 processes shards as for torch."""
    pytest.importorskip("accelerate")
    cases = _check_like_torch(framework_runs, ("accelerate",))
    for case in cases:
        if "/default/" in case:  # an explicit DistributedSampler is sharded again, as torch's
            shards = [rank[case]["epochs"][0] for rank in framework_runs]
            assert sorted(shards[0] + shards[1]) == list(range(96)), case


@pytest.mark.slow
def test_hf_datasets_under_frameworks_like_torch(framework_runs: list[dict]) -> None:
    """Regression test for issue 18: HF datasets (torch format) under each framework as torch."""
    pytest.importorskip("datasets")
    paths = ("trainer", "fabric", "accelerate")
    hf = _check_like_torch(framework_runs, paths, data="hf")
    assert {case.split("/")[1] for case in hf} == {"torch", "aioloader"}


@pytest.mark.filterwarnings(*LIGHTNING_ADVICE)
def test_fabric_setup_dataloaders() -> None:
    L = pytest.importorskip("lightning")
    fabric = L.Fabric(accelerator="cpu", devices=1)
    loader = DataLoader(_indexed(), batch_size=5, num_workers=2)
    wrapped = fabric.setup_dataloaders(loader)
    assert [b[2].tolist() for b in wrapped] == [b[2].tolist() for b in loader]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_accelerate_prepare_and_shards() -> None:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.data_loader import prepare_data_loader

    loader = DataLoader(_indexed(), batch_size=4, num_workers=2)
    prepared = accelerate.Accelerator(cpu=True).prepare(loader)
    assert prepared is not loader  # recognised and wrapped, not passed through
    assert [b[2].tolist() for b in prepared] == [b[2].tolist() for b in loader]
    shards = [
        [i for b in prepare_data_loader(loader, num_processes=2, process_index=r,
                                        put_on_device=False) for i in b[2].tolist()]
        for r in (0, 1)
    ]
    assert len(shards[0]) == len(shards[1]) == 12
    assert sorted(shards[0] + shards[1]) == list(range(24))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_hf_datasets_map_style_and_iterable_with_workers() -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"x": list(range(20))}).with_format("torch")
    ours = [b["x"].tolist() for b in DataLoader(ds, batch_size=4, num_workers=2)]
    theirs = [b["x"].tolist() for b in torch.utils.data.DataLoader(ds, batch_size=4,
                                                                   num_workers=2)]
    assert ours == theirs == [list(range(i, i + 4)) for i in range(0, 20, 4)]

    it_ds = ds.to_iterable_dataset(num_shards=2)
    ours_it = [b["x"].tolist() for b in DataLoader(it_ds, batch_size=4, num_workers=2)]
    theirs_it = [b["x"].tolist() for b in torch.utils.data.DataLoader(it_ds, batch_size=4,
                                                                      num_workers=2)]
    assert ours_it == theirs_it  # each worker reads its own shard, as with torch
    assert sorted(i for b in ours_it for i in b) == list(range(20))


# tqdm starts its own monitor thread once per process and keeps it (not ours to join).
@pytest.mark.keeps_threads("tqdm_monitor")
def test_tqdm_wraps_the_loader() -> None:
    tqdm = pytest.importorskip("tqdm")
    loader = DataLoader(_indexed(), batch_size=5, num_workers=2)
    out = io.StringIO()
    bar = tqdm.tqdm(loader, file=out)
    assert bar.total == len(loader) == 5
    assert sum(len(b[2]) for b in bar) == 24
    assert "5/5" in out.getvalue()
