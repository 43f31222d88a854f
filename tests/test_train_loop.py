"""``train()`` (pacs/train/trainer.py) reads top to bottom: set up, then each step's rollout, score, update,
log and checkpoint, each a named function. It stays short enough for that."""

import ast
import os

TRAINER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pacs", "train", "trainer.py")
MAX_LINES = 80


def function_lines(path: str, name: str) -> int:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node.end_lineno - node.lineno + 1
    raise AssertionError(f"{path} defines no top-level function {name}()")


def test_train_is_at_most_80_lines():
    lines = function_lines(TRAINER, "train")
    assert lines <= MAX_LINES, f"train() is {lines} lines (at most {MAX_LINES}): move a part into a named function"
