"""Objectives as plug-ins: group losses on per-token log-probs (docs/objectives.md).

Each objective is a frozen dataclass of its hyperparameters, called as
``loss, stats = objective(logp, old_logp, rewards, mask, group_size=G, ref_logp=None, entropy=None)``
(the :class:`Objective` protocol); :func:`pacs_kernels.fused_linear_objective_loss` runs any of them, or your own,
straight from hidden states and the LM head.
"""

from .cispo import CISPO
from .dapo import DAPO
from .dr_grpo import DrGRPO
from .grpo import GRPO
from .gspo import GSPO
from .pacs import PACS
from .protocol import Capabilities, Objective

__all__ = ["Objective", "Capabilities", "GRPO", "DAPO", "DrGRPO", "GSPO", "CISPO", "PACS"]

