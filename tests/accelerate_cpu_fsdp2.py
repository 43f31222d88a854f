"""accelerate's FSDP2 on a CPU run (gloo), for the 2-process TRL test: the one step that differs from a GPU run.

What a user sets to train PACSTrainer with FSDP2 is TrainingArguments' ``fsdp=True`` with
``fsdp_config={"version": 2}`` (transformers 5.19's default version; the decoder layers are found
from the model's ``_no_split_modules``), then launches with torchrun. On an accelerator device
accelerate 1.15 then turns FSDP on in ``AcceleratorState.__init__`` (accelerate/state.py, the branch
``elif self.distributed_type in [DistributedType.MULTI_GPU, ..., DistributedType.MULTI_NEURON]``:
``self.distributed_type = DistributedType.FSDP; self.fsdp_plugin = fsdp_plugin``). A CPU run is
``DistributedType.MULTI_CPU``, which that list leaves out: the plugin is dropped without a word and
the Trainer wraps the model in DDP. No setting turns FSDP on for a CPU run: ``ACCELERATE_USE_FSDP=true``
meets the same branch, and ``use_cpu=False`` on a machine without an accelerator is no distributed
run at all (transformers: "Using fsdp only works in distributed training.").

``CPUFSDP2Trainer`` does, right after the Trainer built its Accelerator, what that branch does on a
GPU (the distributed type, the plugin with the run's mixed precision; and the Trainer's
``is_fsdp_enabled``, computed from them). From there on
the run is accelerate's, transformers' and TRL's own FSDP2 code: ``Accelerator.prepare`` ->
``fsdp2_prepare_model`` (``fully_shard`` per decoder layer, the input embedding, the final norm with
the LM head, then the root, on torch's default CPU mesh) and the optimizer's switch to the sharded
parameters. Test-only: the library does not patch accelerate.
"""

from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

from pacs.integrations.trl import PACSTrainer


class CPUFSDP2Trainer(PACSTrainer):
    """PACSTrainer whose accelerator runs FSDP2 on CPU; ``args`` must set ``fsdp`` (FSDP version 2)."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        plugin_args = self.args.fsdp_plugin_args
        if plugin_args is None or plugin_args.get("fsdp_version") != 2:
            raise ValueError(f"CPUFSDP2Trainer needs args with fsdp=True and FSDP version 2, got fsdp_plugin_args="
                             f"{plugin_args}")
        state = self.accelerator.state
        if state.distributed_type != DistributedType.MULTI_CPU:
            raise ValueError(f"CPUFSDP2Trainer is for a multi-process CPU run (torchrun, gloo), got distributed type "
                             f"{state.distributed_type}")
        plugin = FullyShardedDataParallelPlugin(**plugin_args)  # as the Trainer builds it
        state.distributed_type = DistributedType.FSDP  # from here: the branch of AcceleratorState.__init__
        if state.mixed_precision != "no":
            plugin.set_mixed_precision(state.mixed_precision)
        state.fsdp_plugin = plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState.__init__ ends
        self.is_fsdp_enabled = True
