"""Mixed precision (pacs/model/mixed_precision.py): float32 master weights under 16-bit compute train at the PACS
paper's learning rate, 16-bit weights stepped directly do not (and say so), and update_nonzero_frac
(pacs/train/weight_updates.py) shows which is happening. On 1 process and on 2 FSDP2 ranks."""

import json
import os
import warnings

import pytest
import torch
import transformers
from tiny_models import save_tiny_qwen2
from trainer_helpers import repo_root, run_torchrun

from pacs.config import load_config, validate
from pacs.model.mixed_precision import Precision, half_ulp, resolve_precision, share_frozen_by_rounding
from pacs.model.policy import load_policy
from pacs.run.export import export_hf
from pacs.train.weight_updates import UpdateMonitor


def tiny_model_dir(path) -> str:
    """A 2-layer Qwen2 (hidden 64, grouped key/value heads, tied embeddings), HF's own initialization, float32."""
    return save_tiny_qwen2(path, hidden_size=64, intermediate_size=128, head_dim=16, tie_word_embeddings=True)


# ---------------------------------------------------------------- rounding


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_ulp_is_where_an_update_starts_to_move_a_16_bit_weight(dtype):
    weights = (torch.randn(2000, dtype=torch.float64) * 0.05).to(dtype)  # on the dtype's grid
    weights = weights[weights != 0]
    tiny = torch.finfo(dtype).tiny
    assert half_ulp(torch.tensor([tiny / 4]), dtype).item() == tiny * torch.finfo(dtype).eps / 2  # subnormal
    # away from 0 (toward 0 the spacing halves at a power of two: half_ulp is the larger of the two)
    h = half_ulp(weights, dtype).double() * weights.sign().double()
    assert bool((h != 0).all())
    stays = (weights.double() + 0.99 * h).to(dtype)
    moves = (weights.double() + 1.01 * h).to(dtype)
    assert torch.equal(stays, weights)
    assert not bool((moves == weights).any())
    assert half_ulp(torch.zeros(3), dtype).tolist() == [0.0, 0.0, 0.0]  # a weight of 0 always moves


