"""The ``train`` section: long responses on limited memory (pacs/model/packing.py, pacs/model/memory.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pacs.config.fields import check_section, setting

TOKENS = "a positive number of tokens or None"


@dataclass
class TrainConfig:
    """Long responses on limited memory (pacs/model/packing.py, pacs/model/memory.py)."""

    TRAINING_ONLY: ClassVar[bool] = True  # pacs eval reads none of it

    packing: bool | None = setting(
        None, "padding-free packed micro-batches; None: on wherever packed rows compute what padded rows do for the "
        "model (every objective's loss takes that layout)")
    max_tokens_per_micro_batch: int | None = setting(
        None, "token budget per micro-batch (whole groups, packed greedily); None: optim.micro_batch_groups counts",
        above=0, expect=TOKENS)
    old_policy_max_tokens: int | None = setting(
        None, "token budget of each no-grad old-policy chunk; None: the training micro-batches", above=0,
        expect=TOKENS, advanced=True)
    loss_chunk_mib: float | None = setting(
        None, "the fused loss's logits working memory (chunk_budget_mib); None: 2 GiB on CUDA, 256 MiB on the CPU, "
        'which path="auto" may raise to hold every token or a group (up to a quarter of the free GPU memory, '
        "1/8 of the CPU's); lower it for long responses on little memory (a group over it is rebuilt in part)", above=0,
        expect="a positive number of MiB or None")
    offload_activations: bool = setting(False, "tensors saved for the backward go to host memory")
    fsdp_cpu_offload: bool = setting(False, "FSDP2 CPUOffloadPolicy: params, grads, optimizer state on the host")
    liger_patches: bool = setting(False, "CUDA: Liger-Kernel RMSNorm, SwiGLU, RoPE in the model (never its loss)")
    tiled_mlp: bool = setting(False, "each decoder MLP over tiles of tokens, only its input kept "
                              "(pacs/model/tiled_mlp.py)")
    mlp_tile_tokens: int | None = setting(None, "tokens per MLP tile; None: the model's hidden size", above=0,
                                          expect=TOKENS, advanced=True)
    skip_zero_gradient_groups: bool = setting(
        True, "PACS: no forward/backward for groups whose gradient is exactly 0 (single-label groups on the first "
        "mini-batch after a reset; every mini-batch with optim.drop_single_label_groups): "
        "pacs/train/single_label_groups.py", advanced=True)
    preflight: bool | None = setting(None, "run the longest step the settings allow before the first rollout "
                                     "(pacs/train/preflight.py); None: on CUDA", advanced=True)
    sequence_parallel_size: int = setting(
        1, "ranks that split each packed micro-batch's tokens (Ulysses attention, pacs/model/sequence_parallel.py): "
        "the longest response grows with it", at_least=1, expect="a positive integer")
    distributed_timeout_minutes: float | None = setting(
        None, "how long a rank waits in a collective for the others (torchrun); None: torch's default (NCCL 10 min); "
        "raise it when one rank's generation may outlast another's by more", above=0,
        expect="a positive number of minutes or None", advanced=True)

    def check(self) -> None:
        check_section(self, "train.")
        sp = self.sequence_parallel_size
        if sp > 1 and self.packing is False:
            raise ValueError(f"train.sequence_parallel_size={sp} splits packed micro-batches: it needs train.packing "
                             f"(got {self.packing!r}); set train.packing=true or leave it unset")
