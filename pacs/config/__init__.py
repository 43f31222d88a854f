"""One dataclass tree for every setting of a run; YAML files and command-line overrides fill it.

Each section is a dataclass in its own module (model.py, task.py, rollout.py, optim.py, train.py, eval.py,
rollout_correction.py; the top level and the tree: root.py) whose fields describe themselves
(:func:`pacs.config.fields.setting`: help, choices, bounds, advanced). Validation (each section's ``check``,
the rules across sections in rules.py), ``pacs train --help``, the unknown-key suggestions (keys.py) and
docs/config.md (``python -m pacs.config.docs``) are read from those fields. Choices that name code (objectives,
rollout engines, tasks, rewards) live in pacs/registry.py. This package imports nothing of the model, the
rollouts, the tasks, the trainer or the kernels.

Precedence (later wins): the dataclass defaults (a real model's settings, the paper's; the built-in tasks
"embedded" and "wordmath" add their toy settings, :data:`BUILTIN_TASK_SETTINGS`), the YAML file given with
``--config``, ``key.path=value`` overrides, then the named flags (``--model``, ``--max-steps``, ...).
:func:`validate` rejects configs that cannot work before any work starts.
"""

from pacs.config.eval import EvalConfig
from pacs.config.fields import Setting, setting, settings
from pacs.config.keys import (
    ADVANCED,
    ADVANCED_KEYS,
    closest_key,
    config_keys,
    declared_key,
    from_user_layout,
    known_keys,
    saved_before_advanced,
    to_dict,
    to_user_dict,
    user_key,
)
from pacs.config.load import (
    BUILTIN_TASK_SETTINGS,
    apply_dict,
    apply_override,
    config_hash,
    load_config,
    read_yaml,
    save_config,
)
from pacs.config.model import LoraConfig, ModelConfig
from pacs.config.optim import OptimConfig
from pacs.config.rollout import RolloutConfig
from pacs.config.rollout_correction import RolloutCorrectionConfig
from pacs.config.root import Config
from pacs.config.rules import check_algo, check_lengths, micro_batch_groups, validate, validate_train
from pacs.config.task import BUILTIN_TASKS, TaskConfig
from pacs.config.train import TrainConfig
from pacs.registry import OBJECTIVES

# the objectives optim.algo names out of the box (pacs/registry.py); a user's is named module:Class
BUILTIN_OBJECTIVES = OBJECTIVES.builtin

__all__ = [
    "ADVANCED", "ADVANCED_KEYS", "BUILTIN_OBJECTIVES", "BUILTIN_TASKS", "BUILTIN_TASK_SETTINGS", "Config",
    "EvalConfig", "LoraConfig", "ModelConfig", "OptimConfig", "RolloutConfig", "RolloutCorrectionConfig", "Setting",
    "TaskConfig", "TrainConfig", "apply_dict", "apply_override", "check_algo", "check_lengths", "closest_key",
    "config_hash", "config_keys", "declared_key", "from_user_layout", "known_keys", "load_config",
    "micro_batch_groups", "read_yaml", "save_config", "saved_before_advanced", "setting", "settings", "to_dict",
    "to_user_dict", "user_key", "validate", "validate_train",
]
