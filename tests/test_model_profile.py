"""The model profile (pacs/model/profile.py): every shipped config.json read as published, a transformers config read
as its config.json is, and no other module of pacs/ reading the keys of a model's configuration itself."""

import io
import os
import re
import tokenize

import pytest

from pacs import configs as shipped_configs
from pacs.model import profile as profile_module
from pacs.model.model_zoo import published_config
from pacs.model.profile import ModelProfile, load_profile

PACS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pacs")

# the published architectures (the models' cards and config.json on the Hugging Face hub)
PUBLISHED = {
    "gemma-2-2b-it": dict(hidden=2304, layers=26, heads=8, kv_heads=4, head_dim=256, vocab=256000,
                          tied_embeddings=True, logit_softcap=30.0, attention_softcap=50.0, sliding_window=4096,
                          max_positions=8192, norms_per_layer=4, experts=0),
    "llama-3.2-1b-instruct": dict(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, vocab=128256,
                                  tied_embeddings=True, logit_softcap=None, sliding_window=None,
                                  max_positions=131072, experts=0),
    "qwen2.5-0.5b-instruct": dict(hidden=896, layers=24, heads=14, kv_heads=2, head_dim=64, vocab=151936,
                                  tied_embeddings=True, qkv_bias=True, sliding_window=None, max_positions=32768),
    "qwen2.5-1.5b": dict(hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2, head_dim=128,
                         vocab=151936, tied_embeddings=True, qkv_bias=True, max_positions=131072),
    "qwen2.5-7b": dict(hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, head_dim=128, vocab=152064,
                       tied_embeddings=False, qkv_bias=True, explicit_head_dim=False, max_positions=131072),
    "qwen3-0.6b": dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, vocab=151936,
                       tied_embeddings=True, qk_norm=True, explicit_head_dim=True, max_positions=40960),
    "qwen3-30b-a3b": dict(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, vocab=151936,
                          tied_embeddings=False, experts=128, experts_per_token=8, expert_intermediate=768,
                          moe_layers=48, max_positions=40960),
}


def test_every_shipped_config_is_covered():
    assert sorted(PUBLISHED) == shipped_configs.model_names()


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_shipped_config_reads_as_published(name):
    profile = load_profile(name)
    assert profile.name == name and profile.missing == () and profile.logit_scale == 1.0
    for field, expected in PUBLISHED[name].items():
        assert getattr(profile, field) == expected, field
    profile.check_countable()


def test_the_planner_and_the_transformers_config_see_the_same_profile():
    """The trainer reads a loaded model's PretrainedConfig, the planner its config.json: one profile."""
    transformers = pytest.importorskip("transformers")
    for name in shipped_configs.model_names():
        data = published_config(name)
        config = transformers.AutoConfig.for_model(**data)
        from_object, from_dict = ModelProfile.from_config(config, name=name), ModelProfile.from_config(data, name=name)
        assert from_object.params == from_dict.params, name
        differing = [f for f in ("hidden", "heads", "kv_heads", "head_dim", "vocab", "tied_embeddings", "experts",
                                 "moe_layers", "max_positions", "logit_softcap", "attention_softcap", "sliding_window",
                                 "rotary", "model_type") if getattr(from_object, f) != getattr(from_dict, f)]
        assert differing == [], name


def test_a_multimodal_config_is_read_from_its_text_config():
    text = dict(model_type="gemma3_text", hidden_size=640, intermediate_size=2048, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                final_logit_softcapping=None, max_position_embeddings=32768)
    profile = ModelProfile.from_config(dict(model_type="gemma3", text_config=text, vision_config={}))
    assert (profile.model_type, profile.hidden, profile.vocab, profile.qk_norm, profile.norms_per_layer,
            profile.max_positions, profile.logit_softcap) == ("gemma3_text", 640, 262144, True, 4, 32768, None)


@pytest.mark.parametrize("extra, scale", [(dict(logit_scale=0.0625), 0.0625), (dict(logits_scaling=4.0), 0.25),
                                          (dict(model_type="hyperclovax", logits_scaling=4.0), 4.0),
                                          (dict(lm_head_multiplier=2.0), 2.0), ({}, 1.0)])
def test_logit_scale_is_read_as_the_model_code_applies_it(extra, scale):
    assert ModelProfile.from_config({"model_type": "granite", **extra}).logit_scale == scale


def test_a_config_without_sizes_gives_a_profile_the_planner_refuses_in_one_line():
    profile = ModelProfile.from_config(dict(model_type="whisper", d_model=512), name="whisper")
    assert profile.hidden == profile.heads == profile.head_dim == 0 and profile.max_positions is None
    assert profile.missing == ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size")
    with pytest.raises(ValueError, match=r"^--model: config.json lacks hidden_size, intermediate_size"):
        profile.check_countable()
    latent = ModelProfile.from_config(dict(published_config("qwen3-0.6b"), kv_lora_rank=512))
    with pytest.raises(ValueError, match="kv_lora_rank .*DeepSeek"):
        latent.check_countable()


