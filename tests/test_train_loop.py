"""``train()`` (pacs/train/trainer.py) reads top to bottom: set up, then each step's rollout, score, update,
log and checkpoint, each a named function. It stays short enough for that; so does ``update_policy()``, whose
micro-batches each take their loss through one call (``micro_batch_loss``), and the module reaches the fused
losses from one place."""

import ast
import os

TRAINER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pacs", "train", "trainer.py")
MAX_LINES = 80
MAX_UPDATE_LINES = 50
FUSED_LOSSES = {"fused_linear_pacs_loss", "fused_linear_grpo_loss", "fused_linear_objective_loss", "PACSLoss"}
# the routes a micro-batch's loss may take: only micro_batch_loss picks one
LOSS_ROUTES = {"policy_loss", "loss_piece", "part_of_a_group"}


def top_level_functions(path: str) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def function_lines(path: str, name: str) -> int:
    functions = top_level_functions(path)
    if name not in functions:
        raise AssertionError(f"{path} defines no top-level function {name}()")
    node = functions[name]
    return node.end_lineno - node.lineno + 1


def names_used(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def calls_of(node: ast.AST, name: str) -> int:
    return sum(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name for n in ast.walk(node))


def test_train_is_at_most_80_lines():
    lines = function_lines(TRAINER, "train")
    assert lines <= MAX_LINES, f"train() is {lines} lines (at most {MAX_LINES}): move a part into a named function"


def test_update_policy_is_at_most_50_lines():
    lines = function_lines(TRAINER, "update_policy")
    assert lines <= MAX_UPDATE_LINES, (f"update_policy() is {lines} lines (at most {MAX_UPDATE_LINES}): "
                                       "move a part into a named function")


def test_each_micro_batch_loss_goes_through_one_call():
    update = top_level_functions(TRAINER)["update_policy"]
    assert calls_of(update, "micro_batch_loss") == 1
    assert not names_used(update) & LOSS_ROUTES, "update_policy picks a loss route itself: leave it to micro_batch_loss"


def test_the_trainer_calls_the_fused_losses_from_one_place():
    functions = top_level_functions(TRAINER)
    users = sorted(name for name, node in functions.items() if names_used(node) & FUSED_LOSSES)
    assert users == ["policy_loss"], f"functions of trainer.py that reach the fused losses: {users}"
    # one call with an objective and options: the engine's one entry for either loss
    calls = [n for n in ast.walk(functions["policy_loss"]) if isinstance(n, ast.Call)
             and {"objective", "options"} <= {k.arg for k in n.keywords}]
    assert len(calls) == 1, f"policy_loss calls a fused loss from {len(calls)} places"
