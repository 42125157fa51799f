"""The public surface: sorted __all__, torch names present, imports flow one way."""

from __future__ import annotations

import ast
import pathlib
import re

import torch.utils.data as tud

import aioloader

PKG = pathlib.Path(aioloader.__file__).parent

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "pipeline.md"


def _outside_parentheses(text: str) -> str:
    """``text`` without its parenthesised parts (which may nest, as in ``stats()``)."""
    depth, kept = 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif depth == 0:
            kept.append(ch)
    return "".join(kept)


def _layers_from_docs() -> dict[str, int]:
    """docs/pipeline.md's layer table: each backticked module name outside parentheses.

    Lower number = lower layer; ``top`` sits above every numbered layer. A module may
    import only from layers <= its own, never the package itself.
    """
    lines = DOCS.read_text().splitlines()
    start = lines.index("| layer | modules |") + 2
    rows: list[tuple[str, list[str]]] = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        layer, modules = (cell.strip() for cell in line.strip("|").split("|", 1))
        rows.append((layer, re.findall(r"`(\w+)`", _outside_parentheses(modules))))
    top = 1 + max(int(layer) for layer, _ in rows if layer != "top")
    layers: dict[str, int] = {}
    for layer, modules in rows:
        for mod in modules:
            assert mod not in layers, f"{mod} is listed twice in the layer table"
            layers[mod] = top if layer == "top" else int(layer)
    return layers


LAYERS = _layers_from_docs()


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


def _is_type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): imports for annotations only."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` blocks."""
    found: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        found.append(node)
        if _is_type_checking(node):
            assert isinstance(node, ast.If)
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))
    return found


def _imports(path: pathlib.Path) -> set[str]:
    """The package modules ``path`` imports at run time (type-only imports excluded)."""
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
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


def test_layer_table_parses() -> None:
    """The docs table yields the layers this test enforces (a sample of known rows)."""
    assert LAYERS["_errors"] == 0
    assert LAYERS["_stats"] == 0  # its row also names `loader.stats()` in parentheses
    assert "loader" not in LAYERS and "DataLoaderCore" not in LAYERS
    assert LAYERS["_core"] < LAYERS["_inprocess"] <= LAYERS["_pipeline"] < LAYERS["_loader"]
    assert LAYERS["_loader"] < LAYERS["_sync"] < LAYERS["dataloader"] == LAYERS["__init__"]


def test_type_checking_imports_are_exempt() -> None:
    """Only ``if TYPE_CHECKING:`` imports may point up: the iterators name DataLoaderCore."""
    assert "_loader" not in _imports(PKG / "_pipeline.py")
    assert "_loader" in (PKG / "_pipeline.py").read_text()


def test_imports_point_down() -> None:
    """No module imports a higher layer, and nothing inside imports the package itself."""
    modules = {p.stem for p in PKG.glob("*.py")}
    assert modules == set(LAYERS), (
        f"list every module in docs/pipeline.md's layer table: {modules ^ set(LAYERS)}")
    for mod, layer in LAYERS.items():
        for dep in _imports(PKG / f"{mod}.py"):
            assert dep != "__init__", f"{mod} imports the aioloader package itself"
            assert LAYERS[dep] <= layer, f"{mod} (L{layer}) imports {dep} (L{LAYERS[dep]})"


def _run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter (from the checkout); return what it printed."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True, cwd=PKG.parent).stdout.strip()


def test_the_worker_entry_point_imports_only_light_modules() -> None:
    """A worker process imports the package only to reach aioloader._worker: that must not
    load anyio, sniffio or the loader machinery (faster spawn/forkserver start-up)."""

    code = ("import sys, aioloader._worker\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('anyio', 'sniffio',"
            " 'trio') or m in ('aioloader._sync', 'aioloader._loader', 'aioloader._pipeline',"
            " 'aioloader._pool', 'aioloader._afetch'))\n"
            "print(heavy)\n")
    assert _run_python(code) == "[]"


class _ReportsImports(tud.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        import sys

        return int("anyio" in sys.modules) * 10 + int("aioloader._sync" in sys.modules)


def test_a_spawned_worker_does_not_load_the_loader_machinery() -> None:
    loader = aioloader.DataLoader(_ReportsImports(), batch_size=None, num_workers=1,
                                  multiprocessing_context="spawn")
    assert [int(x) for x in loader] == [0, 0]


def test_dataloader_is_loaded_on_first_use_and_shown_as_ours() -> None:
    assert "DataLoader" in dir(aioloader)
    assert aioloader.DataLoader.__module__ == "aioloader"
    assert isinstance(aioloader.DataLoader([1]), tud.DataLoader)


def test_the_first_epoch_imports_no_event_loop_machinery() -> None:
    """anyio's asyncio backend (and uvloop) load with aioloader.DataLoader, not inside the
    first epoch, where they would add 100-200 ms to the time to the first batch."""

    code = ("import sys, aioloader\n"
            "L = aioloader.DataLoader(list(range(8)), batch_size=4, num_workers=1,"
            " multiprocessing_context='fork')\n"
            "before = set(sys.modules)\n"
            "for _ in L: pass\n"
            "print(sorted(m for m in set(sys.modules) - before"
            " if m.split('.')[0] in ('anyio', 'asyncio', 'uvloop')))\n")
    assert _run_python(code) == "[]"
