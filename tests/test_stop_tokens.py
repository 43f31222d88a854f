"""Where responses end (pacs/rollout/stop_tokens.py): the tokenizer's eos, the ends config.json and
generation_config.json name, and the chat template's end of turn; a response sampled past the end of its
turn would carry an invented next turn into the reward."""

import json

import pytest

from pacs.rollout.stop_tokens import end_of_turn_id, stop_token_ids

# a Qwen-style chat template: each turn closes with <|im_end|>
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<pad>", "<|endoftext|>", "<|im_end|>", "<|im_start|>", "<|eom|>"]  # ids 0-4


def byte_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """One token per byte after the specials; eos <|endoftext|> (1), as a base model's tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(SPECIAL + alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<|endoftext|>",
                                        additional_special_tokens=["<|im_end|>", "<|im_start|>", "<|eom|>"])
    tokenizer.chat_template = chat_template
    return tokenizer


def model_dir(tmp_path, config_eos, generation_eos=None):
    import transformers

    config = transformers.Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=config_eos)
    config.save_pretrained(tmp_path)
    if generation_eos is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return str(tmp_path)


def test_the_chat_templates_end_of_turn_is_found():
    tokenizer = byte_tokenizer()
    assert tokenizer.eos_token_id == 1 and end_of_turn_id(tokenizer) == 2  # <|im_end|>, not the eos
    assert end_of_turn_id(byte_tokenizer(chat_template=None)) is None
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"  # no special token closes
    assert end_of_turn_id(byte_tokenizer(chat_template=plain)) is None


@pytest.mark.parametrize("chat_template,expected", [(True, [1, 4, 2]), (False, [1, 4])])
def test_every_end_the_model_files_name_stops_a_response(tmp_path, chat_template, expected):
    """A base model's tokenizer (eos <|endoftext|>) with a generation config listing <|eom|> too: the run stops
    at each, and at <|im_end|> where prompts go through the chat template (before: at the eos alone, so a
    reply went on past its turn)."""
    directory = model_dir(tmp_path, config_eos=1, generation_eos=[4, 1])
    assert stop_token_ids(byte_tokenizer(), directory, chat_template=chat_template) == expected


def test_a_model_directory_without_a_generation_config(tmp_path):
    directory = model_dir(tmp_path, config_eos=[1, 2])
    assert stop_token_ids(byte_tokenizer(), directory, chat_template=False) == [1, 2]
    assert stop_token_ids(byte_tokenizer(), None, chat_template=False) == [1]


def test_a_reply_cut_at_its_turn_scores_what_it_answered(tmp_path):
    """What the stop set prevents: the text of a reply sampled past its turn, as the reward reads it."""
    from pacs.tasks.rewards import math_verify_check

    tokenizer = byte_tokenizer()
    sampled = tokenizer.encode("So \\boxed{5}.<|im_end|>\n<|im_start|>user\nAnother: \\boxed{7}",
                               add_special_tokens=False)
    stops = set(stop_token_ids(tokenizer, model_dir(tmp_path, config_eos=1), chat_template=True))
    cut = next(j + 1 for j, t in enumerate(sampled) if t in stops)
    assert math_verify_check(tokenizer.decode(sampled[:cut], skip_special_tokens=True), "5", 10) == (1.0, "ok")
    assert math_verify_check(tokenizer.decode(sampled, skip_special_tokens=True), "5", 10) == (0.0, "ok")
