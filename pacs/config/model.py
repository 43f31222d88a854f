"""The ``model`` section: which model is trained, in which dtype, and its LoRA adapters (``model.lora``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pacs.config.fields import check_section, section, setting

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class LoraConfig:
    """LoRA adapters instead of full fine-tuning (pacs/model/lora.py); rank 0: off."""

    TRAINING_ONLY: ClassVar[bool] = True  # pacs eval reads none of it

    rank: int = setting(0, "adapter rank; 0: full fine-tuning", at_least=0)
    alpha: float = setting(16.0, "the adapters' output is scaled by alpha / rank", above=0)
    target_modules: str = setting("all-linear", "every linear layer but the LM head, or comma-separated names "
                                  "(q_proj,v_proj)")

    def check(self) -> None:
        check_section(self, "model.lora.")
        if not self.target_modules.strip(" ,"):
            raise ValueError("model.lora.target_modules must name modules ('all-linear' or e.g. 'q_proj,v_proj'), "
                             "got ''")


@dataclass
class ModelConfig:
    path: str = setting("embedded", '"embedded" (the task builds a tiny model) or an HF dir / hub id')
    dtype: str = setting("auto", "auto: bfloat16 on GPU, float32 on CPU | float32 | bfloat16 | float16",
                         choices=DTYPES)
    gradient_checkpointing: bool = setting(False, "each decoder layer keeps only its input; the rest is recomputed",
                                           training_only=True)
    trust_remote_code: bool = setting(False, "let transformers run the model repository's own code", advanced=True)
    lora: LoraConfig = section(LoraConfig)

    def check(self) -> None:
        check_section(self, "model.")
        self.lora.check()
