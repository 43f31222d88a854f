"""The loop and the update apart (issue 49). ``train()`` (pacs/train/loop.py) reads top to bottom: set up, then
each step's rollout, score, update, log and checkpoint, each a named function, in a module short enough to read
at once. The update (pacs/train/update.py) takes each micro-batch's loss through one call (``micro_batch_loss``),
and the trainer reaches the loss engine from one place, with one public entry for every objective."""

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "pacs", "train")
LOOP = os.path.join(TRAIN, "loop.py")
UPDATE = os.path.join(TRAIN, "update.py")
MAX_LOOP_MODULE_LINES = 200
MAX_MODULE_LINES = 500
# split by issue 49's model-profile work (pacs.train.memory_plan is the planner behind `pacs plan`)
MAX_LINES = 80
MAX_UPDATE_LINES = 50
FUSED_LOSSES = {"fused_linear_pacs_loss", "fused_linear_grpo_loss", "fused_linear_objective_loss", "PACSLoss"}
# the routes a micro-batch's loss may take: only micro_batch_loss picks one
LOSS_ROUTES = {"policy_loss", "loss_piece", "KnownGradient", "GatheredLogprobs"}


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


def line_count(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def test_the_loop_module_is_under_200_lines():
    lines = line_count(LOOP)
    assert lines < MAX_LOOP_MODULE_LINES, (f"pacs/train/loop.py is {lines} lines (under {MAX_LOOP_MODULE_LINES}): "
                                           "move a step's details into the module that owns them")


def test_no_module_of_pacs_over_500_lines():
    paths = glob.glob(os.path.join(ROOT, "pacs", "**", "*.py"), recursive=True)
    long = {os.path.relpath(p, ROOT): line_count(p) for p in paths if line_count(p) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_train_is_at_most_80_lines():
    lines = function_lines(LOOP, "train")
    assert lines <= MAX_LINES, f"train() is {lines} lines (at most {MAX_LINES}): move a part into a named function"


def test_the_loop_calls_each_step_once():
    train = top_level_functions(LOOP)["train"]
    for step in ("generate_rollouts", "score_rollouts", "update_step", "log_step", "checkpoint_if_due"):
        assert calls_of(train, step) == 1, f"train() calls {step}() {calls_of(train, step)} times"


def test_update_policy_is_at_most_50_lines():
    lines = function_lines(UPDATE, "update_policy")
    assert lines <= MAX_UPDATE_LINES, (f"update_policy() is {lines} lines (at most {MAX_UPDATE_LINES}): "
                                       "move a part into a named function")


def test_each_micro_batch_loss_goes_through_one_call():
    update = top_level_functions(UPDATE)["update_policy"]
    assert calls_of(update, "micro_batch_loss") == 1
    assert not names_used(update) & LOSS_ROUTES, "update_policy picks a loss route itself: leave it to micro_batch_loss"


def test_the_trainer_calls_the_loss_engine_from_one_place_with_one_entry():
    users = sorted(f"{os.path.basename(path)}:{name}" for path in glob.glob(os.path.join(TRAIN, "*.py"))
                   for name, node in top_level_functions(path).items() if names_used(node) & FUSED_LOSSES)
    assert users == ["update.py:policy_loss"], f"functions of pacs/train that reach the fused losses: {users}"
    policy_loss = top_level_functions(UPDATE)["policy_loss"]
    assert names_used(policy_loss) & FUSED_LOSSES == {"fused_linear_objective_loss"}, "one entry for every objective"
    # one call with an objective and options, whatever the objective: no choice of entry by type
    calls = [n for n in ast.walk(policy_loss) if isinstance(n, ast.Call)
             and {"objective", "options"} <= {k.arg for k in n.keywords}]
    assert len(calls) == 1, f"policy_loss calls a fused loss from {len(calls)} places"
    assert calls_of(policy_loss, "isinstance") <= 1  # (the packed layout's cu_seqlens; never the objective's type)
    assert not names_used(policy_loss) & {"PACS", "GRPO"}
