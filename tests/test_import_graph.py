"""The import graph of ``pacs`` and ``pacs_kernels``, read from the source (AST, function-level imports
included): no cycle, no arrow from a lower layer up to a higher one, no private name imported across
sub-packages, and nothing in ``pacs`` importing the ``benchmarks`` harness.

Layers, bottom to top (a module may import its own layer and the layers below it):

0. ``pacs_kernels``                       the Triton kernels and the losses built on them
1. ``pacs`` (the package's ``__init__`` only), ``pacs.configs`` (the shipped configs, by name),
   ``pacs.registry`` (the named choices, imported on use), ``pacs.config`` (the settings tree: plain data)
2. ``pacs.model``                         loading the policy, packing, varlen attention, sequence
                                          parallelism, tiled MLP, memory levers, LoRA, the head's forward
3. ``pacs.tasks``, ``pacs.rollout``       problems, rewards, datasets; generating responses
4. ``pacs.eval``                          evaluating a policy on a task, its journal and outputs
5. ``pacs.run``                           a run's directory, lock, checkpoints, stop signals, set-up
6. ``pacs.train``                         the loop, the update, preflight, metrics
7. ``pacs.integrations``                  TRL and verl on top of the trainer's pieces
8. ``pacs.cli``, ``pacs.__main__``        the ``pacs`` command
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("pacs", "pacs_kernels")
LAYERS = (
    ("pacs_kernels",),
    ("pacs", "pacs.configs", "pacs.registry", "pacs.config"),
    ("pacs.model",),
    ("pacs.tasks", "pacs.rollout"),
    ("pacs.eval",),
    ("pacs.run",),
    ("pacs.train",),
    ("pacs.integrations",),
    ("pacs.cli", "pacs.__main__"),
)


def module_files(root: str = ROOT) -> dict[str, str]:
    """Every module under the packages, by dotted name (a package by its own name), to its file."""
    modules = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(root, package)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                parts = os.path.relpath(os.path.join(folder, name), root)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                modules[".".join(parts)] = os.path.join(folder, name)
    return modules


def _base(module: str, path: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _known(name: str, modules: dict[str, str]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: str, modules: dict[str, str]) -> list[tuple[str, str, int]]:
    """(imported module, the name imported from it or "", line) for each import in the file, at any depth."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, "", node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, path, node)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((full, "", node.lineno) if full in modules else (base, alias.name, node.lineno))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            found.append((node.args[0].value, "", node.lineno))
    return found


def import_graph(root: str = ROOT) -> tuple[dict[str, set[str]], list[tuple[str, str, str, int]]]:
    """The edges between modules of the packages, and every import as (importer, imported, name, line)."""
    modules = module_files(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    imports = []
    for module, path in modules.items():
        for target, name, line in imports_of(module, path, modules):
            imports.append((module, target, name, line))
            known = _known(target, modules)
            if known and known != module:
                graph[module].add(known)
    return graph, imports


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            inside = module == prefix or (prefix != "pacs" and module.startswith(prefix + "."))
            if inside and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer of LAYERS: put it in a sub-package or name it in LAYERS")
    return best


def sub_package(module: str) -> str:
    """The unit private names may not leave: pacs_kernels, or pacs.<first part>."""
    parts = module.split(".")
    return parts[0] if parts[0] != "pacs" else ".".join(parts[:2])


def test_no_import_cycle():
    graph, _ = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_upward_import():
    graph, _ = import_graph()
    upward = [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
              for a, targets in sorted(graph.items()) for b in sorted(targets) if layer_of(b) > layer_of(a)]
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_private_name_across_sub_packages():
    graph, imports = import_graph()
    modules = set(graph)
    crossing = []
    for importer, target, name, line in imports:
        known = _known(target, dict.fromkeys(modules))
        if known is None:
            continue
        private = name.startswith("_") or any(part.startswith("_") and part != "__init__"
                                              for part in target[len(known):].split(".") if part)
        if name.startswith("__") and name.endswith("__"):
            private = False
        if private and sub_package(importer) != sub_package(known):
            crossing.append(f"{importer}:{line} imports {name or target} from {known}")
    assert not crossing, "private names imported across sub-packages:\n" + "\n".join(crossing)


def test_pacs_does_not_import_benchmarks():
    _, imports = import_graph()
    found = [f"{importer}:{line} imports {target}" for importer, target, _, line in imports
             if importer.split(".")[0] == "pacs" and target.split(".")[0] == "benchmarks"]
    assert not found, "pacs must not import the benchmarks harness (load it by file path):\n" + "\n".join(found)


def test_the_graph_reader_sees_function_level_and_relative_imports(tmp_path):
    package = tmp_path / "pacs"
    (package / "model").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "model" / "__init__.py").write_text("")
    (package / "model" / "a.py").write_text("def f():\n    from ..cli import main\n")
    (package / "cli.py").write_text("from .model import a\n")
    (tmp_path / "pacs_kernels").mkdir()
    (tmp_path / "pacs_kernels" / "__init__.py").write_text("")
    graph, _ = import_graph(str(tmp_path))
    assert graph["pacs.model.a"] == {"pacs.cli"}
    assert graph["pacs.cli"] == {"pacs.model.a"}
    assert find_cycle(graph) in (["pacs.cli", "pacs.model.a", "pacs.cli"], ["pacs.model.a", "pacs.cli", "pacs.model.a"])
    assert layer_of("pacs.model.a") < layer_of("pacs.cli")
