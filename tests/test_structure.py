"""The package's shape, as docs/design.md states it: the layer chain (no module imports from a higher
layer, so no import cycle), module sizes, the one module that reads the environment, the one that
talks to torch.distributed, the file rules table with its tests, and that every global name a module
reads is defined in it (code that only runs on a GPU is not run here, so a name lost there would
show only on the device)."""
from __future__ import annotations

import ast
import builtins
import re
import symtable
from pathlib import Path
from typing import Dict, List, Set

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "vlseq_ext"
DESIGN = (REPO / "docs" / "design.md").read_text()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    where = PKG.joinpath(*name.split(".")) if name else PKG
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def package_imports() -> Dict[str, Set[str]]:
    """Every package module and the package modules it imports ("" is vlseq_ext/__init__.py)."""
    graph: Dict[str, Set[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{target}.{alias.name}".strip(".")
                    deps.add(sub if is_module(sub) else target)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vlseq_ext":
                deps.add(node.module[len("vlseq_ext"):].strip("."))
        graph[name] = deps - {name}
    return graph


def documented_layers() -> List[List[str]]:
    """The layer table of docs/design.md (between <!-- layers --> and the end of its code block), low
    to high: each line "N  module module ..." (see layer_of for the patterns)."""
    block = DESIGN.split("<!-- layers -->", 1)[1].split("```", 2)[1]
    return [line.split()[1:] for line in block.splitlines() if re.match(r"\s*\d+\s", line)]


def layer_of(name: str, layers: List[List[str]]) -> int:
    """The layer of a module; a pattern ending in * takes every module whose name starts so (cli.* the
    package cli and its modules, estimators* any estimators module or package)."""
    for i, names in enumerate(layers):
        for pattern in names:
            if pattern.endswith("*"):
                prefix = pattern[:-1]
                if name.startswith(prefix) or name == prefix.rstrip("."):
                    return i
            elif name == ("" if pattern == "vlseq_ext" else pattern):
                return i
    raise AssertionError(f"vlseq_ext.{name} is in no layer of docs/design.md")


def test_no_module_imports_from_a_higher_layer():
    layers, graph = documented_layers(), package_imports()
    assert len(layers) >= 8
    wrong = [f"{m or 'vlseq_ext'} (layer {layer_of(m, layers) + 1}) imports {d or 'vlseq_ext'} "
             f"(layer {layer_of(d, layers) + 1})"
             for m, deps in graph.items() for d in deps if layer_of(d, layers) > layer_of(m, layers)]
    assert not wrong, wrong
    # inside a layer (cli.*, bench.*): no cycle either
    seen: Dict[str, int] = {}

    def visit(m: str, path: List[str]) -> None:
        if seen.get(m) == 2:
            return
        assert seen.get(m) != 1, f"import cycle: {' -> '.join(path + [m])}"
        seen[m] = 1
        for d in graph.get(m, ()):
            visit(d, path + [m])
        seen[m] = 2

    for m in graph:
        visit(m, [])


def undefined_globals(path: Path) -> Set[str]:
    """Global names read in the module at `path` (at its top level or in any function, lambda or
    class in it) that it neither assigns, imports nor defines, and that are not builtins."""
    top = symtable.symtable(path.read_text(), str(path), "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    found: Set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for sym in table.get_symbols():
            name = sym.get_name()
            if sym.is_referenced() and (table is top or sym.is_global()) and name not in defined \
                    and not hasattr(builtins, name) and name not in ("__file__", "__path__", "__spec__"):
                found.add(f"{table.get_name()}: {name}")
        for child in table.get_children():
            walk(child)

    walk(top)
    return found


def test_every_global_name_a_module_reads_is_defined():
    undefined = {module_name(p): u for p in sorted(PKG.rglob("*.py")) if (u := undefined_globals(p))}
    assert not undefined, undefined


def test_no_package_module_is_over_400_lines():
    long = {module_name(p): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def uses(tree: ast.AST, dotted: str) -> bool:
    """Whether the code (not its strings) imports or refers to `dotted` (e.g. "torch.distributed"),
    under any alias (import os as o; o.environ)."""
    first, _, last = dotted.rpartition(".")
    aliases = {first}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[:2] == dotted.split("."):
                    return True
                if a.name == first:
                    aliases.add(a.asname or a.name)
        if isinstance(node, ast.ImportFrom) and (node.module == dotted or (node.module or "").startswith(dotted + ".")
                                                 or (node.module == first and any(a.name == last for a in node.names))):
            return True
    return any(isinstance(node, ast.Attribute) and node.attr == last and ast.unparse(node.value) in aliases
               for node in ast.walk(tree))


def test_only_env_reads_the_environment_and_only_distributed_imports_torch_distributed():
    for path in PKG.rglob("*.py"):
        tree, name = ast.parse(path.read_text()), module_name(path)
        if name != "env":
            reads = any(uses(tree, f"os.{f}") for f in ("environ", "getenv", "putenv"))
            assert not reads, f"{name} reads the environment"
        if name != "distributed" and not name.startswith("bench"):  # (the bench measures DDP itself)
            assert not uses(tree, "torch.distributed"), f"{name} uses torch.distributed directly"


def test_every_file_rule_has_its_tests_and_its_row_in_design_md():
    from vlseq_ext.cli.file_rules import RULES

    tests = "".join(p.read_text() for p in (REPO / "tests").glob("test_*.py"))
    for rule in RULES.values():
        assert rule.tests, rule.key
        for name in rule.tests:
            assert re.search(rf"^def {name}\(", tests, re.M), f"rule {rule.key}: no test {name}"
        row = f"| `{rule.key}` | {rule.when} | {rule.then} | {', '.join(f'`{t}`' for t in rule.tests)} |"
        assert row in DESIGN.splitlines(), f"docs/design.md lacks, or words otherwise, the row {row}"
    section = DESIGN.split("### The file rules", 1)[1].split("\n#", 1)[0]
    documented = set(re.findall(r"^\| `([a-z0-9-]+)` \|", section, re.M))
    assert documented == set(RULES), documented ^ set(RULES)
    used = set()
    for path in (PKG / "cli").glob("*.py"):
        used |= set(re.findall(r"refuse\(\"([a-z0-9-]+)\"", path.read_text()))
    assert used <= set(RULES) and {k for k, r in RULES.items() if r.message} <= used, used


@pytest.mark.parametrize("path", ["vlseq_ext.loop", "vlseq_ext.ops", "vlseq_ext.data", "vlseq_ext.devices",
                                  "vlseq_ext.checkpoint", "vlseq_ext.reference"])
def test_documented_import_paths_keep_working(path):
    import importlib

    module = importlib.import_module(path)
    wanted = {"vlseq_ext.loop": "TrainingLoop", "vlseq_ext.ops": "flatten", "vlseq_ext.data": "save_ragged",
              "vlseq_ext.devices": "parse_devices", "vlseq_ext.checkpoint": "load_model",
              "vlseq_ext.reference": "opmath"}[path]
    assert hasattr(module, wanted)