def test_the_packing_flag_names_what_keeps_packed_rows_from_being_exact():
    class SupportsBackend:
        _supports_attention_backend = True

    gemma = load_profile("gemma-2-2b-it")
    assert "sliding window of 4096 tokens" in gemma.packing_obstacle("pacs_packed_sdpa", SupportsBackend)
    assert gemma.packing_obstacle("flash_attention_2", SupportsBackend) is None
    assert load_profile("qwen2.5-7b").packing_obstacle("pacs_packed_sdpa", SupportsBackend) is None
    assert "not a transformers model class" in load_profile("qwen3-0.6b").packing_obstacle("pacs_packed_sdpa", None)
    hybrid = ModelProfile.from_config(dict(model_type="qwen3_next", layer_types=["linear_attention",
                                                                                  "full_attention"]))
    assert hybrid.non_attention_layers == ("linear_attention",)
    assert "not attention (linear_attention" in hybrid.packing_obstacle("flash_attention_2", SupportsBackend)
    dynamic = ModelProfile.from_config(dict(model_type="llama", rope_parameters=dict(rope_type="dynamic")))
    assert "rope_type='dynamic'" in dynamic.packing_obstacle("flash_attention_2", SupportsBackend, left_padded=True)


# ------------------------------------------------------------------------- one place reads the configuration

# keys read in the profile module besides its get("...") calls
PROFILE_KEY_TUPLES = ("COUNTED_KEYS", "UNCOUNTED_KEYS", "POSITION_LIMIT_KEYS", "LOGIT_SCALE_KEYS", "LAYER_KIND_FIELDS")
# the same spellings where they are not a model configuration's key, with why
NOT_A_MODEL_CONFIG = {
    ("pacs/model/packed_attention.py", "sliding_window"): "the attention call's keyword argument",
    ("pacs/model/sequence_parallel.py", "sliding_window"): "the attention call's keyword argument",
    ("pacs/tasks/embedded.py", "hidden_size"): "the built-in task's own setting (task.hidden_size)",
    ("pacs/tasks/embedded.py", "intermediate_size"): "the built-in task's own setting (task.intermediate_size)",
    ("pacs/config", "hidden_size"): "the built-in task's own setting (task.hidden_size)",
    ("pacs/config", "intermediate_size"): "the built-in task's own setting (task.intermediate_size)",
}


def profile_keys() -> set[str]:
    with open(profile_module.__file__) as fh:
        keys = set(re.findall(r'get\("(\w+)"', fh.read()))
    return keys.union(*(getattr(profile_module, name) for name in PROFILE_KEY_TUPLES))


def config_key_reads(path: str, keys: set[str]) -> list[tuple[int, str]]:
    """(line, key) of each quoted key (``"vocab_size"``: a dict's or getattr's) and each attribute read of one
    on something named ``...config`` (``model.config.vocab_size``); keyword arguments (writing a config) pass."""
    with open(path) as fh:
        tokens = list(tokenize.generate_tokens(io.StringIO(fh.read()).readline))
    found = []
    for i, token in enumerate(tokens):
        if token.type == tokenize.STRING and token.string[:1] in "\"'" and token.string[1:-1] in keys:
            found.append((token.start[0], token.string[1:-1]))
        elif (token.type == tokenize.NAME and token.string in keys and i > 1 and tokens[i - 1].string == "."
              and tokens[i - 2].string.endswith("config")):
            found.append((token.start[0], token.string))
    return found


def test_the_profile_reads_the_keys_the_issue_names():
    assert {"final_logit_softcapping", "logit_scale", "tie_word_embeddings", "max_position_embeddings",
            "num_local_experts", "num_experts", "vocab_size", "model_type", "hidden_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "intermediate_size", "head_dim", "text_config",
            "rope_parameters", "sliding_window", "layer_types"} <= profile_keys()


def test_no_module_but_the_profile_reads_a_model_configs_keys():
    keys, offending = profile_keys(), []
    repo = os.path.dirname(PACS)
    for folder, _, files in os.walk(PACS):
        for name in sorted(files):
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, repo).replace(os.sep, "/")
            if not name.endswith(".py") or relative == "pacs/model/profile.py":
                continue
            offending += [f"{relative}:{line}: {key}" for line, key in config_key_reads(path, keys)
                          if not any(relative.startswith(where) and key == allowed
                                     for where, allowed in NOT_A_MODEL_CONFIG)]
    assert offending == [], "read these through pacs.model.profile.ModelProfile:\n" + "\n".join(offending)


def test_the_scan_finds_a_read(tmp_path):
    """The scan above is not vacuous: each way of reading a key is caught, writing one is not."""
    path = tmp_path / "reader.py"
    path.write_text('a = config["vocab_size"]\nb = getattr(model.config, \'tie_word_embeddings\', False)\n'
                    'c = model.config.max_position_embeddings\nd = dict(vocab_size=3)\n')
    assert config_key_reads(str(path), profile_keys()) == [(1, "vocab_size"), (2, "tie_word_embeddings"),
                                                           (3, "max_position_embeddings")]
