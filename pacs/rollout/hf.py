"""Rollouts with Hugging Face ``generate``: the engine used where vLLM is absent.

Sampling is exact and seeded per row (Gumbel noise from one generator per row over greedy
decoding), so a row's sample depends only on its seed, not on the batch it shares.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch
from torch import nn

from pacs.model.policy import resolve_dtype
from pacs.model.profile import ModelProfile
from pacs.rollout.sampled import SampledResponses


class _GumbelNoise:
    """Logits processor adding Gumbel(0, 1) noise drawn from one generator per row.

    argmax(logits + Gumbel) is an exact sample of softmax(logits); with one seeded generator per row,
    a row's sample depends only on its seed, not on which other rows share the batch (so each rank
    of a multi-process run samples what a single process would). The generators live on the logits'
    device (made at the first step): on a GPU the noise is drawn there, not drawn on the CPU and copied
    (rows x V float64 numbers a token, 78 MB for 64 rows at V = 152k); a row's sample then depends on
    its seed and the device kind (CPU and CUDA random streams differ).
    """

    def __init__(self, seeds: list[int], recorder: "_SampledLogprobs | None" = None):
        self.seeds = list(seeds)
        self.generators: list[torch.Generator] | None = None
        self.recorder = recorder

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.generators is None:
            self.generators = [torch.Generator(device=scores.device).manual_seed(s) for s in self.seeds]
        uniform = torch.stack([torch.rand(scores.shape[1], generator=g, dtype=torch.float64, device=scores.device)
                               for g in self.generators])
        gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-300)))
        perturbed = (scores.double() + gumbel).to(scores.dtype)
        if self.recorder is not None:  # the scores before the noise: the distribution the token is drawn from
            self.recorder.record(scores, perturbed)
        return perturbed


class _SampledLogprobs:
    """Records, at each decoding step, the log-prob of the token greedy decoding picks from the processed scores.

    Called last in the processor chain with the scores the token is drawn from (``scores``: after the
    temperature and top-p warpers, before the Gumbel noise) and the scores greedy decoding takes its argmax of
    (``chosen_from``: the same tensor ``generate`` sees, so the same token, ties broken alike). Keeps one
    (rows,) float32 tensor and the (rows,) tokens per step, nothing of vocabulary size.
    """

    def __init__(self):
        self.logprobs: list[torch.Tensor] = []
        self.tokens: list[torch.Tensor] = []

    def record(self, scores: torch.Tensor, chosen_from: torch.Tensor) -> None:
        token = torch.argmax(chosen_from, dim=-1)
        logp = torch.log_softmax(scores.float(), dim=-1).gather(1, token[:, None])[:, 0]
        self.logprobs.append(logp.cpu())
        self.tokens.append(token.cpu())

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # greedy decoding
        self.record(scores, scores)
        return scores


def _row_seeded_sampler(temperature: float, top_p: float, seeds: list[int], recorder: _SampledLogprobs | None = None):
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    processors = [TemperatureLogitsWarper(temperature)]
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    return LogitsProcessorList(processors + [_GumbelNoise(seeds, recorder)])


class HFGenerateEngine:
    """Rollouts with ``transformers``' ``generate`` on a private copy of the policy, or (:meth:`on_model`) on the
    trainer's policy itself.

    Args:
        model_dir: HF-format model directory (or hub id) the copy is loaded from.
        max_model_len: prompt + response tokens must fit in this.
        seed: base seed; call ``k`` without an explicit seed samples with ``seed + k``.

        dtype: "auto" (bfloat16 on GPU, float32 on CPU; :func:`pacs.model.policy.resolve_dtype`) or a
            torch dtype name.
        device: default: the current CUDA device if any, else CPU.

    Sampling: row ``j`` of a call (prompt ``j // n``, sample ``j % n``) draws from its own generator
    seeded with ``seed + j``, so results do not depend on batch composition.
    """

    def __init__(self, model_dir: str, *, max_model_len: int, seed: int = 0, dtype: str = "auto",
                 device: str | torch.device | None = None, **_unused):
        from transformers import AutoModelForCausalLM, GenerationConfig

        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=resolve_dtype(dtype, self.device)).to(self.device).eval()
        # responses are samples of the policy the trainer scores: none of generation_config.json's logits
        # processors (an instruct model's repetition_penalty, no_repeat_ngram_size, min_new_tokens) applies
        self.model.generation_config = GenerationConfig()
        self.shares_model, self.autocast_dtype = False, None
        self._set_up(model_dir, max_model_len, seed)

    @classmethod
    def on_model(cls, model: nn.Module, model_dir: str, *, max_model_len: int, seed: int = 0,
                 autocast_dtype: torch.dtype | None = None) -> "HFGenerateEngine":
        """An engine that generates with ``model`` itself: the trainer's policy (``Policy.causal_lm``) on one
        process. No second copy of the weights takes memory, and every change of the weights (LoRA's
        adapters too, unmerged, unrounded) is in the next samples: :meth:`sync_weights` has nothing to do.
        ``model_dir``: where its tokenizer is (the pad token); ``autocast_dtype``: the 16-bit dtype a float32
        model computes in (``Policy.autocast_dtype``). Generation runs in eval mode and no_grad, and puts the
        model's training mode back."""
        engine = cls.__new__(cls)
        engine.model, engine.shares_model, engine.autocast_dtype = model, True, autocast_dtype
        engine.device = next(model.parameters()).device
        engine._set_up(model_dir, max_model_len, seed)
        return engine

    def _set_up(self, model_dir: str, max_model_len: int, seed: int) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = pad if pad is not None else 0
        self.max_model_len = max_model_len
        self.seed, self._calls = seed, 0

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, *, temperature: float, top_p: float = 1.0,
                 max_new_tokens: int, stop_token_ids: list[int], seed: int | None = None,
                 return_logprobs: bool = False) -> list[list[list[int]]] | SampledResponses:
        """``result[i][j]``: response j of prompt i (token ids, cut after its first stop token).

        ``return_logprobs``: return a :class:`~pacs.rollout.sampled.SampledResponses` instead, with each token's
        log-prob as the sampler computed it: ``log_softmax`` (float32) of the logits divided by ``temperature``,
        after top-p's renormalization (tokens outside the nucleus at -inf, the rest renormalized over it), i.e.
        the log-prob of the distribution the token was drawn from. Greedy (``temperature == 0``): the log-prob
        under the unscaled logits (vLLM's ``processed_logprobs`` does the same). The policy computes the logits
        in its own dtype (the autocast dtype of a shared float32 policy)."""
        if not prompts:
            return SampledResponses([], []) if return_logprobs else []
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.max_model_len:
            raise ValueError(
                f"prompt length {longest} + max_new_tokens {max_new_tokens} exceeds max_model_len "
                f"{self.max_model_len}")
        seed = self.seed + self._calls if seed is None else seed
        self._calls += 1
        rows = [p for p in prompts for _ in range(n)]  # each prompt's n copies contiguous
        ids = torch.full((len(rows), longest), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for i, row in enumerate(rows):  # left padding: generation continues every row at the end
            ids[i, longest - len(row):] = torch.tensor(row)
            attention[i, longest - len(row):] = 1
        processors = None
        recorder = _SampledLogprobs() if return_logprobs else None
        if temperature > 0:  # exact sampling as greedy decoding over Gumbel-perturbed logits
            processors = _row_seeded_sampler(temperature, top_p, [seed + k for k in range(len(rows))], recorder)
        elif recorder is not None:
            from transformers import LogitsProcessorList

            processors = LogitsProcessorList([recorder])
        from transformers import GenerationConfig

        training = self.model.training
        autocast = (torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype is not None
                    else contextlib.nullcontext())
        try:
            self.model.eval()  # a shared policy: no checkpointing; generation_config.json's processors never apply
            with autocast:
                out = self.model.generate(
                    input_ids=ids.to(self.device), attention_mask=attention.to(self.device),
                    generation_config=GenerationConfig(), use_cache=True, max_new_tokens=max_new_tokens,
                    eos_token_id=list(stop_token_ids), pad_token_id=self.pad_token_id, do_sample=False,
                    logits_processor=processors)
        finally:
            self.model.train(training)
        new_tokens = out[:, longest:].tolist()
        stops = set(stop_token_ids)
        responses = []
        for tokens in new_tokens:
            cut = next((j + 1 for j, t in enumerate(tokens) if t in stops), len(tokens))
            responses.append(tokens[:cut])
        grouped = [responses[i * n:(i + 1) * n] for i in range(len(prompts))]
        if recorder is None:
            return grouped
        # (rows, steps): generate stops once every row has stopped, so each response's tokens were all recorded
        logprobs, recorded = torch.stack(recorder.logprobs, 1), torch.stack(recorder.tokens, 1)
        for k, tokens in enumerate(responses):
            if recorded[k, :len(tokens)].tolist() != tokens:
                raise RuntimeError("HFGenerateEngine: the recorded sampler log-probs belong to other tokens than "
                                   "generate returned (a logits processor after the sampler's?)")
        values = [logprobs[k, :len(tokens)].tolist() for k, tokens in enumerate(responses)]
        return SampledResponses(grouped, [values[i * n:(i + 1) * n] for i in range(len(prompts))])

    @torch.no_grad()
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.shares_model:  # the policy itself: its weights are the engine's (the iterator is not consumed)
            return
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        for name, tensor in named_tensors:
            if name not in params:
                if name == "lm_head.weight" and ModelProfile.from_config(self.model.config).tied_embeddings:
                    continue  # tied: the embedding already carries it
                raise ValueError(f"sync_weights: the rollout model has no tensor named {name!r}")
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))

    def close(self) -> None:
        self.model = None
