"""Tiled MLP: each decoder layer's MLP run over tiles of tokens, keeping only its input for the backward.

A decoder layer's MLP is token-wise: y_t = W_down (act(W_gate x_t) * (W_up x_t)) for every token t
on its own. Run over all T tokens at once, autograd keeps four (T, I) tensors for the backward
(the two projections, the activation, their product; I = intermediate size, 3.5-6 times d in
today's models), and the same again while the backward runs. At long context that is the largest
activation of the layer: with gradient checkpointing it is the peak of every layer's recompute
(Qwen2.5-1.5B, T = 128k tokens, bf16: about 9 GB per layer against 0.4 GB for the layer's input).

Because the map is token-wise, the MLP can be run over tiles of ``tile_tokens`` tokens (the idea of
Arctic Long Sequence Training's TiledMLP):

  forward   y[tile] = mlp(x[tile]) for each tile, under no_grad: only x is saved (T x d);
  backward  for each tile, recompute mlp(x[tile]) with autograd on and take
            dx[tile] = (d y[tile] / d x[tile])^T g[tile],
            dW      += (d y[tile] / d W)^T g[tile]       for every parameter W of the MLP;
            exact, since y[tile] depends on x[tile] and W only: sum over tiles of the per-tile
            gradients is the gradient over all tokens (only the order of the float sums changes).

The peak for the MLP drops from 4 to 8 (T, I) tensors to 4 to 8 (tile, I) tensors plus x and dx.
Cost: one more MLP forward per layer (its backward recomputes it; with gradient checkpointing the
checkpoint's own recompute runs the tiled forward first). Parameter gradients are summed over tiles
in float32 for 16-bit parameters, then cast, as one large matmul's accumulator would. A dropout
inside the MLP (a LoRA adapter's) draws the forward's masks again in the backward: the random state
is replayed, as torch.utils.checkpoint does. The MLP must map (..., d) to (..., d') token by token:
every Hugging Face dense decoder MLP (Llama, Qwen2/3, Mistral, Gemma) does. Parameters (and their
names) are unchanged: checkpoints, exports and vLLM weight sync see the same model; a PEFT adapter
inside the MLP trains through it. A pickled model comes back untiled (pickle keeps the class's
forward): call tile_mlp again, as after any later patch of the MLP's forward.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from pacs.model.layers import decoder_layers
from pacs.model.model_forward import unbound_forward
from pacs.model.profile import ModelProfile


class TiledMLPFunction(torch.autograd.Function):
    """y = mlp(x) over tiles of tokens (module doc). Inputs: the MLP module, the function that runs
    its untiled forward as (module, x) -> y, tokens per tile, x (..., d), then the MLP's parameters
    (so that autograd hands their gradients back through this function)."""

    @staticmethod
    def forward(ctx, mlp, inner_forward, tile_tokens, x, *params):
        # the random state the tiles start from: the backward replays it, so that a dropout inside
        # the MLP (a LoRA adapter's, say) draws the forward's masks again, tile by tile
        ctx.rng = _rng_state(x.device)
        with torch.no_grad():
            out = tiled_forward(mlp, inner_forward, tile_tokens, x)
        ctx.mlp, ctx.inner_forward, ctx.tile_tokens, ctx.n_params = mlp, inner_forward, tile_tokens, len(params)
        ctx.autocast = _autocast_state(x.device.type)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # double backward: a clear error, not a wrong answer
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        flat = x.detach().reshape(-1, x.shape[-1])
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])
        # the module's parameters now (FSDP2 has gathered them again for the backward), in input order
        params = list(ctx.mlp.parameters())
        if len(params) != ctx.n_params:
            raise RuntimeError(f"tiled MLP: {type(ctx.mlp).__name__} had {ctx.n_params} parameters in the forward "
                               f"and has {len(params)} in the backward: do not add or remove its parameters mid-step")
        wanted = [i for i, p in enumerate(params) if ctx.needs_input_grad[4 + i]]
        need_x = ctx.needs_input_grad[3]
        grad_x = torch.empty_like(flat) if need_x else None
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        with _replayed_rng(x.device, ctx.rng):
            for start in range(0, flat.shape[0], ctx.tile_tokens):
                tile = flat[start:start + ctx.tile_tokens].detach().requires_grad_(need_x)
                with torch.enable_grad(), _autocast(ctx.autocast):
                    y = ctx.inner_forward(ctx.mlp, tile)
                inputs = ([tile] if need_x else []) + [params[i] for i in wanted]
                grads = torch.autograd.grad(y, inputs, grad_flat[start:start + tile.shape[0]], allow_unused=True)
                if need_x:
                    grad_x[start:start + tile.shape[0]] = grads[0]
                    grads = grads[1:]
                for j, g in enumerate(grads):
                    if g is None:
                        continue
                    g = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g
                    sums[j] = g if sums[j] is None else sums[j].add_(g)
        grad_params: list[torch.Tensor | None] = [None] * len(params)
        for j, i in enumerate(wanted):
            if sums[j] is not None:
                grad_params[i] = sums[j].to(params[i].dtype)
        return (None, None, None, grad_x.reshape(x.shape) if need_x else None, *grad_params)


def tiled_forward(mlp, inner_forward, tile_tokens: int, x: torch.Tensor) -> torch.Tensor:
    """mlp(x) as the concatenation of mlp(tile) over tiles of ``tile_tokens`` tokens (x: (..., d), at
    least one token), into one preallocated output."""
    flat = x.reshape(-1, x.shape[-1])
    out = None
    for start in range(0, flat.shape[0], tile_tokens):
        y = inner_forward(mlp, flat[start:start + tile_tokens])
        if out is None:
            _check_output(y, flat[start:start + tile_tokens], mlp)
            out = y.new_empty(flat.shape[0], y.shape[-1])
        out[start:start + y.shape[0]] = y
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype] | None:
    """The autocast state the forward ran under (None where the device has no autocast), to
    recompute the tiles under the same one."""
    if not torch.amp.is_autocast_available(device_type):
        return None
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _autocast(state):
    if state is None:
        return contextlib.nullcontext()
    device_type, enabled, dtype = state
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)


def _rng_state(device: torch.device) -> tuple:
    """The CPU generator's state, and the device's when it is CUDA."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def _replayed_rng(device: torch.device, state: tuple):
    """Run the block from ``state`` (as :func:`_rng_state` took it), then put the generators back as
    they were: the rest of the backward and of training draws what it would have drawn."""
    cpu, cuda = state
    with torch.random.fork_rng(devices=[device] if cuda is not None else [], device_type="cuda"):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


