"""The plan: ONE pure function from a batch's shape, the options, the objective's capabilities and a device
profile to what the engine runs (:func:`plan_loss` -> :class:`Plan`). It touches no tensor data, times
nothing and writes no file; the same inputs give the same plan.

A plan says:

* the path: ``single_pass`` (each chunk's logits built once, the per-token gradient by autograd on the
  chunk's log-probs, dh and dW from that tile: 3 matmuls; engine/single_pass.py), ``two_pass``
  (the log-prob kernels, then autograd through them: 4 matmuls; engine/two_pass.py) or ``one_sweep`` (the
  first step after a rollout, from the rollout's log-sum-exp: the gradient is known before the sweep;
  engine/one_sweep.py), with the usual path as its ``fallback`` should old_lse turn out stale;
* the chunks (whole groups for a group-coupled objective, any run of tokens for a token-separable one),
  the chunk budget and what it holds (:class:`TileMemory`), the share of logits built twice;
* the backends: the log-prob kernels' (two passes, one sweep) and the single pass's row engine.

``path="auto"`` over chunks of whole groups takes the path of least modelled time:

    single pass, rebuilt share r, k chunks:  (3 + r) G + (SINGLE_PASS_PASSES + r REBUILD_PASSES) P + (k - 1) S
    two passes (eager torch):                4 G + TWO_PASS_PASSES P
    two passes (Triton kernels):             4 G + TRITON_TWO_PASS_PASSES P

with G = 2 N V d x (the profile's seconds per GEMM flop), P = N V x (its seconds per float32 elementwise
pass element) and S = V d x the same: cutting the tokens into k chunks streams the weight and the weight
gradient's accumulator once more per chunk (its three GEMMs over fewer rows; on a 2-core Xeon at V = 128,256,
d = 2,048, two chunks of 384 tokens took about 0.25 s more than one of 768, one such pass at the CPU's default
constants); where the device profile holds a measured GPU table entry for the shape, the measurement decides.
Chunks of tokens (a token-separable objective) are modelled the same way (r = 0). The two passes' own chunks
are not counted: the eager ones (torch_chunked.py) stream the weight once per 2,048 tokens, so at most as often as
a single pass at the default budget; the Triton ones tile inside their kernels (in G).

With no budget given, the budget may be raised from the device's default to hold the largest group (or all the
tokens) whole, up to the profile's ``max_budget_mib`` (on the CPU 1/8 of the memory, on CUDA a share of the
free memory): a group held whole is never built twice, and one chunk streams the weight once.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..logprobs import resolve_backend

if TYPE_CHECKING:  # annotations only
    from ..objectives.protocol import Capabilities
    from ..options import LossOptions
    from .batch import BatchShape
    from .device import DeviceProfile

PATHS = ("single_pass", "two_pass", "one_sweep")
# passes over each logit: eager rows (EagerRows) amax, subtract, exp, row sum, then the gradient's scale;
# Triton rows two reads. A rebuilt tile adds (eager) subtract lse and exp, (Triton) nothing: still two reads
SINGLE_PASS_PASSES = {"torch": 5.0, "triton": 2.0}
REBUILD_PASSES = {"torch": 2.0, "triton": 0.0}
TWO_PASS_PASSES = 7.0  # torch_chunked: logsumexp (max, subtract, exp, sum); backward: subtract, exp, scale
TRITON_TWO_PASS_PASSES = 2.0  # the Triton log-prob kernels read the logits in registers
DEFAULT_CHUNK_BUDGET_MIB = {"cpu": 256.0, "cuda": 2048.0}  # by device type; others: the CPU's
LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Plan:
    """What the engine runs for one batch (see the module docstring). ``chunks``/``memory`` for the single pass
    (None otherwise); ``backend``: the log-prob kernels' ("torch" | "triton" | "naive"), ``row_kernels``: the
    single pass's ("torch" | "triton"); ``rebuilt``: share of logits built twice; ``fallback``: the plan to run
    where this one gives up (a one sweep whose old_lse is stale: the usual path; a single pass over an objective
    that declared nothing, whose chunks' shares turn out not to add up: two passes); ``modelled_s``: the cost
    model's seconds per candidate (logs); ``chunk_elements``: the two passes' torch logits chunk (None: options').
    """

    path: str
    backend: str = "torch"
    row_kernels: str = "torch"
    chunks: tuple | None = None
    memory: "TileMemory | None" = None
    budget_mib: float | None = None
    rebuilt: float = 0.0
    fallback: "Plan | None" = None
    modelled_s: tuple = ()
    chunk_elements: int | None = None


def device_type(device) -> str:
    """"cpu", "cuda", ... of a torch.device, a device string or a device type."""
    return device.type if isinstance(device, torch.device) else str(device).split(":")[0]


def gemm_in_input_dtype(device, dtype: torch.dtype) -> bool:
    """True where the GEMMs run in the inputs' low-precision dtype (CUDA with fp16/bf16)."""
    return device_type(device) == "cuda" and dtype in LOW_PRECISION


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_chunk_budget_mib(device: torch.device) -> float:
    """The chunk budget when the caller gives none: 256 MiB on the CPU, 2 GiB on CUDA. A GPU chunk
    must hold enough tokens for its GEMMs to outweigh streaming W and the float32 dW once per chunk
    (benchmarks/roofline.py: 1.5x the 3-matmul floor at 256 MiB of 6-byte logits on an H200,
    memory-bound, and 1.17x from about 1.5 GiB); at 2 bytes per logit (Triton rows, bf16) 2 GiB
    holds about 5,300 tokens at V = 152k (eager rows: 2,350)."""
    return DEFAULT_CHUNK_BUDGET_MIB.get(device_type(device), DEFAULT_CHUNK_BUDGET_MIB["cpu"])


@dataclass(frozen=True)
class Chunk:
    """Tokens tok0:tok1 of the selected-token layout; r0:r1 the responses that own them (whole
    responses for group chunks, possibly cut at the ends for token chunks)."""

    r0: int
    r1: int
    tok0: int
    tok1: int


# a 16-bit tile's float32 GEMM strip takes 1/4 of the budget (882 rows at 2 GiB, V = 152k: enough rows
# in flight for the one-program-per-row lse kernel to stream at HBM speed) ...
STRIP_SHARE = 4
MAX_STRIP_ROWS = 1024  # ... and at most this many rows (enough to keep its GEMM compute-bound)


@dataclass(frozen=True)
class TileMemory:
    """How the single pass spends its chunk budget: ``tokens`` whose logits it may hold at once,
    ``bytes_per_token`` each, and, for a 16-bit tile, a float32 GEMM strip of ``strip_rows`` rows
    (``strip_bytes``; 0: the GEMM writes into the tile itself). ``tile_dtype``: what the Triton
    rows hold the tile in (None: the eager rows' own float32 buffer)."""

    tokens: int
    bytes_per_token: int
    strip_rows: int = 0
    strip_bytes: int = 0
    tile_dtype: torch.dtype | None = None


def tile_dtype_for(device: torch.device, dtype: torch.dtype, row_kernels: str) -> torch.dtype | None:
    """What the Triton rows hold a tile in: the GEMM operands' dtype (bf16/fp16 where the GEMMs run in
    16 bits, a GPU; float32 elsewhere); None for the eager rows (their own float32 buffer)."""
    if row_kernels != "triton":
        return None
    return dtype if gemm_in_input_dtype(device, dtype) else compute_dtype(dtype)


def tile_memory(budget_mib: float | None, vocab: int, device: torch.device, dtype: torch.dtype, *,
                softcap: bool = False, row_kernels: str = "torch", tile_dtype: torch.dtype | None = None) -> TileMemory:
    """What a chunk budget of ``budget_mib`` MiB (None: the device's default,
    :func:`default_chunk_budget_mib`) holds, for the given row engine (single_pass_rows.py):

    * eager rows: float32 logits (float64 for float64), twice that with a soft-cap (its slope), plus
      a 16-bit dz copy where the GEMMs run in 16 bits: 4 to 10 bytes per logit;
    * Triton rows: the tile in ``tile_dtype`` (default :func:`tile_dtype_for`: bf16/fp16 on a GPU,
      float32 elsewhere), so 2 (or 4) bytes per logit, plus, for a 16-bit tile, one float32 GEMM
      strip of 1/STRIP_SHARE of the budget (at most MAX_STRIP_ROWS rows). The V / 1024 float32
      slice maxima per token (under 0.2% of a bf16 row) are not counted.
    """
    if budget_mib is None:
        budget_mib = default_chunk_budget_mib(device)
    budget = int(budget_mib * 2 ** 20)
    cdt_bytes = torch.finfo(compute_dtype(dtype)).bits // 8
    if row_kernels != "triton":
        per_logit = cdt_bytes * (2 if softcap else 1)
        if gemm_in_input_dtype(device, dtype):
            per_logit += torch.finfo(dtype).bits // 8
        return TileMemory(budget // (vocab * per_logit), vocab * per_logit)
    tile_dtype = tile_dtype or tile_dtype_for(device, dtype, row_kernels)
    per_token = vocab * (torch.finfo(tile_dtype).bits // 8)
    if tile_dtype not in LOW_PRECISION:
        return TileMemory(budget // per_token, per_token, tile_dtype=tile_dtype)
    strip_rows = max(1, min(MAX_STRIP_ROWS, budget // STRIP_SHARE // (vocab * 4)))
    strip_bytes = strip_rows * vocab * 4
    return TileMemory(max(0, budget - strip_bytes) // per_token, per_token, strip_rows, strip_bytes, tile_dtype)


def budget_mib_for_tokens(tokens: int, vocab: int, device: torch.device, dtype: torch.dtype, *,
                          softcap: bool = False, row_kernels: str = "torch") -> float:
    """The smallest chunk budget (MiB, to 1/1024 MiB) whose :func:`tile_memory` holds ``tokens`` tokens."""
    def holds(mib):
        return tile_memory(mib, vocab, device, dtype, softcap=softcap, row_kernels=row_kernels).tokens >= tokens

    low, high = 0.0, 1.0
    while not holds(high):
        low, high = high, 2 * high
    while high - low > 2 ** -10:
        mid = (low + high) / 2
        low, high = (low, mid) if holds(mid) else (mid, high)
    return high


def plan_group_chunks(counts: list[int], group_size: int, max_tokens: int, *,
                      oversized_alone: bool = False) -> list[Chunk] | None:
    """Chunks of whole groups (``group_size`` contiguous responses), greedy up to ``max_tokens``
    tokens each; None when one group alone holds more than ``max_tokens`` tokens, unless
    ``oversized_alone``: such a group is then a chunk of its own, whose logits the single pass
    keeps only in part (:func:`plan_tiles`)."""
    chunks, r0, tok0, tokens = [], 0, 0, 0
    for g0 in range(0, len(counts), group_size):
        group_tokens = sum(counts[g0:g0 + group_size])
        if group_tokens > max_tokens and not oversized_alone:
            return None
        if tokens + group_tokens > max_tokens and g0 > r0:
            chunks.append(Chunk(r0, g0, tok0, tok0 + tokens))
            r0, tok0, tokens = g0, tok0 + tokens, 0
        tokens += group_tokens
    if len(counts) > r0 or not chunks:
        chunks.append(Chunk(r0, len(counts), tok0, tok0 + tokens))
    return chunks


def plan_token_chunks(counts: list[int], max_tokens: int) -> list[Chunk]:
    """Chunks of at most ``max_tokens`` consecutive tokens, for losses that are per token given
    quantities known up front (GRPO: advantages and normalisers): responses may be cut."""
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    total, step = offsets[-1], max(1, max_tokens)
    chunks = []
    for t0 in range(0, max(total, 1), step):
        t1 = min(t0 + step, total)
        r0 = bisect.bisect_right(offsets, t0) - 1
        r1 = bisect.bisect_left(offsets, t1) if t1 > t0 else r0
        chunks.append(Chunk(max(r0, 0), max(r1, r0), t0, t1))
    return chunks


def plan_tiles(tok0: int, tok1: int, budget_tokens: int | None) -> list[tuple[int, int, bool]]:
    """Tiles (t0, t1, keep) of a chunk's tokens. A chunk within ``budget_tokens`` is one kept tile.
    A longer one (a group bigger than the budget) ends in a kept tile of the full budget, whose logits are
    held for the gradient; the C - budget tokens before it are cut into the fewest tiles within the budget,
    of nearly equal size, which keep only their row statistics and are built again: one more logits GEMM
    for (C - budget) / C of the tokens (a group 20% over the budget rebuilds a sixth of its tokens, where n
    equal tiles would rebuild (n - 1) / n, half). Still ceil(C / budget) tiles, as few as the budget
    allows: every tile's GEMMs stream all of W and the float32 dW once, so many small tiles would turn the
    pass memory-bound."""
    count = tok1 - tok0
    if budget_tokens is None or count <= budget_tokens:
        return [(tok0, tok1, True)]
    budget = max(1, budget_tokens)
    kept_from = tok1 - budget
    rebuilt = kept_from - tok0
    n = -(-rebuilt // budget)
    bounds = [tok0 + rebuilt * i // n for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1], False) for i in range(n)] + [(kept_from, tok1, True)]


def recomputed_fraction(chunks: list[Chunk], budget_tokens: int | None) -> float:
    """Share of the tokens whose logits the single pass builds twice (0.0 when every chunk fits)."""
    total = sum(c.tok1 - c.tok0 for c in chunks)
    again = sum(t1 - t0 for c in chunks for t0, t1, keep in plan_tiles(c.tok0, c.tok1, budget_tokens) if not keep)
    return again / total if total else 0.0




# ----------------------------------------------------------------------------- the plan


def plan_loss(shape: BatchShape, capabilities: Capabilities, options: LossOptions, profile: DeviceProfile) -> Plan:
    """The plan for a batch of ``shape`` (engine/batch.py), an objective declaring ``capabilities``, the caller's
    ``options`` and the device's ``profile`` (engine/device.py). Pure: no tensor data, no timing, no file.

    One sweep where the batch carries old_lse (or is a :class:`~pacs_kernels.pieces.KnownGradient` piece), with
    the usual plan as its fallback; a :class:`~pacs_kernels.pieces.GatheredLogprobs` piece: two passes; else
    :func:`usual_plan`."""
    softcap = options.logit_softcap is not None
    if shape.piece is not None:  # a piece's tokens only; one without tokens runs torch (its backward still runs)
        backend = resolve_backend(options.backend, profile.device, profile.dtype, softcap=softcap, matmul_kernels=True)
        backend = backend if shape.n_selected else "torch"
        if shape.piece == "known_gradient":
            if backend == "naive":
                raise ValueError("backend='naive' has no known-gradient fast path; use 'auto', 'triton' or 'torch'")
            return Plan("one_sweep", backend=backend)
        return Plan("two_pass", backend=backend, chunk_elements=eager_chunk_elements(options))
    if shape.has_token_weights and not capabilities.token_weights:
        raise ValueError("token_weights= needs an objective that takes per-token weights (it declares "
                         "Capabilities(token_weights=True) and accepts token_weights= in its __call__); this one "
                         "does not")
    if shape.has_valid and not capabilities.response_validity:
        raise ValueError("valid= needs an objective that takes a per-response validity mask (it declares "
                         "Capabilities(response_validity=True), as PACS does); this one does not")
    usual = usual_plan(shape, capabilities, options, profile)
    if not shape.has_old_lse:
        return usual
    if not capabilities.one_sweep:
        raise ValueError("old_lse (the one-sweep first step) needs an objective whose loss is a function of the "
                         "log-probs alone; this one uses the entropy")
    if options.backend == "naive":
        raise ValueError("old_lse (the one-sweep first step) needs backend 'auto', 'torch' or 'triton', got 'naive'")
    backend = resolve_backend(options.backend, profile.device, profile.dtype, softcap=softcap, matmul_kernels=True)
    return Plan("one_sweep", backend=backend, fallback=usual)


def eager_chunk_elements(options: LossOptions) -> int | None:
    """The eager two passes' logits chunk: ``options.chunk_elements``, else the caller's budget (4 bytes a logit),
    else None (torch_chunked.py's default)."""
    if options.chunk_elements is not None or options.chunk_budget_mib is None:
        return options.chunk_elements
    return max(1, int(options.chunk_budget_mib * 2 ** 20) // 4)


def usual_plan(shape: BatchShape, capabilities: Capabilities, options: LossOptions, profile: DeviceProfile) -> Plan:
    """The single pass or the two passes (``options.path``; "auto": the cost model, over chunks of whole groups,
    or of tokens for a token-separable objective). Two passes always for
    ``path="two_pass"``, backend="naive" and an objective that uses the entropy. ``path="single_pass"``: a group
    bigger than the budget keeps part of its logits and rebuilds the rest."""
    path, softcap = options.path, options.logit_softcap is not None
    if path == "single_pass" and options.backend == "naive":
        raise ValueError("path='single_pass' has no naive backend; use backend='auto', 'torch' or 'triton'")
    if path == "single_pass" and capabilities.uses_entropy:
        raise ValueError("path='single_pass' cannot run an objective that uses the entropy (entropy_coef > 0): "
                         "its gradient needs the two passes; use LossOptions(path='two_pass') or 'auto'")
    if path == "two_pass" or options.backend == "naive" or capabilities.uses_entropy:
        return Plan("two_pass", backend=two_pass_backend(shape, options, profile))
    row_kernels = row_kernels_for(options.backend, profile)
    whole_groups = capabilities.chunking != "tokens"
    budget_mib, modelled = options.chunk_budget_mib, ()
    if path == "auto":
        triton_two_pass = two_pass_runs_triton(options.backend, profile.device, profile.dtype, softcap=softcap)
        choice = model_paths(shape, budget_mib, profile, softcap=softcap, triton_two_pass=triton_two_pass,
                             row_kernels=row_kernels, whole_groups=whole_groups)
        modelled = tuple(choice.modelled_s.items())
        if choice.path == "two_pass":
            return Plan("two_pass", backend=two_pass_backend(shape, options, profile), modelled_s=modelled,
                        chunk_elements=None if triton_two_pass else eager_chunk_elements(options))
        budget_mib = choice.budget_mib
    memory = tile_memory(budget_mib, shape.vocab, profile.device, shape.dtype, softcap=softcap,
                         row_kernels=row_kernels)
    counts = list(shape.counts)
    if not whole_groups:
        chunks, rebuilt = plan_token_chunks(counts, memory.tokens), 0.0
    else:
        chunks = plan_group_chunks(counts, shape.group_size, memory.tokens, oversized_alone=True)
        rebuilt = recomputed_fraction(chunks, memory.tokens)
    fallback = None
    if capabilities.chunking == "batch":  # nothing declared: two passes where the chunks' shares do not add up
        try:
            fallback = Plan("two_pass", backend=two_pass_backend(shape, options, profile))
        except ValueError:  # the two passes cannot run here (a soft-cap on the Triton kernels): nothing to fall to
            fallback = None
    return Plan("single_pass", options.backend, row_kernels, tuple(chunks), memory, budget_mib, rebuilt,
                fallback=fallback, modelled_s=modelled)


def two_pass_backend(shape: BatchShape, options: LossOptions, profile: DeviceProfile) -> str:
    """The log-prob kernels' backend: ``options.backend`` resolved for the device (checked where explicit); on
    CUDA "auto" takes "torch" where this device's table measured it faster at the shape."""
    softcap = options.logit_softcap is not None
    backend = resolve_backend(options.backend, profile.device, profile.dtype, softcap=softcap, matmul_kernels=True)
    if options.backend == "auto" and backend == "triton" and measured_fastest(
            profile.table, "logprobs_fwd_bwd", shape.n_selected, shape.d, shape.vocab, ("triton", "torch"),
            shape.dtype) == "torch":
        return "torch"
    return backend


def measured_fastest(table: tuple, op: str, n_tokens: int, d: int, vocab: int, among: tuple[str, ...],
                     dtype: torch.dtype) -> str | None:
    """The fastest of ``among`` that a device profile's GPU table measured for ``op`` at (d, V), the dtype and the
    nearest N (log scale), or None (dispatch.py's rule, over the profile's entries)."""
    name = str(dtype).removeprefix("torch.")
    candidates = [e for e in table if e.get("op") == op and e.get("d") == d and e.get("V") == vocab
                  and e.get("dtype") == name and any(k in e.get("ms", {}) for k in among)]
    if not candidates or n_tokens <= 0:
        return None
    entry = min(candidates, key=lambda e: abs(math.log(max(e["N"], 1)) - math.log(n_tokens)))
    times = {k: v for k, v in entry["ms"].items() if k in among}
    return min(times, key=times.get)


def two_pass_runs_triton(backend: str, device: torch.device, dtype: torch.dtype, *, softcap: bool = False) -> bool:
    """Would the two passes' log-prob matmuls run the Triton kernels? (On CUDA for 16-bit weights; float32 goes
    to cuBLAS under "auto", and then the rebuilding single pass is the better way to handle a group larger than
    the chunk budget. Never with a soft-cap: the Triton log-prob kernels have none, so the two passes would run
    eager PyTorch, or refuse backend="triton", where the single pass's row kernels apply the cap.)"""
    return not softcap and resolve_backend(backend, device, dtype, matmul_kernels=True) == "triton"


def row_kernels_for(backend: str, profile: DeviceProfile) -> str:
    """The single pass's elementwise work: Triton row kernels where the backend resolves to Triton
    (CUDA, or the interpreter when asked for explicitly), eager PyTorch otherwise."""
    resolved = resolve_backend(backend, profile.device, profile.dtype)
    return "triton" if resolved == "triton" and profile.dtype != torch.float64 else "torch"


# ----------------------------------------------------------------------------- the cost model of path="auto"

@dataclass(frozen=True)
class ModelledChoice:
    """The path, the single pass's chunk budget (MiB; None for two passes) and the modelled seconds of each
    candidate considered (for logs and benchmarks)."""

    path: str
    budget_mib: float | None
    modelled_s: dict


def largest_group_tokens(counts, group_size: int) -> int:
    """Tokens of the largest group of ``group_size`` consecutive responses."""
    counts = list(counts)
    return max((sum(counts[g:g + group_size]) for g in range(0, len(counts), group_size)), default=0)


def measured_faster(profile: DeviceProfile, shape: BatchShape, among: tuple[str, str]) -> bool:
    """On CUDA: did this device's GPU table measure ``among[1]`` faster than ``among[0]`` for the PACS loss at
    this shape (the nearest N)? ("single_pass", "triton"): the Triton two passes faster than the single pass;
    ("triton", "single_pass_lowmem"): the rebuilding single pass faster than the Triton two passes."""
    return profile.device.type == "cuda" and measured_fastest(
        profile.table, "pacs_loss_fwd_bwd", shape.n_selected, shape.d, shape.vocab, among, shape.dtype) == among[1]


def candidate_budgets(shape: BatchShape, budget_mib: float | None, profile: DeviceProfile, *, softcap: bool,
                      row_kernels: str, whole_groups: bool = True) -> list[float | None]:
    """The single pass's budgets worth modelling: the caller's; or, with none given, the device's default and
    budgets holding the largest group (``whole_groups``) and all tokens, up to the profile's ``max_budget_mib``
    (the cap itself where the largest group needs more: its tiles then rebuild the least)."""
    if budget_mib is not None:
        return [budget_mib]
    default = default_chunk_budget_mib(profile.device)
    cap = max(default, profile.max_budget_mib)
    budgets: list[float | None] = [None]
    largest = (largest_group_tokens(shape.counts, shape.group_size),) if whole_groups else ()
    for tokens in (*largest, shape.n_selected):
        mib = min(cap, budget_mib_for_tokens(tokens, shape.vocab, profile.device, shape.dtype, softcap=softcap,
                                             row_kernels=row_kernels))
        if mib > default and mib not in budgets:
            budgets.append(mib)
    return budgets


def model_paths(shape: BatchShape, budget_mib: float | None, profile: DeviceProfile, *, softcap: bool = False,
                triton_two_pass: bool = False, row_kernels: str = "torch", whole_groups: bool = True) -> ModelledChoice:
    """The path of least modelled time (module docstring) with the profile's costs, over chunks of whole groups
    (``whole_groups``) or of tokens (never rebuilt). Deterministic: ties go to the single pass and to the smaller
    budget. A measured GPU table entry for the shape decides first."""
    if triton_two_pass and measured_faster(profile, shape, ("single_pass", "triton")):
        return ModelledChoice("two_pass", None, {"two_pass": "measured faster (GPU table)"})
    costs = profile.costs
    n, v, d = shape.n_selected, shape.vocab, shape.d
    gemm = 2.0 * n * v * d * costs.gemm_s_per_flop
    passes = n * v * costs.pass_s_per_element
    weight_stream = v * d * costs.pass_s_per_element  # S: once more per chunk past the first
    rows = "triton" if row_kernels == "triton" else "torch"
    modelled: dict = {}
    best: tuple[float, str, float | None] | None = None
    for budget in candidate_budgets(shape, budget_mib, profile, softcap=softcap, row_kernels=row_kernels,
                                    whole_groups=whole_groups):
        memory = tile_memory(budget, v, profile.device, shape.dtype, softcap=softcap, row_kernels=row_kernels)
        if whole_groups:
            fits = plan_group_chunks(list(shape.counts), shape.group_size, memory.tokens) is not None
            if not fits and triton_two_pass and not measured_faster(profile, shape,
                                                                    ("triton", "single_pass_lowmem")):
                continue  # a group larger than the budget goes to the Triton two passes, unless measured otherwise
            chunks = plan_group_chunks(list(shape.counts), shape.group_size, memory.tokens, oversized_alone=True)
            rebuilt = recomputed_fraction(chunks, memory.tokens)
        else:
            chunks, rebuilt = plan_token_chunks(list(shape.counts), memory.tokens), 0.0
        seconds = ((3 + rebuilt) * gemm + (SINGLE_PASS_PASSES[rows] + rebuilt * REBUILD_PASSES[rows]) * passes
                   + (len(chunks) - 1) * weight_stream)
        modelled[f"single_pass@{'default' if budget is None else f'{budget:.0f}MiB'}"] = seconds
        if best is None or seconds < best[0]:
            best = (seconds, "single_pass", budget)
    two = 4 * gemm + (TRITON_TWO_PASS_PASSES if triton_two_pass else TWO_PASS_PASSES) * passes
    modelled["two_pass"] = two
    if best is None or two < best[0]:
        best = (two, "two_pass", None)
    return ModelledChoice(best[1], best[2] if best[1] == "single_pass" else None, modelled)
