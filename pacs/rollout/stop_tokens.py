"""The tokens a response ends at: every end token the model's files name, and the chat template's end of turn.

A tokenizer's own ``eos_token`` is not always where a reply ends. A base model trained on chat data (Qwen2.5-7B:
eos ``<|endoftext|>``) ends a turn of its chat template with ``<|im_end|>``; an instruct model's
``generation_config.json`` lists several ends (Llama 3: ``<|end_of_text|>``, ``<|eom_id|>``, ``<|eot_id|>``;
Gemma 2: ``<eos>``, ``<end_of_turn>``). A response that runs past its end goes on with an invented next turn,
whose text (special tokens dropped by the decoder) then reaches the reward: a right answer followed by
``user ... \\boxed{7}`` scores as 7. :func:`stop_token_ids` takes the union, in this order: the tokenizer's
eos, ``config.json``'s ``eos_token_id`` (one id or a list), ``generation_config.json``'s, and with a chat
template the special token that closes an assistant turn in it.
"""

from __future__ import annotations

PROBE = "PACS-END-OF-TURN-PROBE"  # an assistant turn's content, to find what the template puts after it


def stop_token_ids(tokenizer, model_dir: str | None, *, chat_template: bool,
                   trust_remote_code: bool = False) -> list[int]:
    """The ids generation stops at (see the module doc); never empty when the tokenizer has an eos."""
    ids: list[int] = []

    def add(value) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0 and v not in ids:
                ids.append(v)

    add(tokenizer.eos_token_id)
    if model_dir is not None:
        add(_config_eos(model_dir, trust_remote_code))
        add(_generation_config_eos(model_dir))
    if chat_template:
        add(end_of_turn_id(tokenizer))
    return ids


def end_of_turn_id(tokenizer) -> int | None:
    """The special token right after an assistant turn's content in the tokenizer's chat template (Qwen's
    ``<|im_end|>``, Llama 3's ``<|eot_id|>``, Gemma's ``<end_of_turn>``), or None (no template, or plain text
    after the content)."""
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": PROBE}], tokenize=False)
    except Exception:  # no chat template, or one that refuses this conversation
        return None
    if not isinstance(text, str) or PROBE not in text:
        return None
    after = tokenizer.encode(text[text.rindex(PROBE) + len(PROBE):], add_special_tokens=False)
    special = set(tokenizer.all_special_ids)
    special.update(i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
                   if getattr(token, "special", False))
    for token_id in after[:2]:  # the closing token, possibly after a space the template adds
        if token_id in special:
            return token_id
    return None


def _config_eos(model_dir: str, trust_remote_code: bool):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "eos_token_id", None)


def _generation_config_eos(model_dir: str):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir).eos_token_id
    except (OSError, ValueError):  # no generation_config.json
        return None