def test_adamw_at_lr_1e6_moves_float32_weights_and_almost_no_bfloat16_weights():
    """The measurement behind the warning: a 1024 x 1024 layer, 10 AdamW steps at lr 1e-6."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(1024, 1024, bias=False)
    grads = [torch.randn(1024, 1024) for _ in range(10)]
    moved = {}
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.nn.Parameter(layer.weight.detach().to(dtype).clone())
        start = weight.detach().clone()
        optimizer = torch.optim.AdamW([weight], lr=1e-6, weight_decay=0.0)
        for g in grads:
            weight.grad = g.to(dtype)
            optimizer.step()
        moved[dtype] = float((weight.detach() != start).double().mean())
        # the estimate from the weights alone, before any step
        frozen = share_frozen_by_rounding([torch.nn.Parameter(start)], 1e-6, sample=1 << 20)
        assert (frozen < 0.001) if dtype == torch.float32 else (frozen > 0.95), (dtype, frozen)
    assert moved[torch.float32] > 0.999, moved  # measured 99.99%
    assert moved[torch.bfloat16] < 0.05, moved  # measured 1.5%


def test_precision_settings_are_checked():
    assert resolve_precision(torch.bfloat16, "float32") == Precision(torch.bfloat16, torch.float32)
    assert resolve_precision(torch.bfloat16, "float32").mixed
    assert resolve_precision(torch.bfloat16, "bfloat16").steps_16_bit_weights
    assert not resolve_precision(torch.float32, "float32").mixed
    with pytest.raises(ValueError, match=r"optim.master_dtype='bfloat16' needs model.dtype='bfloat16'.*float32 here"):
        resolve_precision(torch.float32, "bfloat16")
    with pytest.raises(ValueError, match=r"optim.master_dtype must be one of .*got 'fp32'"):
        resolve_precision(torch.float32, "fp32")
    with pytest.raises(ValueError, match=r"optim.master_dtype must be one of"):
        validate(load_config(None, ["optim.master_dtype=float64"]))
    with pytest.raises(ValueError, match=r"needs model.dtype='float16', got model.dtype='bfloat16'"):
        validate(load_config(None, ["model.dtype=bfloat16", "optim.master_dtype=float16"]))
    cfg = load_config(None, ["model.dtype=bfloat16"])
    validate(cfg)
    assert cfg.optim.master_dtype == "float32"
    # float16 compute without a loss scale: a gradient of 1e-8 is 0 in float16, so small gradients vanished
    assert torch.tensor(1e-8).to(torch.float16) == 0
    for master in ("float32", "float16"):
        with pytest.raises(ValueError, match=r"model.dtype='float16': training in float16 needs loss scaling"):
            resolve_precision(torch.float16, master)


# ---------------------------------------------------------------- update_nonzero_frac


def test_update_monitor_counts_the_weights_a_step_changed_among_those_with_a_gradient():
    torch.manual_seed(0)
    big, small = torch.nn.Parameter(torch.randn(300, 40)), torch.nn.Parameter(torch.randn(10))
    monitor = UpdateMonitor([big, small], per_tensor=256)
    big.grad, small.grad = torch.randn_like(big), torch.randn_like(small)
    big.grad[:150] = 0  # half of the big tensor has no gradient: not counted
    monitor.before()
    with torch.no_grad():
        big[150:] -= 0.1 * big.grad[150:]  # every element with a gradient moves in the big tensor
    # 6,000 elements with a gradient moved, the small tensor's 10 did not: it weighs its size, not a tensor's
    assert monitor.after() == pytest.approx(6000 / 6010, abs=0.01)
    monitor.before()
    assert monitor.after() == 0.0  # nothing moved
    big.grad = small.grad = None
    monitor.before()
    assert torch.isnan(torch.tensor(monitor.after()))  # no element had a gradient


# ---------------------------------------------------------------- the policy


def test_bfloat16_compute_over_float32_master_weights_on_one_process(tmp_path):
    model_dir = tiny_model_dir(tmp_path / "model")
    policy = load_policy(model_dir, dtype="bfloat16")  # optim.master_dtype's default: float32
    assert policy.precision == Precision(compute=torch.bfloat16, master=torch.float32)
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    ids = torch.randint(3, 48, (2, 9))
    hidden, weight, bias = policy(ids, torch.ones_like(ids))
    assert hidden.dtype == weight.dtype == torch.bfloat16 and bias is None  # the fused loss's 16-bit path
    (hidden.float() @ weight.float().T).logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in policy.parameters())
    # the same forward as the model cast to bfloat16, up to autocast's float32 norms and residual stream
    plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    expected = plain.get_decoder()(input_ids=ids).last_hidden_state
    assert (hidden.float() - expected.float()).abs().max() < 0.1 * expected.float().abs().max()

    pure = load_policy(model_dir, dtype="bfloat16", master_dtype="bfloat16")
    assert {p.dtype for p in pure.parameters()} == {torch.bfloat16} and pure.autocast_dtype is None
    assert load_policy(model_dir).precision == Precision(torch.float32, torch.float32)  # CPU default unchanged


def test_export_writes_the_compute_dtype(tmp_path):
    policy = load_policy(tiny_model_dir(tmp_path / "model"), dtype="bfloat16")
    export_hf(policy, None, str(tmp_path / "export"))
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype="auto")
    assert loaded.dtype == torch.bfloat16
    for (name, a), (_, b) in zip(policy.causal_lm.named_parameters(), loaded.named_parameters()):
        torch.testing.assert_close(b, a.detach().to(torch.bfloat16), rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------- 20 updates at lr 1e-6


def run_worker(tmp_path, model_dir, nproc: int, model_dtype: str, master_dtype: str) -> dict:
    out = tmp_path / f"{nproc}_{model_dtype}_{master_dtype}.pt"
    run_torchrun([os.path.join(repo_root(), "tests", "mixed_precision_worker.py"), out, model_dir, model_dtype,
                  master_dtype], f"20 updates ({model_dtype} compute, {master_dtype} master) on {nproc} rank(s)",
                 nproc=nproc)
    return torch.load(out)


def moved_share(run: dict) -> float:
    changed = sum(int((run["final"][n] != run["initial"][n]).sum()) for n in run["final"])
    return changed / sum(t.numel() for t in run["final"].values())


def weight_change(run: dict) -> torch.Tensor:
    return torch.cat([(run["final"][n] - run["initial"][n]).flatten().double() for n in sorted(run["final"])])


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_twenty_updates_at_lr_1e6_train_with_master_weights_and_not_without(tmp_path, nproc):
    """The reference of the log-ratio is the initial policy, so the loss falls as the weights learn: float32
    from 0.6931 to 0.6767 in 20 steps (1 process and 2 ranks alike)."""
    model_dir = tiny_model_dir(tmp_path / "model")
    full = run_worker(tmp_path, model_dir, nproc, "float32", "float32")
    mixed = run_worker(tmp_path, model_dir, nproc, "bfloat16", "float32")
    pure = run_worker(tmp_path, model_dir, nproc, "bfloat16", "bfloat16")
    assert full["world_size"] == mixed["world_size"] == pure["world_size"] == nproc
    assert mixed["param_dtypes"] == ["torch.float32"] and pure["param_dtypes"] == ["torch.bfloat16"]
    assert full["losses"][0] - full["losses"][-1] > 0.01  # float32 learns (measured 0.0164)

    # float32 master weights, bfloat16 compute: every weight moves, the way float32 training moves it
    assert moved_share(mixed) > 0.99  # measured 1.0
    assert min(mixed["update_nonzero_frac"]) > 0.99
    cosine = torch.nn.functional.cosine_similarity(weight_change(mixed), weight_change(full), dim=0)
    assert cosine > 0.99, cosine  # measured 0.9986 (1 process), 0.9981 (2 ranks)
    # the loss tracks float32's within bfloat16's log-prob rounding (measured at most 5e-4 / 9e-4 apart)
    assert max(abs(a - b) for a, b in zip(mixed["losses"], full["losses"])) < 3e-3
    assert mixed["said"] == ""

    # bfloat16 weights stepped directly (asked for by name): almost nothing moves, the loss stays, and it warned
    assert moved_share(pure) < 0.05  # measured 2.3%
    assert max(pure["update_nonzero_frac"]) < 0.05  # measured 1.6% / 2.6%
    assert pure["losses"][0] - pure["losses"][-1] < 0.002  # measured 0.0003
    assert "optim.master_dtype=bfloat16" in pure["said"] and "rounds away" in pure["said"]
    assert float(pure["said"].split("lr 1e-06, ")[1].split("%")[0]) > 90  # measured 97.5% of weights frozen


# ---------------------------------------------------------------- PACSTrainer


@pytest.mark.slow
def test_pacs_trainer_warns_for_a_bfloat16_model_at_a_rate_that_rounds_away_and_logs_update_nonzero_frac(tmp_path):
    pytest.importorskip("trl")
    import trl_helpers as helpers

    tok = helpers.tokenizer()
    with pytest.warns(UserWarning, match=r"PACSTrainer: AdamW steps bfloat16 weights directly; at lr 1e-06, "
                                         r"\d+\.\d% of them"):
        helpers.trainer(tmp_path / "bf16", model=helpers.tiny_model(len(tok)).to(torch.bfloat16), learning_rate=1e-6,
                        max_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        from pacs.integrations.trl import warn_if_updates_round_away

        assert warn_if_updates_round_away(helpers.tiny_model(len(tok)), 1e-6) == 0.0  # float32: silent
    trainer = helpers.trainer(tmp_path / "fp32", learning_rate=1e-6, max_steps=2)
    trainer.train()
    fractions = [row["update_nonzero_frac"] for row in trainer.state.log_history if "loss" in row]
    assert len(fractions) == 2 and min(fractions) > 0.99, fractions


# ---------------------------------------------------------------- pacs train


@pytest.mark.slow
def test_pacs_train_in_bfloat16_keeps_float32_weights_resumes_exactly_and_exports_bfloat16(tmp_path):
    from trainer_helpers import comparable, tiny_config

    from pacs.train import train
    from pacs.train.metrics import read_metrics

    cache = tmp_path / "cache"
    steps = ["rollout.engine=hf", "model.dtype=bfloat16", "checkpoint_every=2", "optim.lr_schedule=constant"]
    full = train(tiny_config(tmp_path / "full", cache, "max_steps=4", *steps))
    assert {p.dtype for p in full.policy.parameters()} == {torch.float32}
    assert full.policy.autocast_dtype == torch.bfloat16
    rows = read_metrics(str(tmp_path / "full" / "metrics.jsonl"))[1:]
    assert len(rows) == 4 and min(row["update_nonzero_frac"] for row in rows) > 0.99  # (AdamW's
    # small steps let a few float32 weights round: measured 0.99998)
    exported = json.loads((tmp_path / "full" / "final_model" / "config.json").read_text())
    assert exported["dtype"] == "bfloat16"
    # stopped after step 2, resumed from its checkpoint (float32 master weights and AdamW state): the same run
    train(tiny_config(tmp_path / "part", cache, "max_steps=2", *steps))
    train(tiny_config(tmp_path / "part", cache, "max_steps=4", "advanced.resume=true", *steps))
    assert comparable(read_metrics(str(tmp_path / "part" / "metrics.jsonl"))) == comparable(
        read_metrics(str(tmp_path / "full" / "metrics.jsonl")))
