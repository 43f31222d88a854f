"""The policy model: loading it, packing and varlen attention, sequence parallelism, tiled MLP, memory levers,
LoRA, the reference policy, and the head's forward that feeds the kernels hidden states."""