def _check_output(y, x, mlp) -> None:
    if not isinstance(y, torch.Tensor) or y.shape[:-1] != x.shape[:-1]:
        raise ValueError(
            f"tiled MLP: {type(mlp).__name__}'s forward must map (tokens, d) to (tokens, d') token by token "
            f"to be tiled; it returned {type(y).__name__}"
            + (f" of shape {tuple(y.shape)} for input {tuple(x.shape)}" if isinstance(y, torch.Tensor) else "")
            + " (a mixture-of-experts or other non-token-wise MLP cannot be tiled: turn the tiled MLP off)")


def is_tiled(mlp: nn.Module) -> bool:
    """Does ``mlp`` run its tiled forward now (not only carry a tile size, as after pickling)?"""
    return bool(getattr(mlp.__dict__.get("forward"), "tiles_the_mlp", False))


def tile_mlp(causal_lm: nn.Module, tile_tokens: int | None = None, *,
             setting: str = "train.mlp_tile_tokens") -> int:
    """Run every decoder layer's ``mlp`` of ``causal_lm`` over tiles of ``tile_tokens`` tokens
    (default: the model's hidden size, so that one tile's (tile, I) intermediate is about the size of
    one MLP weight). In place; returns the number of MLPs tiled. Any trainer can call it on a Hugging
    Face model (TRL: ``PACSConfig(pacs_tiled_mlp=True)``; verl, a plain loop), best before FSDP wrapping.
    ``setting`` is the name errors give the tile size (the caller's config key)."""
    if tile_tokens is None:  # multimodal configs keep the decoder's sizes in their text config (the profile's)
        tile_tokens = ModelProfile.from_config(causal_lm.config).hidden or None
        if tile_tokens is None:
            raise ValueError(f"tiled MLP: {type(causal_lm).__name__}'s config has no hidden_size for the default tile: "
                             f"set {setting}")
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"{setting} must be a positive integer (tokens per MLP tile), got {tile_tokens!r}")
    layers = decoder_layers(causal_lm)
    mlps = [getattr(layer, "mlp", None) for layer in layers]
    if not all(isinstance(m, nn.Module) for m in mlps):
        raise ValueError(f"tiled MLP: the decoder layers of {type(causal_lm).__name__} "
                         f"({type(layers[0]).__name__}) have no `mlp` submodule to tile")
    for mlp in mlps:
        mlp.tiled_mlp_tokens = tile_tokens
        if is_tiled(mlp):  # already tiled: the new size is all
            continue
        # (a pickled model comes back with its class's forward, and a later patch, Liger's say, replaces
        # ours: both are tiled again here, around whatever forward the module has now)
        inner_forward = unbound_forward(mlp)

        def forward(self, x, *args, _inner=inner_forward, **kwargs):
            if args or kwargs or x.numel() == 0:  # not the plain mlp(x) call that tiling is for: as it was
                return _inner(self, x, *args, **kwargs)
            if not torch.is_grad_enabled():  # no-grad passes (old policy, generation): tiles, nothing saved
                return tiled_forward(self, _inner, self.tiled_mlp_tokens, x)
            params = list(self.parameters())
            return TiledMLPFunction.apply(self, _inner, self.tiled_mlp_tokens, x, *params)

        forward.tiles_the_mlp = True
        mlp.forward = forward.__get__(mlp)
    return len(mlps)
