"""Trainer building blocks: batch layout, lr schedule, the policy forward, old log-probs, HF engine."""


import pytest
import torch

from pacs.config import Config
from pacs.model.policy import check_model_path, load_policy
from pacs.rollout import HFGenerateEngine, make_rollout_engine
from pacs.tasks.embedded import build_model, build_tokenizer
from pacs.train.batch import build_batch
from pacs.train.old_policy import old_policy_logprobs
from pacs.train.start import lr_lambda


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_model")
    cfg = Config().task
    model = build_model(cfg, len(build_tokenizer()), seed=1)
    with torch.no_grad():  # random, non-trivial weights everywhere (norms included)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def test_build_batch_layout():
    batch = build_batch([[1, 5, 6], [1, 5, 6], [1, 7]], [[8, 2], [9], [4, 4, 2]], [1.0, 0.0, 1.0], pad_token_id=0)
    assert batch.input_ids.tolist() == [[1, 5, 6, 8, 2], [1, 5, 6, 9, 0], [1, 7, 4, 4, 2]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # position t predicts token t + 1: the mask marks positions whose target is a response token
    assert batch.mask.tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 0, 0], [0, 1, 1, 1, 0]]
    assert batch.targets[batch.mask].tolist() == [8, 2, 9, 4, 4, 2]
    part = batch.rows(1, 2)
    assert part.input_ids.shape == (1, 4) and part.rewards.tolist() == [0.0]


def test_lr_schedules():
    cfg = Config()
    cfg.optim.lr_warmup_steps, cfg.optim.lr_schedule = 2, "cosine"
    f = lr_lambda(cfg, 12)
    assert [f(0), f(1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0) and f(7) == pytest.approx(0.5) and f(12) == pytest.approx(0.0, abs=1e-12)
    cfg.optim.lr_schedule = "linear"
    assert lr_lambda(cfg, 12)(7) == pytest.approx(0.5)
    cfg.optim.lr_schedule = "constant"
    assert lr_lambda(cfg, 12)(9) == 1.0


def test_policy_forward_matches_hf_logits(tiny_model_dir):
    policy = load_policy(tiny_model_dir)
    ids = torch.randint(3, 17, (3, 7))
    attention = torch.ones_like(ids)
    attention[2, 5:] = 0
    hidden, weight, bias = policy(ids, attention)
    assert weight is policy.causal_lm.get_input_embeddings().weight  # tied embeddings
    logits = policy.causal_lm(input_ids=ids, attention_mask=attention).logits
    torch.testing.assert_close(hidden @ weight.T, logits, rtol=1e-5, atol=1e-5)
    # gradients reach the (tied) head weight through the returned tensor
    (hidden @ weight.T).logsumexp(-1).sum().backward()
    assert policy.causal_lm.get_input_embeddings().weight.grad.abs().sum() > 0


@pytest.mark.parametrize("packed", [False, True])
def test_old_policy_logprobs_match_log_softmax(tiny_model_dir, packed):
    policy = load_policy(tiny_model_dir, packed_attention=packed)
    batch = build_batch([[1, 5, 13, 6, 16]] * 2 + [[1, 7, 13, 8, 16]] * 2,
                        [[9, 4, 2], [3], [5, 5], [6, 2]], [1.0, 0.0, 1.0, 1.0], pad_token_id=0)
    old_logp, old_lse, entropy = old_policy_logprobs(policy, batch, [(0, 2), (2, 4)], temperature=0.7,
                                                     backend="auto", packed=packed)
    with torch.no_grad():
        logits = policy.causal_lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits / 0.7
    reference = logits.log_softmax(-1).gather(-1, batch.targets[..., None])[..., 0]
    torch.testing.assert_close(old_logp[batch.mask], reference[batch.mask], rtol=1e-5, atol=1e-5)
    assert (old_logp[~batch.mask] == 0).all()
    torch.testing.assert_close(old_lse[batch.mask], logits.logsumexp(-1)[batch.mask], rtol=1e-5, atol=1e-5)
    probs = logits.softmax(-1)
    ref_entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)[batch.mask].mean()
    assert entropy == pytest.approx(float(ref_entropy), rel=1e-4)


def test_hf_engine_sampling_is_per_row_seeded(tiny_model_dir):
    engine = HFGenerateEngine(tiny_model_dir, max_model_len=32, seed=0)
    prompts = [[1, 5, 13, 6, 16], [1, 7, 8, 13, 9, 16], [1, 4, 13, 4, 16]]
    opts = dict(temperature=1.0, top_p=1.0, max_new_tokens=6, stop_token_ids=[2])
    full = engine.generate(prompts, 3, seed=100, **opts)
    assert len(full) == 3 and all(len(g) == 3 for g in full)
    # the same rows sampled in a different batch (offset seed) give the same tokens
    tail = engine.generate(prompts[1:], 3, seed=103, **opts)
    assert tail == full[1:]
    assert engine.generate(prompts, 3, seed=100, **opts) == full
    for group in full:
        for response in group:
            assert 1 <= len(response) <= 6
            assert 2 not in response[:-1]  # cut right after the first stop token
    flat = [tuple(r) for g in full for r in g]
    assert len(set(flat)) > 1, "sampling at temperature 1 must vary"
    greedy = engine.generate(prompts, 1, temperature=0.0, top_p=1.0, max_new_tokens=6, stop_token_ids=[2])
    assert engine.generate(prompts, 1, temperature=0.0, top_p=1.0, max_new_tokens=6, stop_token_ids=[2]) == greedy
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        engine.generate(prompts, 1, temperature=0.0, top_p=1.0, max_new_tokens=40, stop_token_ids=[2])


