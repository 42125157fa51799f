"""Lightning DDP run used by tests/test_integrations.py (run as a script, never imported).

``python _lightning_ddp_script.py {torch|aioloader} OUT_DIR`` trains a tiny model with
``Trainer(strategy="ddp", devices=2)`` on CPU over gloo; Lightning's launcher re-runs this
script for rank 1. Each rank writes the sample indices it trained on and the final weights
to ``OUT_DIR/rank{N}.json``.
"""

from __future__ import annotations

import json
import sys
import warnings


def main(which: str, out_dir: str) -> None:
    warnings.simplefilter("ignore")  # Lightning's advice warnings are not under test here
    import lightning as L
    import torch

    import aioloader

    loader_cls = aioloader.DataLoader if which == "aioloader" else torch.utils.data.DataLoader

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

    L.seed_everything(7)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g)
    ds = aioloader.TensorDataset(x, y, torch.arange(40))
    model = Model()
    loader = loader_cls(ds, batch_size=4, shuffle=True)
    trainer = L.Trainer(
        strategy="ddp", devices=2, accelerator="cpu", max_epochs=2,
        enable_progress_bar=False, logger=False, enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    result = {
        "rank": trainer.global_rank,
        "seen": model.seen,
        "weight": model.layer.weight.detach().flatten().tolist(),
        "bias": model.layer.bias.detach().tolist(),
    }
    with open(f"{out_dir}/rank{trainer.global_rank}.json", "w") as f:
        json.dump(result, f)
    # Leave the process group before exiting (as Lightning's docs advise for scripts):
    # otherwise gloo's threads may still be joinable when the interpreter tears down, and
    # on a loaded machine the process can abort after fit() returned ("terminate called
    # without an active exception", seen once in a CI run under load).
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
