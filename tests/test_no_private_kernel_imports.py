"""Nothing outside pacs_kernels imports a private name (one starting with "_") of pacs_kernels or its submodules,
nor reads one as an attribute of an imported pacs_kernels module: what the trainer, the integrations, the
benchmarks and the scripts need from the kernels is their public API."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("pacs", "benchmarks", "scripts", "integrations", "examples")


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))  # dunders are public


def private_uses(path: Path) -> list[str]:
    """'file:line name' for each private pacs_kernels name that ``path`` imports or reads."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found, kernel_aliases = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "pacs_kernels":
            parts = node.module.split(".")[1:]
            found += [f"{path}:{node.lineno} {node.module}" for part in parts if is_private(part)]
            found += [f"{path}:{node.lineno} {node.module}.{a.name}" for a in node.names if is_private(a.name)]
            kernel_aliases |= {a.asname or a.name for a in node.names if not a.name[:1].isupper()}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "pacs_kernels":
                    found += [f"{path}:{node.lineno} {alias.name}" for part in alias.name.split(".")
                              if part.startswith("_")]
                    kernel_aliases.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in kernel_aliases:
                found.append(f"{path}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_private_pacs_kernels_names_outside_the_package():
    files = [p for folder in SCANNED if (ROOT / folder).is_dir() for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 20
    offenders = [use for path in files for use in private_uses(path)]
    assert not offenders, "private pacs_kernels names used outside the package:\n" + "\n".join(offenders)


def test_the_scan_catches_a_private_import(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from pacs_kernels.loss import _secret, public\nimport pacs_kernels.dispatch as d\n"
                      "d._load.cache_clear()\nfrom pacs_kernels import dispatch\ndispatch._load('x')\n")
    assert {use.split(" ", 1)[1] for use in private_uses(sample)} == {
        "pacs_kernels.loss._secret", "d._load", "dispatch._load"}
