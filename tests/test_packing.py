"""Packed micro-batches: same loss and gradients as padded ones; token budgets keep groups whole
where they fit (groups larger than the budget: tests/test_split_groups.py); the old-policy pass in
chunks equals one pass."""

import pytest
import torch
import transformers

from pacs.config import Config, load_config, user_key, validate
from pacs.model.packed_attention import packed_attention_implementation
from pacs.model.packing import (
    enable_packed_attention,
    micro_batch_ranges,
    pack_real_tokens,
    pack_rows,
    plan_micro_batches,
    real_token_spans,
    use_packing,
)
from pacs.model.policy import Policy
from pacs.train.batch import build_batch
from pacs.train.old_policy import old_policy_logprobs
from pacs.train.update import policy_loss

VOCAB, GROUP = 48, 3
ARCH = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128, use_sliding_window=False)


def tiny_policy(seed: int, attn: str = "pacs_packed_sdpa", dtype=torch.float64) -> Policy:
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**ARCH, tie_word_embeddings=False))
    model = model.to(dtype)
    if attn == "pacs_packed_sdpa":
        enable_packed_attention(model, torch.device("cpu"))
    else:
        model.set_attn_implementation(attn)
    return Policy(model).train()


def random_batch(seed: int, n_groups: int = 2, max_prompt: int = 6, max_response: int = 9):
    """Groups of GROUP responses of random lengths (so rows differ in padding), 0/1 rewards mixed."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(n_groups):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(2, max_prompt + 1, (1,), generator=gen)),),
                               generator=gen).tolist()
        for _ in range(GROUP):
            length = int(torch.randint(1, max_response + 1, (1,), generator=gen))
            prompts.append(prompt)
            responses.append(torch.randint(3, VOCAB, (length,), generator=gen).tolist())
    rewards = [float(i % 2) for i in range(len(responses))]  # every group holds both labels
    return build_batch(prompts, responses, rewards, pad_token_id=0)


def config(*extra: str) -> Config:
    return load_config(None, [f"rollout.group_size={GROUP}", "advanced.optim.logprob_backend=torch", *extra])


def loss_and_grads(policy, batch, old_logp, packed: bool, cfg: Config, old_lse=None):
    policy.zero_grad(set_to_none=True)
    n = batch.input_ids.shape[0]
    part = pack_rows(batch, 0, n) if packed else batch.rows(0, n)
    width = batch.rows(0, n).targets.shape[1]
    old = part.take(old_logp) if packed else old_logp[:, :width]
    lse = None if old_lse is None else (part.take(old_lse) if packed else old_lse[:, :width])
    loss, stats = policy_loss(cfg, policy, part, old, lse)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in policy.named_parameters()}, stats


def test_pack_rows_layout():
    batch = random_batch(0)
    lengths = batch.attention_mask.sum(1)
    packed = pack_rows(batch, 2, 6)
    assert packed.n_sequences == 4 and packed.n_tokens == int(lengths[2:6].sum())
    cu = packed.cu_seqlens.tolist()
    assert cu == [0] + torch.cumsum(lengths[2:6], 0).tolist()
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        assert packed.position_ids[0, s:e].tolist() == list(range(e - s))  # restart per sequence
        assert packed.input_ids[0, s:e].tolist() == batch.input_ids[2 + i, :e - s].tolist()
        assert not bool(packed.mask[e - 1])  # a sequence's last token predicts nothing
        assert packed.mask[s:e].sum() == batch.mask[2 + i].sum()
    values = torch.randn(batch.targets.shape)
    assert torch.equal(packed.take(values)[packed.mask], values[2:6][batch.mask[2:6]])


def test_real_tokens_of_left_and_right_padded_rows_pack_in_order():
    """Rows whose real tokens are one run anywhere (left-padded prompt, right-padded completion) pack in
    order, positions restarting at 0; a gap in a row's real tokens and an empty row are refused."""
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 1, 1, 1]])
    ids = torch.arange(15).reshape(3, 5)
    layout = pack_real_tokens(ids, mask)
    assert layout.input_ids.tolist() == [[1, 2, 3, 5, 6, 12, 13, 14]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert layout.cu_seqlens.tolist() == [0, 3, 5, 8] and layout.max_seqlen == 3
    index, real = layout.packed_index(torch.tensor([[3, 4], [0, 2], [4, 1]]))
    assert real.tolist() == [[True, False], [True, False], [True, False]]
    assert layout.input_ids[0, index[real]].tolist() == [3, 5, 14]
    with pytest.raises(ValueError, match=r"rows \[1\] hold real tokens with padding between them"):
        real_token_spans(torch.tensor([[1, 1, 0], [1, 0, 1]]))
    with pytest.raises(ValueError, match=r"rows \[0\] hold no real token"):
        real_token_spans(torch.tensor([[0, 0, 0], [1, 0, 0]]))


@pytest.mark.parametrize("attn", ["pacs_packed_sdpa", "sdpa", "eager"])
def test_packed_step_equals_padded_step(attn):
    """Same loss and gradients, float64: the packed-sequence attention (ours, or HF's block-diagonal
    mask from restarting position_ids) sees exactly what the padded rows see."""
    policy = tiny_policy(1, attn)
    batch = random_batch(2)
    assert batch.attention_mask.sum(1).unique().numel() > 2  # rows of different lengths: padding matters
    old_logp = torch.randn(batch.targets.shape, dtype=torch.float64) * 0.1 - 3.0
    cfg = config()
    loss_pad, grads_pad, stats_pad = loss_and_grads(policy, batch, old_logp, False, cfg)
    loss_pack, grads_pack, stats_pack = loss_and_grads(policy, batch, old_logp, True, cfg)
    # eager attention takes its softmax in float32 even for float64 inputs: float32 tolerances there
    rtol, atol = (1e-5, 1e-7) if attn == "eager" else (1e-9, 1e-12)
    torch.testing.assert_close(loss_pack, loss_pad, rtol=rtol, atol=atol)
    assert any(g.abs().max() > 1e-6 for g in grads_pad.values())
    for name in grads_pad:
        torch.testing.assert_close(grads_pack[name], grads_pad[name], rtol=rtol, atol=atol, msg=name)
    assert stats_pack.keys() == stats_pad.keys()


def test_packed_one_sweep_first_step_equals_padded():
    policy = tiny_policy(3)
    batch = random_batch(4)
    cfg = config()
    n = batch.input_ids.shape[0]
    old_logp, old_lse, _ = old_policy_logprobs(policy, batch, [(0, n)], 1.0, "torch", packed=False)
    loss_pad, grads_pad, _ = loss_and_grads(policy, batch, old_logp, False, cfg, old_lse)
    loss_pack, grads_pack, _ = loss_and_grads(policy, batch, old_logp, True, cfg, old_lse)
    torch.testing.assert_close(loss_pack, loss_pad, rtol=1e-10, atol=1e-12)
    for name in grads_pad:
        torch.testing.assert_close(grads_pack[name], grads_pad[name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("packed", [False, True])
def test_old_policy_pass_in_chunks_equals_one_pass(packed):
    policy = tiny_policy(5)
    batch = random_batch(6, n_groups=3)
    n = batch.input_ids.shape[0]
    whole = old_policy_logprobs(policy, batch, [(0, n)], 0.9, "torch", packed=packed)
    lengths = batch.attention_mask.sum(1).tolist()
    budget = max(sum(lengths[i:i + GROUP]) for i in range(0, n, GROUP))  # one group per chunk at most
    chunks = micro_batch_ranges(lengths, 0, n, group_size=GROUP, rows_per_micro=GROUP, max_tokens=budget,
                                packed=True)
    assert len(chunks) >= 2
    chunked = old_policy_logprobs(policy, batch, chunks, 0.9, "torch", packed=packed)
    assert batch.mask.any() and bool((whole[0][batch.mask] < 0).all())
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(chunked[1], whole[1], rtol=1e-10, atol=1e-12)
    assert chunked[2] == pytest.approx(whole[2], rel=1e-6)  # entropies come back in float32
    assert bool((chunked[0][~batch.mask] == 0).all())


def test_packed_old_policy_pass_equals_padded():
    policy = tiny_policy(7)
    batch = random_batch(8)
    n = batch.input_ids.shape[0]
    pad = old_policy_logprobs(policy, batch, [(0, n)], 1.0, "torch", packed=False)
    pack = old_policy_logprobs(policy, batch, [(0, n)], 1.0, "torch", packed=True)
    torch.testing.assert_close(pack[0], pad[0], rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- token budgets


def test_token_budget_packs_whole_groups_greedily():
    gen = torch.Generator().manual_seed(9)
    lengths = torch.randint(5, 60, (GROUP * 12,), generator=gen).tolist()
    for budget in (200, 333, 1000):
        for padded in (False, True):
            plan = plan_micro_batches(lengths, GROUP, budget, padded=padded)
            assert plan[0][0] == 0 and plan[-1][1] == len(lengths)
            cost = [(hi - lo) * max(lengths[lo:hi]) if padded else sum(lengths[lo:hi]) for lo, hi in plan]
            for (lo, hi), (next_lo, next_hi), c in zip(plan, plan[1:] + [(len(lengths), None)], cost):
                assert lo % GROUP == 0 and hi % GROUP == 0 and hi > lo  # whole groups only
                assert hi == next_lo
                assert c <= budget
                if next_hi is not None:  # greedy: the next group would not have fit
                    grown = lengths[lo:next_lo + GROUP]
                    assert ((len(grown) * max(grown)) if padded else sum(grown)) > budget


def test_packed_budget_fits_more_than_padded():
    lengths = [40, 5, 5] * 8
    assert len(plan_micro_batches(lengths, GROUP, 120)) < len(plan_micro_batches(lengths, GROUP, 120, padded=True))


def test_group_over_budget_is_a_clear_error():
    lengths = [10, 10, 10, 30, 40, 50]
    with pytest.raises(ValueError, match=r"train\.max_tokens_per_micro_batch=100 .*group 1 .* needs 120 tokens"):
        plan_micro_batches(lengths, GROUP, 100)
    with pytest.raises(ValueError, match="positive integer"):
        plan_micro_batches(lengths, GROUP, 0)


# ----------------------------------------------------------------------------- config


def test_packing_config():
    assert use_packing(Config())  # PACS: packed by default
    assert not use_packing(config("train.packing=false"))
    grpo = config("optim.algo=grpo", "train.packing=true")
    try:
        validate(grpo)
    except ValueError as exc:  # until fused_linear_grpo_loss takes cu_seqlens
        assert "train.packing" in str(exc) and "grpo" in str(exc)
    with pytest.raises(ValueError, match="train.max_tokens_per_micro_batch"):
        validate(config("train.max_tokens_per_micro_batch=0"))
    with pytest.raises(ValueError, match="train.fsdp_cpu_offload"):
        validate(config("train.fsdp_cpu_offload=true"), world_size=1)


@pytest.mark.parametrize("name", ["max_tokens_per_micro_batch", "old_policy_max_tokens"])
def test_a_budget_below_the_longest_possible_sequence_is_refused_at_the_start(name):
    """A sequence's forward cannot be cut, so a budget below max_prompt_len + max_new_tokens would stop
    the run at the first rollout that long: refused before any work, naming both settings."""
    lengths = ["rollout.max_prompt_len=20", "rollout.max_new_tokens=12"]  # sequences up to 32 tokens
    with pytest.raises(ValueError, match=rf"train\.{name}=31 is smaller than .*max_new_tokens = 32 tokens"):
        validate(config(*lengths, f"{user_key('train.' + name)}=31"))
    validate(config(*lengths, f"{user_key('train.' + name)}=32"))


def test_packed_attention_implementation_on_cpu():
    assert packed_attention_implementation(torch.device("cpu")) == "pacs_packed_sdpa"


def test_split_to_count_keeps_whole_groups_and_the_budget():
    lengths = [9, 4, 7, 30, 2, 2, 5, 5, 5, 8, 8, 1]  # 4 groups of 3
    plan = plan_micro_batches(lengths, GROUP, 60)
    from pacs.model.packing import split_to_count

    for count in range(len(plan), 5):  # up to one group per micro-batch (beyond: tests/test_split_groups.py)
        split = split_to_count(plan, count, GROUP)
        assert len(split) == count and split[0][0] == 0 and split[-1][1] == len(lengths)
        assert all(a[1] == b[0] for a, b in zip(split, split[1:]))
        assert all((hi - lo) % GROUP == 0 and hi > lo and sum(lengths[lo:hi]) <= 60 for lo, hi in split)


def test_sliding_window_models_are_refused_when_packed_sequences_exceed_the_window():
    torch.manual_seed(0)
    arch = {**ARCH, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**arch)).double()
    enable_packed_attention(model, torch.device("cpu"))
    batch = random_batch(13)
    from pacs.model.packing import packed_forward

    with pytest.raises(ValueError, match="sliding-window"):
        packed_forward(Policy(model), pack_rows(batch, 0, GROUP))
