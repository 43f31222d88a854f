"""The verl plugin inside verl's own actor update (verl 0.9.1, opt-in: skipped without verl).

tests/verl_actor_worker.py runs, in a subprocess (one rank, or two FSDP2 ranks under torchrun, on CPU),
what a verl PPO job runs for the actor: ``ActorRolloutRefWorker.init_model`` (FSDP2 engine, SGD from
verl's optimizer config, ``ppo_loss`` with the registered "pacs" loss), ``compute_advantage`` with
"pacs_label", and ``RayPPOTrainer._update_actor`` (mini-batches, micro-batches, gradient accumulation,
gradient averaging over the ranks, optimizer steps). The weights it ends with must equal those of a
reference made here without verl: the same model in float64, log-probs from the full logits, the float64
reference PACS loss of each micro-batch divided by the number of micro-batches in the global mini-batch
(the public PACS code's normalisation), autograd, the same SGD steps.
"""

import copy
import importlib.util
import json
import math
import os

import pytest
import torch
from trainer_helpers import repo_root, run_torchrun
from trl_helpers import tiny_model, tokenizer

from pacs_kernels.reference import reference_pacs_loss

VERL_MODULES = ("verl", "ray", "tensordict", "omegaconf", "hydra", "codetiming", "torchdata")
verl_missing = any(importlib.util.find_spec(name) is None for name in VERL_MODULES)

G = 4                     # rollout.n: responses per prompt
N_GROUPS = 8
PROMPT_LEN, RESPONSE_LEN = 5, 6
LR = 0.5                  # SGD, no momentum or weight decay: one step moves the tiny model's weights visibly
# 0/1 rewards, group by group: mixed groups, one all-wrong and one all-right group (weight 1 each)
LABELS = [1, 0, 0, 1,  0, 0, 0, 0,  1, 1, 0, 1,  0, 1, 1, 1,  1, 1, 1, 1,  0, 1, 0, 0,  1, 0, 1, 0,  0, 0, 1, 0]


def rollout_batch(tok, model, seed: int = 0) -> dict:
    """What verl's rollout hands the trainer: left-padded prompts (one per group, repeated G times),
    right-padded responses, attention mask, position ids, response mask, the rollout policy's
    log-probs (here the model's own plus noise, so that the score is not 0) and the outcome reward
    on the last response token; uids name the groups."""
    gen = torch.Generator().manual_seed(seed)
    B, P, T = N_GROUPS * G, PROMPT_LEN, RESPONSE_LEN
    prompt_len = torch.randint(2, P + 1, (N_GROUPS,), generator=gen).repeat_interleave(G)
    response_len = torch.randint(2, T + 1, (B,), generator=gen)
    prompts = torch.full((B, P), tok.pad_token_id)
    responses = torch.full((B, T), tok.pad_token_id)
    attention_mask = torch.zeros(B, P + T, dtype=torch.long)
    for g in range(N_GROUPS):
        prompt = torch.randint(3, len(tok), (P,), generator=gen)
        for i in range(g * G, (g + 1) * G):
            prompts[i, P - prompt_len[i]:] = prompt[:prompt_len[i]]
    for i in range(B):
        responses[i, :response_len[i]] = torch.randint(3, len(tok), (int(response_len[i]),), generator=gen)
        attention_mask[i, P - prompt_len[i]:P + response_len[i]] = 1
    input_ids = torch.cat([prompts, responses], 1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    response_mask = attention_mask[:, P:].clone()
    labels = torch.tensor(LABELS, dtype=torch.float32)
    token_level_rewards = torch.zeros(B, T)
    token_level_rewards[torch.arange(B), response_len - 1] = labels
    with torch.no_grad():
        logp = response_logprobs(copy.deepcopy(model).double(), input_ids, attention_mask, position_ids, responses)
    old_log_probs = ((logp + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)) * response_mask).float()
    tensors = dict(prompts=prompts, responses=responses, input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids, response_mask=response_mask, old_log_probs=old_log_probs,
                   token_level_rewards=token_level_rewards)
    return {"tensors": tensors, "uid": [f"prompt{i // G}" for i in range(B)]}


