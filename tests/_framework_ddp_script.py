"""Two-rank framework run used by tests/test_integrations.py (run as a script, never imported).

``python _framework_ddp_script.py OUT_DIR SECTION[,SECTION...]`` runs, on each of 2 ranks
over gloo on CPU, the same loaders through every framework path named in SECTIONS
(``trainer``, ``fabric``, ``accelerate``; ``datasets`` adds HF ``datasets`` cases to each):
a torch ``DataLoader`` and an aioloader one, each with the default sampler and with an
explicit torch or aioloader ``DistributedSampler``. Each rank writes, per case, the sample
indices and batch sizes it saw per epoch and what the framework's loader looks like
(``batch_size``, sampler type, ``len()``s, ``set_epoch``) to ``OUT_DIR/rank{N}.json``.

Started without ``LOCAL_RANK``, the first ``Trainer.fit`` (strategy ``ddp``, ``devices=2``)
starts rank 1 by re-running this script, as Lightning does for a user's script; started
with ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` (both ranks
started by the caller, as ``torchrun`` does), every framework sees processes created
externally.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from functools import partial
from typing import Any

N, BATCH, EPOCHS, SEED = 96, 8, 2, 11


def main(out_dir: str, sections: list[str]) -> None:
    warnings.simplefilter("ignore")  # frameworks' advice warnings are not under test here
    import torch

    import aioloader

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g)
    tensor_ds = aioloader.TensorDataset(x, y, torch.arange(N))
    datasets_: dict[str, Any] = {"tensor": tensor_ds}
    if "datasets" in sections:
        import datasets

        hf = datasets.Dataset.from_dict({"x": x.tolist(), "y": y.tolist(), "idx": list(range(N))})
        datasets_["hf"] = hf.with_format("torch")
    loaders = {"torch": torch.utils.data.DataLoader, "aioloader": aioloader.DataLoader}
    dist_samplers = {"torch_ds": torch.utils.data.distributed.DistributedSampler,
                     "aioloader_ds": aioloader.DistributedSampler}

    def make(loader: str, sampler: str, data: str = "tensor") -> Any:
        ds = datasets_[data]
        if sampler == "default":
            return loaders[loader](ds, batch_size=BATCH, shuffle=True)
        # num_replicas and rank from the initialized process group, as users write it.
        return loaders[loader](ds, batch_size=BATCH, sampler=dist_samplers[sampler](ds, seed=SEED))

    cases = [(lo, sa, "tensor") for sa in ("default", "torch_ds", "aioloader_ds")
             for lo in ("torch", "aioloader")]
    cases += [(lo, "default", "hf") for lo in ("torch", "aioloader") if "hf" in datasets_]
    results: dict[str, Any] = {}

    def run(name: str, fn: Any, *args: Any) -> None:
        torch.manual_seed(SEED)  # accelerate seeds its sampler's generator from the global RNG
        try:
            results[name] = fn(*args)
        except Exception:
            results[name] = {"error": traceback.format_exc()}

    if "trainer" in sections:
        import lightning as L

        for lo, sa, data in cases:
            run(f"trainer/{lo}/{sa}/{data}", _trainer, L, partial(make, lo, sa, data), False)
        for lo in loaders:  # made in the train_dataloader hook: Lightning captures init args
            run(f"trainer_hook/{lo}/default/tensor", _trainer, L, partial(make, lo, "default"),
                True)
    if "fabric" in sections:
        import lightning as L

        for lo, sa, data in cases:
            run(f"fabric/{lo}/{sa}/{data}", _fabric, L, partial(make, lo, sa, data), False)
        for lo in loaders:  # made inside fabric.launch(fn): Lightning captures init args
            run(f"fabric_launch/{lo}/default/tensor", _fabric, L, partial(make, lo, "default"),
                True)
    if "accelerate" in sections:
        import accelerate

        os.environ.setdefault("RANK", os.environ.get("LOCAL_RANK", "0"))
        accelerator = accelerate.Accelerator(cpu=True)
        for lo, sa, data in cases:
            run(f"accelerate/{lo}/{sa}/{data}", _accelerate, accelerator,
                partial(make, lo, sa, data))
        if "hf" in datasets_:
            it_ds = datasets_["hf"].to_iterable_dataset(num_shards=2)
            for lo in loaders:
                run(f"accelerate/{lo}/default/hf_iterable", _accelerate, accelerator,
                    partial(loaders[lo], it_ds, batch_size=BATCH))

    rank = torch.distributed.get_rank()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    # Leave the process group together before exiting: otherwise gloo's threads may still
    # be joinable when the interpreter tears down ("terminate called without an active
    # exception", seen once under load).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _batch_idx(batch: Any) -> list[int]:
    idx = batch["idx"] if isinstance(batch, dict) else batch[2]
    return [int(i) for i in idx.tolist()]


def _describe(loader: Any) -> dict[str, Any]:
    """What a framework (and ported code) reads from the loader it iterates."""
    import torch

    sampler, batch_sampler = loader.sampler, loader.batch_sampler

    def length(obj: Any) -> int | None:
        try:
            return len(obj)
        except TypeError:  # an iterable dataset without __len__
            return None

    return {
        "loader": type(loader).__name__,
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "sampler": f"{type(sampler).__module__}.{type(sampler).__qualname__}",
        "sampler_is_torch_ds": isinstance(sampler, torch.utils.data.DistributedSampler),
        "batch_sampler": type(batch_sampler).__name__,
        "batch_sampler_is_torch_bs": type(batch_sampler) is torch.utils.data.BatchSampler,
        "len_loader": length(loader),
        "len_sampler": length(sampler),
        "sampler_epoch": getattr(sampler, "epoch", None),
        "set_epoch": callable(getattr(sampler, "set_epoch", None)),
    }


def _trainer(L: Any, factory: Any, in_hook: bool) -> dict[str, Any]:
    import torch

    epochs: list[list[int]] = []
    sizes: list[list[int]] = []

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def on_train_epoch_start(self) -> None:
            epochs.append([])
            sizes.append([])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch[:2]
            epochs[-1].extend(_batch_idx(batch))
            sizes[-1].append(len(x))
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        if in_hook:
            def train_dataloader(self) -> Any:
                return factory()

    L.seed_everything(7)
    model = Model()
    trainer = L.Trainer(
        strategy="ddp", devices=2, accelerator="cpu", max_epochs=EPOCHS,
        enable_progress_bar=False, logger=False, enable_checkpointing=False,
        enable_model_summary=False,
    )
    if in_hook:
        trainer.fit(model)
    else:
        trainer.fit(model, factory())
    return {"epochs": epochs, "sizes": sizes, "describe": _describe(trainer.train_dataloader),
            "weight": model.layer.weight.detach().flatten().tolist()}


def _fabric(L: Any, factory: Any, in_launch: bool) -> dict[str, Any]:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    epochs: list[list[int]] = []
    sizes: list[list[int]] = []

    def body(fabric: Any) -> Any:
        loader = fabric.setup_dataloaders(factory())
        for epoch in range(EPOCHS):
            # What ported torch code does (Fabric also does it in __iter__).
            loader.sampler.set_epoch(epoch)
            epochs.append([])
            sizes.append([])
            for batch in loader:
                epochs[-1].extend(_batch_idx(batch))
                sizes[-1].append(len(_batch_idx(batch)))
        return loader

    if in_launch:
        loader = fabric.launch(body)
    else:
        fabric.launch()
        loader = body(fabric)
    return {"epochs": epochs, "sizes": sizes, "describe": _describe(loader._dataloader)}


def _accelerate(accelerator: Any, factory: Any) -> dict[str, Any]:
    prepared = accelerator.prepare(factory())
    epochs: list[list[int]] = []
    sizes: list[list[int]] = []
    for epoch in range(EPOCHS):
        prepared.set_epoch(epoch)
        epochs.append([])
        sizes.append([])
        for batch in prepared:
            epochs[-1].extend(_batch_idx(batch))
            sizes[-1].append(len(_batch_idx(batch)))
    return {"epochs": epochs, "sizes": sizes, "describe": _describe(prepared)}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