def test_hf_engine_gumbel_noise_is_each_rows_own_stream_on_the_logits_device():
    """Row j's noise is -log(-log(U)) for U from its own generator seeded seed_j, drawn on the logits'
    device, step after step (on the CPU the same numbers as a CPU generator's: committed runs replay)."""
    from pacs.rollout.hf import _GumbelNoise

    seeds, vocab = [11, 5, 11], 7
    noise = _GumbelNoise(seeds)
    scores = torch.zeros(3, vocab)
    references = [torch.Generator().manual_seed(s) for s in seeds]
    for _ in range(3):  # consecutive decode steps continue each row's stream
        perturbed = noise(None, scores)
        assert perturbed.device == scores.device and perturbed.dtype == scores.dtype
        expected = torch.stack([-torch.log(-torch.log(torch.rand(vocab, generator=g, dtype=torch.float64)))
                                for g in references]).float()
        torch.testing.assert_close(perturbed, expected, rtol=0, atol=0)
    assert all(g.device == scores.device for g in noise.generators)
    torch.testing.assert_close(perturbed[0], perturbed[2], rtol=0, atol=0)  # same seed, same draws
    assert not torch.equal(perturbed[0], perturbed[1])


def test_hf_engine_sampling_frequencies_follow_softmax(tiny_model_dir):
    """The Gumbel sampler draws from softmax(logits / T) (first token, many rows)."""
    engine = HFGenerateEngine(tiny_model_dir, max_model_len=32)
    prompt = [1, 5, 13, 6, 16]
    out = engine.generate([prompt], 3000, seed=7, temperature=0.8, top_p=1.0, max_new_tokens=1,
                          stop_token_ids=[2])[0]
    counts = torch.bincount(torch.tensor([r[0] for r in out]), minlength=17).double() / 3000
    with torch.no_grad():
        probs = (engine.model(torch.tensor([prompt])).logits[0, -1] / 0.8).softmax(-1).double()
    assert (counts - probs).abs().max() < 0.04


def test_hf_engine_ignores_the_generation_configs_processors(tiny_model_dir, tmp_path):
    """A model directory whose generation_config.json sets a repetition penalty and a minimum length (instruct
    models ship such settings): the engine samples the policy itself, as the trainer scores it (before, the
    penalty reshaped every step's distribution and the minimum length forbade the stop token)."""
    import json
    import shutil

    penalized = tmp_path / "penalized"
    shutil.copytree(tiny_model_dir, penalized)
    (penalized / "generation_config.json").write_text(json.dumps(
        {"repetition_penalty": 3.0, "no_repeat_ngram_size": 1, "min_new_tokens": 6}))
    prompts = [[1, 5, 13, 6, 16], [1, 7, 8, 13, 9, 16]]
    opts = dict(temperature=1.0, top_p=1.0, max_new_tokens=6, stop_token_ids=[2], seed=5)
    plain = HFGenerateEngine(tiny_model_dir, max_model_len=32).generate(prompts, 8, **opts)
    assert HFGenerateEngine(str(penalized), max_model_len=32).generate(prompts, 8, **opts) == plain


def test_the_policy_drops_no_attention_weights(tmp_path):
    """A config's attention_dropout (applied by Hugging Face attention in training mode) is off in the policy:
    two passes over the same tokens agree, so the old log-probs and the loss's start from psi = 0."""
    import transformers

    config = transformers.Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.5)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    policy = load_policy(str(tmp_path))
    assert policy.training
    ids = torch.randint(0, 32, (2, 9))
    first, _, _ = policy(ids, torch.ones_like(ids))
    second, _, _ = policy(ids, torch.ones_like(ids))
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def test_hf_engine_sync_weights(tiny_model_dir):
    engine = HFGenerateEngine(tiny_model_dir, max_model_len=32)
    policy = load_policy(tiny_model_dir)
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(1.5)
    engine.sync_weights(policy.causal_lm.state_dict().items())
    for (name, a), b in zip(policy.causal_lm.state_dict().items(), engine.model.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    with pytest.raises(ValueError, match="no tensor named 'nope'"):
        engine.sync_weights([("nope", torch.zeros(1))])


def test_engine_choice_and_errors(tiny_model_dir, monkeypatch):
    import pacs.rollout as rollout

    notices = []
    monkeypatch.setattr(rollout, "vllm_available", lambda: False)
    engine = make_rollout_engine("auto", tiny_model_dir, max_model_len=32, log=notices.append)
    assert isinstance(engine, HFGenerateEngine) and "vLLM is not installed" in notices[0]
    with pytest.raises(ValueError, match="--rollout vllm was requested but vLLM cannot be imported"):
        make_rollout_engine("vllm", tiny_model_dir, max_model_len=32)
    with pytest.raises(ValueError, match="rollout engine must be one of auto, vllm, hf, or a user's rollout engine as "
                                         "module:Name"):
        make_rollout_engine("sglang", tiny_model_dir, max_model_len=32)


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not a model directory"):
        check_model_path(str(tmp_path / "nothing_here"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        check_model_path(str(tmp_path / "empty"))
    # a run directory: the Python API names the model inside it, as the CLI does
    (tmp_path / "run" / "final_model").mkdir(parents=True)
    (tmp_path / "run" / "final_model" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="the model in it is '.*final_model'"):
        check_model_path(str(tmp_path / "run"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("not json")
    with pytest.raises(ValueError, match="cannot load a model config"):
        check_model_path(str(tmp_path / "bad"))


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model_dir):
    ids = torch.randint(3, 17, (2, 9))
    attention = torch.ones_like(ids)
    grads = []
    for checkpointing in (False, True):
        policy = load_policy(tiny_model_dir, gradient_checkpointing=checkpointing)
        hidden, weight, _ = policy(ids, attention)
        (hidden @ weight.T).logsumexp(-1).sum().backward()
        grads.append([p.grad.clone() for p in policy.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
