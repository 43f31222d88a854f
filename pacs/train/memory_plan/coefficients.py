"""The planner's coefficients: bytes a decoder layer saves per token, the working memory beside them, and the
defaults of the kernels' chunk budgets it mirrors (tests keep each equal to the value it mirrors)."""

GiB = 2**30
MiB = 2**20

# bytes a decoder layer saves for the backward, per token, per element of: the hidden size, the query
# projection (heads x head_dim), the key and value projections together (per element of kv heads x
# head_dim), the MLP's
# intermediate size; plus per attention head (the softmax's float32 log-sum-exp) and a constant (the two
# RMSNorms' float32 inverse RMS). Counted with saved_tensors_hooks on transformers' Qwen2 decoder layer
# (docs/plan.md), for the three ways the trainer computes:
# A mixture-of-experts layer (transformers 5's Qwen3-MoE experts loop) saves, per token, its routed experts' MLP
# (expert_mlp per element of experts_per_token x moe_intermediate_size), a copy of the token's hidden state in and
# out of each routed expert (expert_hidden per element of experts_per_token x hidden) and the router's float32
# probabilities (expert, per expert); counted the same way on Qwen3-MoE layers of hidden 256 and 512 with 2 and 8
# of 16 experts (the marginal bytes per token between 512 and 1,024 tokens: docs/plan.md).
SAVED_BYTES = {
    # float32 parameters, float32 compute (the CPU's default)
    "float32": dict(hidden=24, query=12, key_value=8, mlp=16, head=4, token=8, expert_mlp=16, expert_hidden=8,
                    expert=4),
    # float32 master parameters under bf16 autocast (one process): the residual stream stays float32
    "autocast": dict(hidden=26, query=6, key_value=4, mlp=8, head=4, token=8, expert_mlp=15, expert_hidden=8,
                     expert=4),
    # 16-bit parameters in the forward (FSDP2's MixedPrecisionPolicy all-gathers bf16 copies)
    "16-bit": dict(hidden=16, query=6, key_value=4, mlp=8, head=4, token=8, expert_mlp=8, expert_hidden=4, expert=4),
}
# working memory on top of the saved tensors, calibrated against measured peaks (benchmarks/plan_accuracy.py).
# Only the larger of the two is held at once (the loss runs before the backward):
#   * a layer's backward: the gradients of its inputs and transients, in units of the layer's saved bytes
#     (with checkpointing, on top of the recomputed layer itself);
#   * the fused loss: its logits chunk (x LOSS_CHUNK_COPIES: a 16-bit GEMM's output before its float32
#     copy), what it holds of the LM head (loss_head_bytes), and LOSS_HIDDEN_COPIES copies of the (T, hidden)
#     states
BACKWARD_LAYERS = 0.5
LOSS_CHUNK_COPIES = {"float32": 1.0, "16-bit": 1.2}
LOSS_HIDDEN_COPIES = 10
# the no-grad old-policy pass's log-prob kernels hold this much of the logits at once: the torch backend's
# pacs_kernels.torch_chunked.DEFAULT_CHUNK_ELEMENTS float32 logits (a test keeps them equal; the Triton kernels less)
LOGPROB_CHUNK_BYTES = 4 * (1 << 22)
OLD_POLICY_PASS = "old-policy pass (no grad)"
FORWARD_COPIES = "forward (every layer's 16-bit copy, cached by autocast until its end)"
# CUDA's context, cuBLAS/NCCL workspaces and the caching allocator's slack: assumed (not measured here)
CUDA_RESERVE_GIB = 1.0
# pacs_kernels.engine.plan.DEFAULT_CHUNK_BUDGET_MIB (a test keeps them equal; this module imports no torch)
DEFAULT_LOSS_CHUNK_MIB = {"cuda": 2048.0, "cpu": 256.0}
# pacs_kernels.engine.device.RAISED_BUDGET_SHARE (a test keeps them equal): on the CPU, with no
# train.loss_chunk_mib, path="auto" may raise the chunk to hold a whole group or every token, up to this
# share of the memory; the plan counts that most (setting train.loss_chunk_mib pins the chunk)
RAISED_LOSS_CHUNK_SHARE = 1 / 8
# pacs_kernels.engine.device.CUDA_FREE_SHARE (a test keeps them equal): on CUDA, with no train.loss_chunk_mib,
# path="auto" may raise the chunk to hold a whole group or every token, up to this share of the memory free when
# the loss runs; the plan counts that most
CUDA_FREE_LOSS_CHUNK_SHARE = 1 / 4
