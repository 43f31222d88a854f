"""LossOptions: how the fused losses compute (backend, path, chunk budget, log-prob kernel knobs), one frozen object.

What the loss IS lives in the objective (``PACS(beta=...)``, ``GRPO(clip_eps=...)``); how the LM head
turns hidden states into probabilities (``temperature``, ``logit_softcap``) and how the engine gets
there (everything else) live here, so that the public functions take a handful of arguments::

    options = LossOptions(path="two_pass", chunk_budget_mib=512)
    loss = fused_linear_pacs_loss(hidden, weight, targets, mask, old_logp, rewards, group_size=8,
                                  objective=PACS(beta=0.5), options=options)
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .checks import check_choice, check_temperature
from .logprobs import check_logprob_knobs, check_softcap

FUSED_BACKENDS = ("auto", "triton", "torch", "naive")
PATHS = ("auto", "single_pass", "two_pass")
GRAD_GEMMS = ("torch", "triton")


def check_chunk_budget(chunk_budget_mib) -> float | None:
    """A finite number of MiB > 0, or None (the device's default: single_pass.default_chunk_budget_mib)."""
    if chunk_budget_mib is None:
        return None
    if isinstance(chunk_budget_mib, bool) or not isinstance(chunk_budget_mib, (int, float)) \
            or not chunk_budget_mib > 0 or chunk_budget_mib == float("inf"):
        raise ValueError(f"chunk_budget_mib must be a finite number of MiB > 0 or None, got {chunk_budget_mib!r}")
    return float(chunk_budget_mib)


@dataclass(frozen=True, kw_only=True)
class LossOptions:
    """How a fused loss runs; every field has a default, so ``LossOptions()`` is the library's choice.

    Attributes:
        backend: "auto" | "triton" | "torch" | "naive" (materializes the logits: tests, benchmarks).
        path: "auto" | "single_pass" | "two_pass" (the engine's paths: pacs_kernels/engine/). "auto": the
            path of least time by the plan's cost model with this device's profile (pacs_kernels/engine/plan.py,
            device.py; on CUDA this device's GPU table where it measured the shape).
        chunk_budget_mib: working memory of the single pass's logits in MiB; None: the device's default
            (256 MiB on the CPU, 2 GiB on CUDA), which ``path="auto"`` may raise to hold every token in one chunk
            (the weight streamed once) or the largest group whole (its logits then built once, not twice): up to
            1/8 of the memory on the CPU, a quarter of the free memory on CUDA.
        filter_eps: the two-pass path's ``linear_logprobs`` option (None: its default; checked there).
        chunk_elements: the two-pass path's ``linear_logprobs`` option (None: its default).
        vocab_splits: the two-pass path's ``linear_logprobs`` option (None: its default).
        temperature: the sampling temperature (logits divided by it), > 0.
        logit_softcap: optional c > 0, Gemma-style ``c * tanh(z / c)`` before the temperature.
        dispatch_table: path of a GPU dispatch table (``benchmarks/dispatch_table.py``) to decide
            ``"auto"`` on CUDA instead of the packaged one; None: the packaged table.
        grad_gemms: force the Triton backward's two gradient GEMMs to "torch" (cuBLAS) or "triton";
            None: as the dispatch table measured.
    """

    backend: str = "auto"
    path: str = "auto"
    chunk_budget_mib: float | None = None
    filter_eps: float | None = None
    chunk_elements: int | None = None
    vocab_splits: int | None = None
    temperature: float = 1.0
    logit_softcap: float | None = None
    dispatch_table: str | None = None
    grad_gemms: str | None = None

    def __post_init__(self) -> None:
        check_choice("backend", self.backend, FUSED_BACKENDS)
        check_choice("path", self.path, PATHS)
        object.__setattr__(self, "chunk_budget_mib", check_chunk_budget(self.chunk_budget_mib))
        object.__setattr__(self, "temperature", check_temperature(self.temperature))
        object.__setattr__(self, "logit_softcap", check_softcap(self.logit_softcap))
        check_logprob_knobs(self.filter_eps, self.chunk_elements, self.vocab_splits)  # whatever path runs
        if self.dispatch_table is not None and not isinstance(self.dispatch_table, str):
            raise TypeError(f"dispatch_table must be None or a file path (str), got {self.dispatch_table!r}")
        if self.grad_gemms is not None:
            check_choice("grad_gemms", self.grad_gemms, GRAD_GEMMS)


OPTION_FIELDS = tuple(f.name for f in fields(LossOptions))
