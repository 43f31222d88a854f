"""The sampler is not the trainer (issue 48; pacs/train/rollout_correction.py, docs/rollout-correction.md): the
engines return the sampler's log-probs, every metrics row carries their mismatch with the trainer's, and the
masking modes train every objective."""

from __future__ import annotations

import math

import pytest
import torch

from pacs.cli import main
from pacs.config import BUILTIN_OBJECTIVES, Config
from pacs.model.policy import load_policy
from pacs.rollout import HFGenerateEngine, SampledResponses, vllm_available
from pacs.tasks.embedded import build_model, build_tokenizer
from pacs.train.batch import build_batch
from pacs.train.metrics import read_metrics
from pacs.train.old_policy import old_policy_logprobs
from pacs.train.rollout_correction import COLUMNS, Band, correct, keep_masks, measure, truncated_weights

TINY_RUN = ["advanced.task.digits=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
            "rollout.max_new_tokens=3", "optim.mini_batches_per_step=1", "optim.micro_batch_groups=1",
            "eval.num_problems=4", "eval.every=0", "checkpoint_every=0", "advanced.plot=false",
            "advanced.torch_threads=1"]
PROMPTS = [[1, 5, 13, 6, 16], [1, 7, 13, 8, 16], [1, 9, 13, 4]]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """The embedded model's architecture with random, non-trivial weights (no warm-up: fast)."""
    path = tmp_path_factory.mktemp("tiny_model")
    model = build_model(Config().task, len(build_tokenizer()), seed=5)
    noise = torch.Generator().manual_seed(2)  # the same weights whatever ran before (the global RNG is shared)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=noise, dtype=p.dtype))
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def float64_logprobs(model_dir: str, batch, temperature: float) -> torch.Tensor:
    """(B, L) float64 log-probs of the batch's targets at ``temperature``, the model run in float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.double()
    return (logits / temperature).log_softmax(-1).gather(-1, batch.targets[..., None])[..., 0]


def sampled_batch(sampled: SampledResponses, prompts, n):
    responses = [r for group in sampled.token_ids for r in group]
    logprobs = [v for group in sampled.logprobs for v in group]
    return build_batch([p for p in prompts for _ in range(n)], responses, [float(i % 2) for i in range(len(responses))],
                       pad_token_id=0, sampler_logprobs=logprobs)


def test_a_mismatched_sampler_is_measured_as_the_float64_truth_says(tiny_model_dir):
    """HF generate samples at temperature 1.1, the trainer scores at 1.0: the sampler's log-probs are the
    float64 log_softmax(z / 1.1), and every mismatch column is what float64 says of log_softmax(z) - that."""
    engine = HFGenerateEngine(tiny_model_dir, max_model_len=32, seed=3)
    sampled = engine.generate(PROMPTS, 4, temperature=1.1, top_p=1.0, max_new_tokens=6, stop_token_ids=[2],
                              return_logprobs=True)
    assert isinstance(sampled, SampledResponses)
    assert sampled.token_ids == engine.generate(PROMPTS, 4, temperature=1.1, top_p=1.0, max_new_tokens=6,
                                                stop_token_ids=[2], seed=3)  # the same samples as without log-probs
    batch = sampled_batch(sampled, PROMPTS, 4)
    mask = batch.mask
    sampler_truth = float64_logprobs(tiny_model_dir, batch, 1.1)
    torch.testing.assert_close(batch.sampler_logp[mask].double(), sampler_truth[mask], rtol=0, atol=2e-5)

    policy = load_policy(tiny_model_dir)
    old_logp, _, _ = old_policy_logprobs(policy, batch, [(0, 4), (4, 8), (8, 12)], temperature=1.0, backend="auto")
    delta = (float64_logprobs(tiny_model_dir, batch, 1.0) - sampler_truth)[mask]  # log(pi_trainer / pi_sampler)
    assert delta.abs().max() > 0.05  # a real mismatch, far above float32 rounding
    # a band whose edges lie away from every token's and response's ratio (so rounding cannot move a count)
    seq = torch.zeros(mask.shape[0], dtype=torch.float64).index_add_(0, mask.nonzero()[:, 0], delta)
    values = torch.cat([delta, seq]).sort().values  # the edges midway between neighbouring log-ratios
    low, high = (int(q * len(values)) for q in (0.3, 0.8))
    band = Band(c_min=math.exp(float(values[low] + values[low + 1]) / 2),
                c_max=math.exp(float(values[high] + values[high + 1]) / 2))
    for edge in (math.log(band.c_min), math.log(band.c_max)):
        assert (values - edge).abs().min() > 1e-6
    got = measure(old_logp, batch.sampler_logp, mask, band).columns()
    k3 = float((delta.exp() - 1 - delta).mean())
    assert got["mismatch_kl"] == pytest.approx(k3, rel=1e-3, abs=1e-7)
    assert got["mismatch_logp_diff_mean"] == pytest.approx(float(delta.abs().mean()), rel=1e-4)
    assert got["mismatch_logp_diff_max"] == pytest.approx(float(delta.abs().max()), rel=1e-4)
    token_out = float(((delta < math.log(band.c_min)) | (delta > math.log(band.c_max))).double().mean())
    response_out = float(((seq < math.log(band.c_min)) | (seq > math.log(band.c_max))).double().mean())
    assert got["mismatch_token_out_frac"] == pytest.approx(token_out)
    assert got["mismatch_response_out_frac"] == pytest.approx(response_out) and 0 < response_out < 1


def test_top_p_log_probs_are_renormalized_over_the_nucleus(tiny_model_dir):
    engine = HFGenerateEngine(tiny_model_dir, max_model_len=32, seed=3)
    nucleus = engine.generate(PROMPTS, 4, temperature=1.0, top_p=0.5, max_new_tokens=6, stop_token_ids=[2],
                              return_logprobs=True)
    batch = sampled_batch(nucleus, PROMPTS, 4)
    full = float64_logprobs(tiny_model_dir, batch, 1.0)[batch.mask]
    sampler = batch.sampler_logp[batch.mask].double()
    assert (sampler >= full - 1e-5).all() and (sampler > full + 1e-3).any()  # divided by the nucleus' mass < 1
    greedy = engine.generate(PROMPTS, 2, temperature=0.0, top_p=1.0, max_new_tokens=4, stop_token_ids=[2],
                             return_logprobs=True)
    batch = sampled_batch(greedy, PROMPTS, 2)
    torch.testing.assert_close(batch.sampler_logp[batch.mask].double(),
                               float64_logprobs(tiny_model_dir, batch, 1.0)[batch.mask], rtol=0, atol=2e-5)


def test_masking_modes_on_known_ratios():
    """Ratios chosen by hand: which tokens and responses each mode drops, PACS through valid, others by mask."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    delta = torch.tensor([[0.0, 2.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0], [-3.0, 0.1, 0.1, 0.1], [0.0] * 4])
    old, sampler = torch.randn(4, 4), None
    sampler = torch.where(mask, old - delta, torch.zeros(()))
    band = Band(c_min=0.1, c_max=2.0)  # log: [-2.30, 0.69]
    tokens, responses = keep_masks(old, sampler, mask, "token_mask", band)
    assert tokens.tolist() == [[True, False, True, False], [True, True, False, False],
                               [False, True, True, True], [False] * 4]
    assert responses.tolist() == [True, True, True, True]
    _, responses = keep_masks(old, sampler, mask, "sequence_mask", band)  # product: sums 2.0, 1.0, -2.7, 0
    assert responses.tolist() == [False, False, False, True]
    _, responses = keep_masks(old, sampler, mask, "sequence_mask", Band(0.1, 2.0, "geometric"))  # means .67 .5 -.67
    assert responses.tolist() == [True, True, True, True]
    batch = build_batch([[1]] * 4, [[5, 6, 7], [5, 6], [5, 6, 7, 8], []], [1.0, 0.0, 1.0, 0.0], pad_token_id=0)
    batch.sampler_logp = torch.where(batch.mask, torch.randn(batch.mask.shape), torch.zeros(()))
    old = torch.zeros_like(batch.sampler_logp)
    old[batch.mask] = (batch.sampler_logp + torch.nn.functional.pad(delta, (0, batch.mask.shape[1] - 4)))[batch.mask]
    pacs_batch, sums = correct(batch, old, "sequence_mask", band, response_valid=True)
    assert pacs_batch.valid.tolist() == [False, False, False, True] and torch.equal(pacs_batch.mask, batch.mask)
    grpo_batch, _ = correct(batch, old, "sequence_mask", band, response_valid=False)
    assert grpo_batch.valid is None and grpo_batch.mask.sum(1).tolist() == [0, 0, 0, 0]
    assert sums.columns()["mismatch_masked_response_frac"] == 1.0  # of the 3 responses with tokens
    same, sums = correct(batch, old, "none", band, response_valid=True)
    assert same is batch and sums.columns()["mismatch_response_out_frac"] == 1.0


