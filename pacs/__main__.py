"""The ``pacs`` command (and ``python -m pacs``): first, that the trainer's dependencies are installed.

``pip install .`` installs the kernels alone (torch, numpy, pyyaml, triton); every ``pacs`` subcommand also
needs the trainer's extra. Without it the command says which line installs it, instead of a traceback from an
import deep in the trainer.
"""

from __future__ import annotations

import importlib.util
import sys

# what `pacs` imports beyond the kernels' dependencies (the `train` extra of pyproject.toml), by import name
TRAINER_MODULES = ("transformers", "safetensors", "tqdm", "yaml")
INSTALL_LINE = "pip install 'pacs-rl[train]' (from a checkout: pip install '.[train]')"


def missing_trainer_modules() -> list[str]:
    return [name for name in TRAINER_MODULES if importlib.util.find_spec(name) is None]


def main(argv: list[str] | None = None) -> int:
    missing = missing_trainer_modules()
    if missing:
        print(f"pacs: error: the trainer's dependencies are not installed ({', '.join(missing)}): {INSTALL_LINE}",
              file=sys.stderr)
        return 2
    from pacs.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
