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


def _run_ddp(which: str, out: Path) -> list[dict]:
    out.mkdir()
    env = dict(os.environ)
    # The aioloader under test, not whatever copy is installed.
    root = str(Path(aioloader.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.Popen([sys.executable, str(HERE / "_lightning_ddp_script.py"), which,
                             str(out)], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = proc.communicate(timeout=90)
    finally:
        try:  # the launcher's rank-1 child is in the same new session
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 0, output.decode(errors="replace")[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_lightning_ddp_two_cpu_processes_shards_like_torch(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    ranks_t = _run_ddp("torch", tmp_path / "torch")
    ranks_a = _run_ddp("aioloader", tmp_path / "aioloader")
    for rank_t, rank_a in zip(ranks_t, ranks_a):
        assert len(rank_a["seen"]) == len(rank_t["seen"]) == 40  # 20 per epoch, 2 epochs
        assert rank_a["seen"] == rank_t["seen"]
        assert rank_a["weight"] == pytest.approx(rank_t["weight"])
        assert rank_a["bias"] == pytest.approx(rank_t["bias"])
    first_epoch = ranks_a[0]["seen"][:20] + ranks_a[1]["seen"][:20]
    assert sorted(first_epoch) == list(range(40))  # disjoint shards covering the dataset


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