def response_logprobs(model, input_ids, attention_mask, position_ids, responses) -> torch.Tensor:
    """(B, T) log-probs of the response tokens from the full logits (the naive computation)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, PROMPT_LEN - 1:-1]
    return torch.log_softmax(logits.double(), -1).gather(-1, responses[..., None]).squeeze(-1)


def verl_overrides(dp: int, mini_batch_prompts: int, micro_batch_responses: int) -> list[str]:
    """The example config made tiny and exact for CPU: FSDP2 in float32, SGD, no clipping, no padding
    removal (flash-attn) or gradient checkpointing, sdpa attention."""
    actor = "actor_rollout_ref.actor"
    return [f"actor_rollout_ref.rollout.n={G}", f"{actor}.ppo_mini_batch_size={mini_batch_prompts}",
            f"{actor}.ppo_micro_batch_size_per_gpu={micro_batch_responses}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro_batch_responses}",
            f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro_batch_responses}",
            f"{actor}.strategy=fsdp2", f"trainer.n_gpus_per_node={dp}", f"data.train_batch_size={N_GROUPS}",
            "actor_rollout_ref.model.use_remove_padding=false",
            "actor_rollout_ref.model.enable_gradient_checkpointing=false",
            "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
            f"{actor}.optim.optimizer=SGD", f"{actor}.optim.lr={LR}", f"{actor}.optim.weight_decay=0.0",
            f"{actor}.optim.clip_grad=1e9", f"{actor}.grad_clip=1e9",
            f"+{actor}.fsdp_config.mixed_precision={{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}}",
            f"{actor}.fsdp_config.use_torch_compile=false"]


def optimizer_steps(dp: int, mini_batch_prompts: int, micro_batch_responses: int) -> list[list[slice]]:
    """The micro-batches (as slices of the batch) of each optimizer step, all ranks together: rank r
    holds the r-th contiguous 1/dp of the batch and cuts it into mini-batches of
    mini_batch_prompts * G / dp responses, each cut into micro-batches."""
    per_rank, mini = N_GROUPS * G // dp, mini_batch_prompts * G // dp
    return [[slice(start, start + micro_batch_responses)
             for r in range(dp)
             for start in range(r * per_rank + k * mini, r * per_rank + (k + 1) * mini, micro_batch_responses)]
            for k in range(per_rank // mini)]


def reference_update(model, batch: dict, steps: list[list[slice]], scale: float = 1.0) -> tuple[dict, list]:
    """SGD steps of the public code's PACS update in float64 -> (weights, each step's loss before it).

    Each micro-batch's loss is the reference PACS loss (mean over its responses) divided by the number
    of micro-batches in the step's global mini-batch; ``scale`` multiplies it (a wrong normalisation,
    to show that the comparison can tell)."""
    model = copy.deepcopy(model).double()
    t = batch["tensors"]
    labels = t["token_level_rewards"].sum(-1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for micro_batches in steps:
        optimizer.zero_grad()
        step_loss = 0.0
        for s in micro_batches:
            logp = response_logprobs(model, t["input_ids"][s], t["attention_mask"][s], t["position_ids"][s],
                                     t["responses"][s])
            loss, _ = reference_pacs_loss(logp, t["old_log_probs"][s].double(), labels[s],
                                          t["response_mask"][s].bool(), group_size=G)
            (loss * scale / len(micro_batches)).backward()
            step_loss += loss.item() / len(micro_batches)
        optimizer.step()
        losses.append(step_loss)
    return {name: p.detach().float() for name, p in model.named_parameters()}, losses


def max_difference(a: dict, b: dict) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in a)


@pytest.mark.slow
@pytest.mark.skipif(verl_missing, reason="verl (with ray, tensordict, ...) is not installed: "
                    "PACS_WITH_VERL=1 bash scripts/setup_env.sh installs it")
@pytest.mark.parametrize("dp, mini_batch_prompts, micro_batch_responses", [
    (1, 4, 2 * G),   # one rank: 2 optimizer steps of 2 micro-batches of 2 groups
    (2, 4, G),       # two FSDP2 ranks: 2 optimizer steps, each rank 2 micro-batches of 1 group per step
])
def test_verl_actor_update_equals_the_public_codes_update(tmp_path, dp, mini_batch_prompts, micro_batch_responses):
    tok = tokenizer()
    model = tiny_model(len(tok), seed=0, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id, attn_implementation="sdpa")
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    batch = rollout_batch(tok, model)
    torch.save(batch, tmp_path / "batch.pt")
    settings = {"overrides": verl_overrides(dp, mini_batch_prompts, micro_batch_responses)}
    (tmp_path / "settings.json").write_text(json.dumps(settings))

    run_torchrun([os.path.join(repo_root(), "tests", "verl_actor_worker.py"), tmp_path],
                 f"verl's actor update on {dp} CPU rank(s)", nproc=dp, timeout=600)
    result = torch.load(tmp_path / "result.pt", weights_only=False)

    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    steps = optimizer_steps(dp, mini_batch_prompts, micro_batch_responses)
    assert len(steps) == 2 and all(len(micro_batches) >= 2 for micro_batches in steps)
    expected, step_losses = reference_update(model, batch, steps)
    labels = batch["tensors"]["token_level_rewards"].sum(-1)
    torch.testing.assert_close(result["advantages"], labels[:, None] * batch["tensors"]["response_mask"])

    tolerance = 2e-6
    assert result["weights"].keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(result["weights"][name], value, rtol=1e-5, atol=tolerance,
                                   msg=lambda message, name=name: f"{name}: {message}")
    # the comparison can fail: the update is far larger than the tolerance, and a normalisation off by the
    # number of micro-batches (a per-micro-batch mean without the division) or by 2 (the dp size) is seen
    assert max_difference(expected, before) > 1000 * tolerance
    for wrong_scale in (len(steps[0]), 2.0, 0.5):
        wrong, _ = reference_update(model, batch, steps, scale=wrong_scale)
        assert max_difference(result["weights"], wrong) > 100 * tolerance

    metrics = result["metrics"]
    # one value per optimizer step: verl's pg_loss sums the scaled micro-batch losses (the global
    # mini-batch mean), the plugin's actor/pacs/loss is the mean of the micro-batch means
    for key in ("actor/pg_loss", "actor/pacs/loss"):
        assert metrics[key] == pytest.approx(step_losses, rel=1e-5), key
    step_rewards = [labels[torch.cat([torch.arange(len(labels))[s] for s in micro_batches])].mean().item()
                    for micro_batches in steps]
    assert metrics["actor/pacs/reward_mean"] == pytest.approx(step_rewards)
    pacs_keys = {key for key in metrics if key.startswith("actor/pacs/")}
    assert {"actor/pacs/psi_std", "actor/pacs/sigmoid_psi_mean", "actor/pacs/weight_mean"} <= pacs_keys
    # NaN-free, but for the per-class means (NaN in a step where a micro-batch lacks the class: dp=2 here)
    per_class = {"actor/pacs/sigmoid_psi_correct_mean", "actor/pacs/sigmoid_psi_incorrect_mean"}
    for key in pacs_keys - per_class:
        assert len(metrics[key]) == len(steps) and all(math.isfinite(v) for v in metrics[key]), key