def test_truncated_weights_on_known_ratios():
    """token_truncate / sequence_truncate: TRL's clamp(ratio, c_min, c_max), per token or per response; nothing is
    masked; the weights ride on the batch (Batch.token_weights) to the loss."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    delta = torch.tensor([[0.0, 2.0, -3.0, 0.0], [0.5, 0.2, 0.0, 0.0], [0.0] * 4], dtype=torch.float64)
    old = torch.randn(3, 4, dtype=torch.float64)
    sampler = torch.where(mask, old - delta, torch.zeros(()))
    band = Band(c_min=0.1, c_max=2.0)
    token = truncated_weights(old, sampler, mask, "token_truncate", band)
    expected = torch.where(mask, torch.exp(delta).clamp(0.1, 2.0), torch.zeros(()))
    torch.testing.assert_close(token, expected)
    sequence = truncated_weights(old, sampler, mask, "sequence_truncate", band)  # sums -1.0, 0.7, (none)
    torch.testing.assert_close(sequence[0, :3], torch.full((3,), math.exp(-1.0), dtype=torch.float64))
    torch.testing.assert_close(sequence[1, :2], torch.full((2,), 2.0, dtype=torch.float64))  # exp(0.7) > c_max
    assert float(sequence[2].abs().sum()) == 0.0 and float(sequence[0, 3]) == 0.0
    geometric = truncated_weights(old, sampler, mask, "sequence_truncate", Band(0.1, 2.0, "geometric"))
    torch.testing.assert_close(geometric[1, :2], torch.full((2,), math.exp(0.35), dtype=torch.float64))
    batch = build_batch([[1]] * 3, [[5, 6, 7], [5, 6], []], [1.0, 0.0, 0.0], pad_token_id=0)
    batch.sampler_logp = torch.where(batch.mask, torch.randn(batch.mask.shape), torch.zeros(()))
    old = torch.where(batch.mask, batch.sampler_logp + 0.5, torch.zeros(()))
    corrected, sums = correct(batch, old, "token_truncate", Band(0.0, 1.5), response_valid=True)
    assert torch.equal(corrected.mask, batch.mask) and corrected.valid is None
    torch.testing.assert_close(corrected.token_weights[batch.mask], torch.full((5,), 1.5, dtype=torch.float64))
    assert sums.columns()["mismatch_masked_token_frac"] == 0.0


def sampler_at(monkeypatch, factor: float) -> None:
    """The training rollouts sampled at ``factor`` times the configured temperature: a mismatched sampler."""
    generate = HFGenerateEngine.generate

    def mismatched(self, prompts, n, *, temperature, return_logprobs=False, **kwargs):
        if return_logprobs:
            temperature = temperature * factor
        return generate(self, prompts, n, temperature=temperature, return_logprobs=return_logprobs, **kwargs)

    monkeypatch.setattr(HFGenerateEngine, "generate", mismatched)


def train(tmp_path, capsys, model, name, *overrides, steps=2):
    out = tmp_path / name
    code = main(["train", "--model", model, "--output-dir", str(out), "--max-steps", str(steps), *TINY_RUN,
                 *overrides])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    return [row for row in read_metrics(str(out / "metrics.jsonl")) if row["step"] >= 1]


def test_every_row_of_an_hf_run_carries_the_mismatch(tmp_path, capsys, tiny_model_dir):
    rows = train(tmp_path, capsys, tiny_model_dir, "hf", "rollout.engine=hf")
    assert len(rows) == 2
    for row in rows:
        assert all(isinstance(row.get(k), float) and math.isfinite(row[k]) for k in COLUMNS), row
        assert row["mismatch_logp_diff_max"] < 1e-4  # the engine generates with the policy itself: no mismatch
        assert row["mismatch_masked_token_frac"] == row["mismatch_masked_response_frac"] == 0.0


@pytest.mark.parametrize("algo", BUILTIN_OBJECTIVES)
@pytest.mark.parametrize("mode", ["token_mask", "sequence_mask"])
def test_each_masking_mode_trains_each_objective(tmp_path, capsys, monkeypatch, tiny_model_dir, algo, mode):
    sampler_at(monkeypatch, 1.3)
    band = ["advanced.rollout_correction.c_min=0.8", "advanced.rollout_correction.c_max=1.25"]
    rows = train(tmp_path, capsys, tiny_model_dir, f"{algo}-{mode}", "rollout.engine=hf", f"optim.algo={algo}",
                 f"advanced.rollout_correction.mode={mode}", *band, "rollout.prompts_per_step=4",
                 "rollout.group_size=4", "rollout.max_new_tokens=4")
    masked = "mismatch_masked_token_frac" if mode == "token_mask" else "mismatch_masked_response_frac"
    out = "mismatch_token_out_frac" if mode == "token_mask" else "mismatch_response_out_frac"
    assert all(row[masked] == pytest.approx(row[out]) for row in rows)  # what lies outside is what is dropped
    assert any(0 < row[masked] < 1 for row in rows), [(row[masked], row[out]) for row in rows]
    assert all(row["mismatch_kl"] > 1e-3 and math.isfinite(row["loss"]) for row in rows)
    assert all(row["grad_norm"] is None or math.isfinite(row["grad_norm"]) for row in rows)
    if algo == "pacs" and mode == "sequence_mask":  # through the loss's valid: its share of responses that count
        assert any(row["valid_frac"] < 1 for row in rows)


def test_sampler_temperature_makes_a_mismatched_sampler(tmp_path, capsys, tiny_model_dir):
    """advanced.rollout_correction.sampler_temperature: the rollouts sampled at 1.3, the trainer at 1.0 (the
    benchmark's mismatched sampler): the mismatch is measured (without it the engine is the policy: < 1e-4)."""
    rows = train(tmp_path, capsys, tiny_model_dir, "hot", "rollout.engine=hf",
                 "advanced.rollout_correction.sampler_temperature=1.3", steps=1)
    assert rows[0]["mismatch_logp_diff_max"] > 0.01 and rows[0]["mismatch_kl"] > 1e-4


@pytest.mark.parametrize("algo", BUILTIN_OBJECTIVES)
def test_truncate_modes_weigh_each_objectives_gradient(tmp_path, capsys, monkeypatch, tiny_model_dir, algo):
    """Same seed, same rollouts: token_truncate and sequence_truncate change the first step's gradient (the weights
    reach the loss), drop nothing, and train."""
    from pacs.tasks.base import Task

    sampler_at(monkeypatch, 1.3)
    # the random tiny model answers nothing right: a reward of its text's parity, so that groups mix labels
    monkeypatch.setattr(Task, "reward", lambda self, text, problem: float(sum(map(ord, text)) % 2))
    common = ["rollout.engine=hf", f"optim.algo={algo}", "rollout.prompts_per_step=4", "rollout.group_size=4",
              "rollout.max_new_tokens=4", "advanced.rollout_correction.c_max=1.2"]
    norms = {}
    for mode in ("none", "token_truncate", "sequence_truncate"):
        rows = train(tmp_path, capsys, tiny_model_dir, f"{algo}-{mode}", *common,
                     f"advanced.rollout_correction.mode={mode}", steps=1)
        assert rows[0]["mismatch_masked_token_frac"] == rows[0]["mismatch_masked_response_frac"] == 0.0
        assert math.isfinite(rows[0]["loss"]) and math.isfinite(rows[0]["grad_norm"])
        norms[mode] = rows[0]["grad_norm"]
    assert norms["token_truncate"] != pytest.approx(norms["none"], rel=1e-4), norms
    assert norms["sequence_truncate"] != pytest.approx(norms["none"], rel=1e-4), norms


@pytest.mark.slow
@pytest.mark.skipif(not vllm_available(), reason="vllm is not importable")
def test_every_row_of_a_vllm_run_carries_the_mismatch(tmp_path, capsys, tiny_model_dir):
    rows = train(tmp_path, capsys, tiny_model_dir, "vllm", "rollout.engine=vllm", "advanced.rollout.kv_cache_gib=0.1")
    assert len(rows) == 2
    for row in rows:
        assert all(isinstance(row.get(k), float) and math.isfinite(row[k]) for k in COLUMNS), row
        assert row["mismatch_logp_diff_max"] < 1e-2  # vLLM's float32 CPU kernels against the trainer's


def test_a_response_dropped_through_valid_moves_only_as_the_others_baseline():
    """docs/rollout-correction.md: under PACS's sequence_mask a dropped response j has g[j] = 0, so
    dloss/dr[j] = -sum_{i != j} g[i] / (G - 1), and the class weights are those of the kept responses."""
    from pacs_kernels import pacs_loss

    torch.manual_seed(0)
    G, T = 4, 5
    mask = torch.ones(G, T, dtype=torch.bool)
    mask[1, 3:] = False
    old = -torch.rand(G, T, dtype=torch.float64)
    logp = (old + 0.3 * torch.randn(G, T, dtype=torch.float64)).requires_grad_(True)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    valid = torch.tensor([True, True, False, True])
    pacs_loss(logp, old, rewards, mask, group_size=G, valid=valid).backward()
    r = ((logp - old) * mask).sum(1).detach()
    psi = r - (r.sum() - r) / (G - 1)
    w = torch.tensor([3 / (2 * 1), 3 / (2 * 2), 0.0, 3 / (2 * 2)], dtype=torch.float64)  # balanced over the kept 3
    g = w * (torch.sigmoid(psi) - rewards) / G
    d_r = g - (g.sum() - g) / (G - 1)
    torch.testing.assert_close(logp.grad, d_r[:, None] * mask, rtol=1e-9, atol=1e-12)
    assert g[2] == 0 and d_r[2] != 0  # no term of its own, still the others' baseline


def test_truncate_modes_with_split_groups_are_refused_by_name(tmp_path, capsys, monkeypatch, tiny_model_dir):
    """A group split over the token budget is a piece of the loss's batch, which takes no weights yet: the run
    stops with the mode named (docs/rollout-correction.md, "Not yet")."""
    from pacs.tasks.base import Task

    sampler_at(monkeypatch, 1.3)
    monkeypatch.setattr(Task, "reward", lambda self, text, problem: float(sum(map(ord, text)) % 2))  # mixed groups
    with pytest.raises(ValueError, match="rollout_correction.mode=token_truncate needs whole groups in a micro-batch"):
        main(["train", "--model", tiny_model_dir, "--output-dir", str(tmp_path / "split"), "--max-steps", "1",
              *TINY_RUN, "rollout.engine=hf", "advanced.rollout_correction.mode=token_truncate",
              "train.max_tokens_per_micro_batch=36", "rollout.group_size=8", "rollout.max_new_tokens=4"])
