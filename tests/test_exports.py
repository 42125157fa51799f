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
    """docs/pipeline.md's layer table: each backticked name outside parentheses.

    A name is a module at the package's root (``_loader``) or a folder (``_pipeline/``:
    every module in it). Lower number = lower layer; ``top`` sits above every numbered one.
    """
    lines = DOCS.read_text().splitlines()
    start = lines.index("| layer | modules |") + 2
    rows: list[tuple[str, list[str]]] = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        layer, modules = (cell.strip() for cell in line.strip("|").split("|", 1))
        rows.append((layer, re.findall(r"`(\w+/?)`", _outside_parentheses(modules))))
    top = 1 + max(int(layer) for layer, _ in rows if layer != "top")
    layers: dict[str, int] = {}
    for layer, modules in rows:
        for mod in modules:
            assert mod not in layers, f"{mod} is listed twice in the layer table"
            layers[mod.rstrip("/")] = top if layer == "top" else int(layer)
    return layers


LAYERS = _layers_from_docs()


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name under ``aioloader`` (``_pipeline.epoch``)."""
    found = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG).with_suffix("").parts
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _unit(module: str) -> str:
    """The layer table's name for ``module``: its folder, or itself at the root."""
    return module.split(".")[0]


def _imports(module: str) -> set[str]:
    """The package modules ``module`` imports (dotted, as in :data:`MODULES`).

    Type-only imports (under ``if TYPE_CHECKING:``) count too: a circle of annotations
    is still a circle a reader has to untangle.
    """
    path = MODULES[module]
    package = module.split(".")[:-1] if path.name != "__init__.py" else module.split(".")
    if module == "__init__":
        package = []
    tree = ast.parse(path.read_text())
    nodes = list(ast.walk(tree))
    found: set[str] = set()

    def add(name: str) -> None:
        if name in MODULES:
            found.add(name)
        elif f"{name}.__init__" in MODULES or name == "":
            found.add(f"{name}.__init__" if name else "__init__")
        elif "." in name and name.rsplit(".", 1)[0] in MODULES:  # from .mod import attr
            found.add(name.rsplit(".", 1)[0])

    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                stem = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.split(".")[0] == "aioloader":
                stem = node.module[len("aioloader."):] if "." in node.module else ""
            else:
                continue
            if not node.module or f"{stem}.{node.names[0].name}".lstrip(".") in MODULES:
                for alias in node.names:
                    add(f"{stem}.{alias.name}".lstrip("."))
            else:
                add(stem)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "aioloader":
                    add(alias.name[len("aioloader."):] if "." in alias.name else "")
    found.discard(module)
    return found


def test_layer_table_parses() -> None:
    """The docs table yields the layers this test enforces (a sample of known rows)."""
    assert LAYERS["_errors"] == 0
    assert "loader" not in LAYERS and "DataLoaderCore" not in LAYERS
    assert LAYERS["_worker"] < LAYERS["_pools"] < LAYERS["_pipeline"] < LAYERS["_loader"]
    assert LAYERS["_loader"] < LAYERS["_sync_iter"] < LAYERS["dataloader"] == LAYERS["__init__"]


def test_every_module_has_a_layer() -> None:
    """Each root module and each folder is a row of docs/pipeline.md's layer table."""
    units = {_unit(m) for m in MODULES}
    assert units == set(LAYERS), (
        f"list every root module and folder in docs/pipeline.md's layer table: "
        f"{units ^ set(LAYERS)}")


def test_imports_point_down() -> None:
    """No module imports a higher layer (type-only imports included), and nothing inside
    imports the package itself."""
    for mod in MODULES:
        layer = LAYERS[_unit(mod)]
        for dep in _imports(mod):
            assert dep != "__init__", f"{mod} imports the aioloader package itself"
            assert LAYERS[_unit(dep)] <= layer, (
                f"{mod} (L{layer}) imports {dep} (L{LAYERS[_unit(dep)]})")


def test_no_import_circles() -> None:
    """No circle of imports at all, type-only imports included (within a folder too)."""
    graph = {mod: _imports(mod) for mod in MODULES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(mod: str) -> None:
        state[mod] = 1
        path.append(mod)
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                circle = [*path[path.index(dep):], dep]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod)


def test_the_worker_folder_stays_light() -> None:
    """The worker side imports neither the pipeline nor the pools, and no anyio at module
    level (an async dataset's worker imports it when its loop starts)."""
    for mod, path in MODULES.items():
        if _unit(mod) != "_worker":
            continue
        assert not {_unit(d) for d in _imports(mod)} & {"_pipeline", "_pools", "_loader",
                                                         "_sync_iter", "_config", "_options"}, mod
        for node in ast.parse(path.read_text()).body:  # module level only
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("anyio", "sniffio", "trio") for n in names), mod


def test_no_re_export_hubs() -> None:
    """A private module's ``__all__`` names only what it defines, and nothing is imported
    in the ``x as x`` re-export form: import sites name the owning module."""
    for mod, path in MODULES.items():
        if not any(part.startswith("_") and part != "__init__" for part in mod.split(".")):
            continue  # the public modules re-export torch-named names on purpose
        if mod == "_torch_data":
            continue  # it exists to hand out torch's own classes (defined in torch, not here)
        tree = ast.parse(path.read_text())
        imported: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    assert alias.asname is None or alias.asname != alias.name, (
                        f"{mod} re-exports {alias.name}")
                    imported.add(alias.asname or alias.name.split(".")[0])
        for node in tree.body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "__all__"):
                names = {elt.value for elt in node.value.elts}  # type: ignore[attr-defined]
                assert not names & imported, f"{mod} re-exports {sorted(names & imported)}"


def test_one_logger_naming_rule() -> None:
    """Every logger is ``logging.getLogger(__name__)``: its name is the module's."""
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "getLogger"):
                assert (len(node.args) == 1 and isinstance(node.args[0], ast.Name)
                        and node.args[0].id == "__name__"), f"{mod}: getLogger(__name__)"


def _run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter (from the checkout); return what it printed."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True, cwd=PKG.parent).stdout.strip()


def test_the_worker_entry_point_imports_only_light_modules() -> None:
    """A worker process imports the package only to reach aioloader._worker.main: that must not
    load anyio, sniffio or the loader machinery (faster spawn/forkserver start-up)."""

    code = ("import sys, aioloader._worker.main\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('anyio', 'sniffio',"
            " 'trio') or m in ('aioloader._sync_iter', 'aioloader._loader', 'aioloader._pipeline.epoch',"
            " 'aioloader._pools.process', 'aioloader._fetch.amap'))\n"
            "print(heavy)\n")
    assert _run_python(code) == "[]"


class _ReportsImports(tud.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        import sys

        return int("anyio" in sys.modules) * 10 + int("aioloader._sync_iter" in sys.modules)


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


def test_the_package_map_names_every_file_and_only_files_that_exist() -> None:
    """aioloader/README.md (the package's map) lists every .py file, and every file it names exists."""
    text = (PKG / "README.md").read_text()
    named = set(re.findall(r"^- `([\w/]+\.py)`: \S", text, re.MULTILINE))  # one line a file
    files = {p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py")}
    assert not files - named, f"not in aioloader/README.md: {sorted(files - named)}"
    assert not named - files, f"named in aioloader/README.md, missing: {sorted(named - files)}"
    folders = set(re.findall(r"`(_\w+)/`", text))
    assert folders == {p.parent.name for p in PKG.glob("*/__init__.py")}, folders
