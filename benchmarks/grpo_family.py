"""The GRPO-family objectives the benchmarks race: ours at their defaults, and Liger's matching fused loss.

    grpo     GRPO()                       Liger loss_type="bnpo"  (token mean; Liger's "grpo" is the per-response
                                                                    mean, our GRPO(aggregation="seq_mean"))
    dapo     DAPO()   eps 0.2 / 0.28      Liger loss_type="dapo"  (token mean over the micro-batch: Liger's
                                                                    normalizer without num_items_in_batch)
    dr_grpo  DrGRPO(max_completion_length=T)   Liger "dr_grpo", max_completion_length=T (sum / (B T))
    gspo     GSPO()   eps 3e-4 / 4e-4     Liger loss_type="grpo", importance_sampling_level="sequence"
                                          (a response's loss is constant over its tokens: the per-response
                                          mean of Liger's "grpo" is our mean over responses)
    cispo    CISPO()  eps_low 1, eps_high 0.28   Liger loss_type="cispo", epsilon_high=1.28: Liger clamps the
                                          IS weight to at most epsilon_high itself (not 1 + epsilon_high) and
                                          has no lower bound (ours: 1 - eps_low = 0 by default, the same)

Liger's loss takes the advantages given (B,), never the rewards: the benchmark hands it ours
(:func:`advantages`: group-normalized, unbiased std + 1e-6; Dr. GRPO's centred only), so that the
losses agree; TRL's trainer normalizes with std + 1e-4, outside Liger. Liger's KL term is switched off
(beta=0), as ours is by default. Liger computes the log-probs of every padded token (its input is
(B, T, d) rows), ours and the other peers those of the response tokens only.
"""

from __future__ import annotations

OBJECTIVES = ("grpo", "dapo", "dr_grpo", "gspo", "cispo")


def check_objective(name: str) -> str:
    if name not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {name!r}")
    return name


def make_objective(name: str, max_length: int):
    """Our objective ``name`` at its defaults; ``max_length``: the padded response width T (Dr. GRPO's L)."""
    import pacs_kernels

    check_objective(name)
    if name == "dr_grpo":
        return pacs_kernels.DrGRPO(max_completion_length=max_length)
    return {"grpo": pacs_kernels.GRPO, "dapo": pacs_kernels.DAPO, "gspo": pacs_kernels.GSPO,
            "cispo": pacs_kernels.CISPO}[name]()


def advantages(name: str, rewards, group_size: int):
    """(B,) the advantages objective ``name`` computes from ``rewards`` (what Liger's loss is given)."""
    from pacs_kernels.objectives.dr_grpo import group_centred_advantages
    from pacs_kernels.objectives.grpo_math import group_normalized_advantages

    check_objective(name)
    values = rewards.float()
    if name == "dr_grpo":
        return group_centred_advantages(values, group_size)
    return group_normalized_advantages(values, group_size)


def liger_settings(name: str, objective) -> dict:
    """Keyword arguments of ``LigerFusedLinearGRPOLoss`` that compute the loss of our ``objective`` (see the
    module docstring for each mapping)."""
    check_objective(name)
    if name == "grpo":
        loss_type = "bnpo" if objective.aggregation == "token_mean" else "grpo"
        high = objective.clip_eps if objective.clip_eps_high is None else objective.clip_eps_high
        return dict(loss_type=loss_type, epsilon_low=objective.clip_eps, epsilon_high=high)
    if name == "cispo":
        return dict(loss_type="cispo", epsilon_low=objective.eps_low, epsilon_high=1.0 + objective.eps_high)
    settings = dict(epsilon_low=objective.eps_low, epsilon_high=objective.eps_high)
    if name == "dapo":
        return dict(settings, loss_type="dapo")
    if name == "dr_grpo":
        return dict(settings, loss_type="dr_grpo", max_completion_length=objective.max_completion_length)
    return dict(settings, loss_type="grpo", importance_sampling_level="sequence")


def liger_note(name: str) -> str:
    """One line for a results table: how Liger's fused loss is set up to compute objective ``name``."""
    return {
        "grpo": "liger_fused: loss_type='bnpo' (our GRPO's token mean; Liger's 'grpo' is the per-response mean)",
        "dapo": "liger_fused: loss_type='dapo' (token mean over the micro-batch)",
        "dr_grpo": "liger_fused: loss_type='dr_grpo', the same max_completion_length (the padded width T)",
        "gspo": "liger_fused: loss_type='grpo' with importance_sampling_level='sequence'",
        "cispo": "liger_fused: loss_type='cispo', epsilon_high=1.28 (Liger's bound is the IS weight's itself, "
                 "not 1 + eps; no lower bound, like ours at eps_low=1)",
    }[check_objective(name)] + "; given our advantages, beta=0, computing every padded token's log-prob"
