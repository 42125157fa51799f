"""The public surface: sorted __all__, torch names present, imports flow one way."""

from __future__ import annotations

import ast
import pathlib

import torch.utils.data as tud

import aioloader

PKG = pathlib.Path(aioloader.__file__).parent

# Lower number = lower layer. A module may import only from layers <= its own
# (same-layer imports allowed where listed below), never the package itself.
LAYERS: dict[str, int] = {
    "_errors": 0, "_worker_info": 0, "_stats": 0,
    "dataset": 1, "sampler": 1, "distributed": 1, "collate": 1, "_fetch": 1, "_pin": 1,
    "_transport": 1, "_failure": 1,
    "_afetch": 2, "_device": 2, "_threads": 2, "_state": 2,
    "_worker": 3,
    "_pool": 4, "_thread_pool": 4, "_ray_pool": 4,
    "_loader": 5,
    "_sync": 6,
    "dataloader": 7, "__init__": 7,
}


def test_all_is_sorted_and_complete() -> None:
    """__all__ is sorted and lists exactly the public attributes."""
    assert aioloader.__all__ == sorted(aioloader.__all__)
    public = {n for n in dir(aioloader) if not n.startswith("_")}
    public -= set(LAYERS) | {"annotations", "dataloader"}
    assert set(aioloader.__all__) == public


def test_torch_public_names_exist() -> None:
    """Every documented torch.utils.data name users import has a twin here."""
    names = ["BatchSampler", "ChainDataset", "ConcatDataset", "DataLoader", "Dataset",
             "DistributedSampler", "IterableDataset", "RandomSampler", "Sampler",
             "SequentialSampler", "StackDataset", "Subset", "SubsetRandomSampler",
             "TensorDataset", "WeightedRandomSampler", "default_collate", "default_convert",
             "get_worker_info", "random_split"]
    for name in names:
        assert hasattr(tud, name), name
        assert hasattr(aioloader, name), name


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    found.update(a.name for a in node.names)
            elif node.module and node.module.split(".")[0] == "aioloader":
                parts = node.module.split(".")
                found.add(parts[1] if len(parts) > 1 else "__init__")
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "aioloader":
                    found.add(parts[1] if len(parts) > 1 else "__init__")
    return found


def test_imports_point_down() -> None:
    """No module imports a higher layer, and nothing inside imports the package itself."""
    modules = {p.stem for p in PKG.glob("*.py")}
    assert modules == set(LAYERS), f"add new modules to LAYERS: {modules ^ set(LAYERS)}"
    for mod, layer in LAYERS.items():
        for dep in _imports(PKG / f"{mod}.py"):
            assert dep != "__init__", f"{mod} imports the aioloader package itself"
            assert LAYERS[dep] <= layer, f"{mod} (L{layer}) imports {dep} (L{LAYERS[dep]})"
