"""The packed row's attention as one flash varlen call (pacs/model/varlen_attention.py).

PyTorch's ``varlen_attn`` has a kernel on CUDA only, so here a fake kernel with each PyTorch signature
(2.10's ``is_causal=``, later ``window_size=`` / ``scale=`` / ``enable_gqa=``) stands in for it: it checks
the layout it is handed the way the real one needs it ((T, H, D), int32 offsets, the longest sequence) and
computes causal attention per sequence with an explicit softmax, so the tests check the plumbing (layouts,
offsets, keywords, grouped heads, the fallbacks, the self-check) against the per-sequence SDPA loop. The
kernel itself runs on the GPU: ``benchmarks/packed_attention.py`` (gpu.sh) checks it there.
"""

import warnings

import pytest
import torch
from test_packing import config, loss_and_grads, random_batch, tiny_policy

from pacs.model import varlen_attention as va
from pacs.model.sequence_parallel import _ulysses_attention


def explicit_causal_attention(q, k, v, cu, scale):
    """(T, H, D) packed -> (T, H, D): softmax(q k^T * scale) v within each sequence, causal, by hand."""
    out = torch.empty_like(q)
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        scores = torch.einsum("thd,jhd->htj", q[s:e], k[s:e]) * scale
        causal = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out[s:e] = torch.einsum("htj,jhd->thd", weights, v[s:e])
    return out


class FakeKernel:
    """Stands in for ``torch.nn.attention.varlen.varlen_attn`` with one PyTorch's signature."""

    def __init__(self, signature: str, wrong: str | None = None):
        self.signature, self.wrong, self.calls = signature, wrong, []
        self.params = frozenset({"2.10": ("is_causal", "return_aux"),
                                 "2.11": ("return_aux", "scale", "window_size"),  # grouped heads: natively
                                 "2.13": ("return_aux", "scale", "window_size", "enable_gqa")}[signature])

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        assert set(kw) <= self.params, kw
        self.calls.append(kw)
        if self.wrong == "raise":
            raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.\nmore")
        assert q.dim() == k.dim() == v.dim() == 3 and q.shape[0] == k.shape[0]  # (T, H, D)
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.device == q.device and torch.equal(cu_q, cu_k)
        assert max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
        causal = kw.get("is_causal", False) or tuple(kw.get("window_size", (-1, -1))) == (-1, 0)
        assert causal or self.wrong == "not_causal"
        if self.signature == "2.13" and k.shape[1] != q.shape[1]:
            assert kw.get("enable_gqa"), "grouped key/value heads without enable_gqa=True"
        scale = kw.get("scale") or q.shape[-1] ** -0.5
        if self.wrong == "not_causal":
            return explicit_causal_attention(q, k, v, torch.tensor([0, q.shape[0]], dtype=torch.int32), scale)
        return explicit_causal_attention(q, k, v, cu_q, scale)


@pytest.fixture
def kernel(monkeypatch):
    """Install a fake kernel (``kernel("2.13")``) and let it run on the CPU in float64."""
    monkeypatch.setattr(va, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(va, "KERNEL_DTYPES", (torch.float16, torch.bfloat16, torch.float64))
    monkeypatch.setattr(va, "_self_checks", {})
    monkeypatch.setattr(va, "_decisions", {})
    monkeypatch.setattr(va, "_reported", set())
    monkeypatch.delenv(va.ENGINE_VARIABLE, raising=False)

    def install(signature: str, wrong: str | None = None) -> FakeKernel:
        fake = FakeKernel(signature, wrong)
        monkeypatch.setattr(va, "_varlen_kernel", lambda: (fake, fake.params))
        return fake

    return install


def packed_qkv(bounds, heads=4, kv_heads=2, head_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = bounds[-1]
    q, k, v = (torch.randn(1, h, n, head_dim, generator=gen, dtype=torch.float64).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    return q, k, v, torch.tensor(bounds, dtype=torch.int32)


@pytest.mark.parametrize("signature", ["2.10", "2.11", "2.13"])
def test_one_kernel_call_equals_the_per_sequence_loop_with_gradients(kernel, signature):
    fake = kernel(signature)
    bounds = [0, 1, 7, 9, 16]  # a one-token sequence among them
    q, k, v, cu = packed_qkv(bounds)
    out = va.varlen_causal_attention(q, k, v, cu, bounds)
    assert out is not None and out.shape == q.shape
    ref = va.loop_causal_attention(q, k, v, bounds)
    upstream = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    ref_grads = torch.autograd.grad(ref, (q, k, v), upstream)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert len(fake.calls) == 2  # the self-check's, then this row's
    causal = {"2.10": {"is_causal": True}, "2.11": {"window_size": (-1, 0)},
              "2.13": {"window_size": (-1, 0), "enable_gqa": True}}[signature]
    assert fake.calls[-1] == causal


def test_scale_goes_to_the_kernel_where_it_takes_one_else_the_loop_runs(kernel):
    bounds = [0, 4, 10]
    q, k, v, cu = packed_qkv(bounds)
    kernel("2.13")
    out = va.varlen_causal_attention(q, k, v, cu, bounds, scaling=0.3)
    torch.testing.assert_close(out, va.loop_causal_attention(q, k, v, bounds, scaling=0.3), rtol=1e-10, atol=1e-12)
    fake = kernel("2.10")  # no scale keyword: the default scale only
    assert va.varlen_causal_attention(q, k, v, cu, bounds, scaling=8 ** -0.5) is not None
    assert va.varlen_causal_attention(q, k, v, cu, bounds, scaling=0.3) is None
    assert "takes no scale" in va.varlen_unavailable(q, k, scaling=0.3)
    assert all("scale" not in call for call in fake.calls)


@pytest.mark.parametrize("wrong, reason", [("raise", "RuntimeError: FlashAttention only supports Ampere"),
                                           ("not_causal", "output differs from per-sequence SDPA")])
def test_a_kernel_failing_its_self_check_warns_once_and_keeps_the_loop(kernel, wrong, reason):
    fake = kernel("2.13", wrong)
    bounds = [0, 3, 11]
    q, k, v, cu = packed_qkv(bounds)
    with pytest.warns(UserWarning, match="failed its self-check") as record:
        assert va.varlen_causal_attention(q, k, v, cu, bounds) is None
    assert reason in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided once per configuration: no second check, no second warning
        assert va.varlen_causal_attention(q, k, v, cu, bounds) is None
    assert len(fake.calls) == 1
    q2, k2, v2, _ = packed_qkv(bounds, heads=2, kv_heads=2)  # another configuration is checked on its own
    with pytest.warns(UserWarning, match="failed its self-check"):
        va.varlen_causal_attention(q2, k2, v2, cu, bounds)


def test_the_engine_variable(kernel, monkeypatch):
    fake = kernel("2.13")
    bounds = [0, 5, 9]
    q, k, v, cu = packed_qkv(bounds)
    monkeypatch.setenv(va.ENGINE_VARIABLE, "loop")
    assert va.varlen_causal_attention(q, k, v, cu, bounds) is None and not fake.calls
    monkeypatch.setenv(va.ENGINE_VARIABLE, "flash")
    with pytest.raises(ValueError, match="PACS_PACKED_ATTENTION='flash': expected one of auto, loop, varlen"):
        va.varlen_causal_attention(q, k, v, cu, bounds)
    monkeypatch.setenv(va.ENGINE_VARIABLE, "varlen")
    assert va.varlen_causal_attention(q, k, v, cu, bounds) is not None
    with pytest.raises(ValueError, match="PACS_PACKED_ATTENTION=varlen: .*attention dropout 0.1"):
        va.varlen_causal_attention(q, k, v, cu, bounds, dropout=0.1)


def test_where_the_kernel_cannot_run_it_says_why(monkeypatch):
    monkeypatch.delenv(va.ENGINE_VARIABLE, raising=False)
    bounds = [0, 5, 9]
    q, k, v, cu = packed_qkv(bounds)
    assert va.varlen_unavailable(q, k).startswith("no varlen kernel on cpu")  # this machine: the loop
    assert va.varlen_causal_attention(q, k, v, cu, bounds) is None
    assert va.new_decisions(torch.device("cpu")) is None  # no kernel here: nothing for a trainer to report
    monkeypatch.setenv(va.ENGINE_VARIABLE, "varlen")
    with pytest.raises(ValueError, match="no varlen kernel on cpu"):
        va.varlen_causal_attention(q, k, v, cu, bounds)
    monkeypatch.setattr(va, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    assert "float64" in va.varlen_unavailable(q, k)
    with pytest.raises(ValueError, match=r"PACS_PACKED_ATTENTION=varlen: .* here: torch.float32 \(the flash kernel"):
        va.check_requested_engine(torch.device("cpu"), torch.float32)  # pacs train's check, before any work
    va.check_requested_engine(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setattr(va, "KERNEL_DTYPES", (torch.float64,))
    assert "dropout" in va.varlen_unavailable(q, k, dropout=0.1)
    assert "head_dim 12" in va.varlen_unavailable(torch.zeros(1, 4, 3, 12, dtype=torch.float64),
                                                  torch.zeros(1, 2, 3, 12, dtype=torch.float64))
    assert "not a multiple" in va.varlen_unavailable(q, torch.zeros(1, 3, 9, 8, dtype=torch.float64))
    assert "softcap" in va.varlen_unavailable(q, k, extras={"softcap": 30.0, "sliding_window": None})


def test_a_packed_training_step_through_the_kernel_equals_the_loop(kernel, monkeypatch):
    """The Hugging Face model's packed forward (pacs_packed_sdpa, grouped key/value heads) and the PACS
    loss: the same loss and gradients (float64) with one kernel call per layer as with the loop."""
    batch = random_batch(2)
    old_logp = torch.randn(batch.targets.shape, dtype=torch.float64) * 0.1 - 3.0
    monkeypatch.setenv(va.ENGINE_VARIABLE, "loop")
    loss_loop, grads_loop, _ = loss_and_grads(tiny_policy(1), batch, old_logp, True, config())
    monkeypatch.setenv(va.ENGINE_VARIABLE, "varlen")
    fake = kernel("2.13")
    loss_fused, grads_fused, _ = loss_and_grads(tiny_policy(1), batch, old_logp, True, config())
    assert len(fake.calls) == 1 + 2  # the self-check, then one per layer
    torch.testing.assert_close(loss_fused, loss_loop, rtol=1e-10, atol=1e-12)
    for name in grads_loop:
        torch.testing.assert_close(grads_fused[name], grads_loop[name], rtol=1e-9, atol=1e-12, msg=name)
    # padded rows (no cu_seq_lens) never reach the kernel
    loss_and_grads(tiny_policy(1), batch, old_logp, False, config())
    assert len(fake.calls) == 3


@pytest.mark.parametrize("lever", ["checkpointing", "checkpointing_reentrant", "offload"])
def test_the_first_call_inside_a_checkpointed_or_offloaded_layer(kernel, monkeypatch, lever):
    """The self-check runs at the first packed call, inside a decoder layer's forward: under gradient
    checkpointing (whose saved-tensor hooks would count the check's tensors and break the recompute) and under
    activation offload (save_on_cpu) the training step still equals the loop's, the kernel engaged."""
    from pacs.model.memory import activation_offload

    batch = random_batch(2)
    old_logp = torch.randn(batch.targets.shape, dtype=torch.float64) * 0.1 - 3.0

    def step():
        policy = tiny_policy(1)
        if lever.startswith("checkpointing"):
            policy.causal_lm.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": lever.endswith("reentrant")})
        with activation_offload(lever == "offload", torch.device("cpu")):
            return loss_and_grads(policy, batch, old_logp, True, config())

    monkeypatch.setenv(va.ENGINE_VARIABLE, "loop")
    loss_loop, grads_loop, _ = step()
    monkeypatch.setenv(va.ENGINE_VARIABLE, "varlen")
    fake = kernel("2.11")
    loss_fused, grads_fused, _ = step()
    assert len(fake.calls) >= 1 + 2 and va._self_checks == {(torch.device("cpu"), torch.float64, 4, 2, 8, None): None}
    torch.testing.assert_close(loss_fused, loss_loop, rtol=1e-10, atol=1e-12)
    for name in grads_loop:
        torch.testing.assert_close(grads_fused[name], grads_loop[name], rtol=1e-9, atol=1e-12, msg=name)


def test_the_sequence_parallel_attention_takes_the_kernel_too(kernel, monkeypatch):
    """Its all-to-alls replaced by the identity (one rank), the Ulysses attention's per-sequence step is the
    kernel where it runs and the loop otherwise, with the same result."""
    import pacs.model.sequence_parallel as sp_module

    monkeypatch.setattr(sp_module._Exchange, "apply", staticmethod(lambda x, sp, to_heads: x))
    one_rank = type("OneRank", (), {"size": 1})()
    bounds = [0, 6, 7, 13]
    q, k, v, cu = packed_qkv(bounds)
    module = torch.nn.Module()
    kwargs = {"cu_seq_lens_q": cu, "sliding_window": None, sp_module.SEQUENCE_PARALLEL_KWARG: one_rank}
    fake = kernel("2.13")
    out, _ = _ulysses_attention(module, q, k, v, None, **dict(kwargs))
    monkeypatch.setenv(va.ENGINE_VARIABLE, "loop")
    ref, _ = _ulysses_attention(module, q, k, v, None, **dict(kwargs))
    assert len(fake.calls) == 2 and out.shape == (1, 13, 4, 8)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def test_what_ran_is_reported_once_per_configuration(kernel):
    """The trainer prints ``new_decisions("cuda")`` after a step: what each configuration ran as, once."""
    bounds = [0, 5, 9]
    q, k, v, cu = packed_qkv(bounds)
    kernel("2.13")
    va.varlen_causal_attention(q, k, v, cu, bounds)
    va.varlen_causal_attention(q, k, v, cu, bounds, scaling=0.5)
    va.varlen_causal_attention(q, k, v, cu, bounds, dropout=0.1)  # already decided for this configuration
    assert va.new_decisions("cuda") is None  # these ran on the CPU
    assert va.new_decisions("cpu") == ("float64, 4 heads / 2 key-value heads of 8: one flash varlen call per layer; "
                                       "float64, 4 heads / 2 key-value heads of 8, scale 0.5: one flash varlen call "
                                       "per layer")
    assert va.new_decisions("cpu") is None
    q2, k2, v2, _ = packed_qkv(bounds, heads=2, kv_heads=2, head_dim=12)
    va.varlen_causal_attention(q2, k2, v2, cu, bounds)
    assert va.new_decisions("cpu") == ("float64, 2 heads / 2 key-value heads of 12: SDPA once per sequence "
                                       "(head_dim 12 (the flash kernel takes multiples of 8 up to 256))")


def test_the_real_kernel_takes_our_layout_and_grouped_heads_on_the_meta_device(monkeypatch):
    """The installed PyTorch's own varlen_attn (no kernel runs on the meta device, its shape rules do): our
    (N, heads, D) views of (1, heads, N, D) tensors, int32 offsets, grouped key/value heads; the gradients come
    back in the inputs' shapes."""
    monkeypatch.delenv(va.ENGINE_VARIABLE, raising=False)
    if va._varlen_kernel()[0] is None:
        pytest.skip(va._varlen_kernel()[1])
    q, k, v = (torch.empty(1, h, 10, 64, device="meta", dtype=torch.bfloat16).requires_grad_() for h in (4, 2, 2))
    out = va._run_kernel(q, k, v, torch.tensor([0, 3, 10], dtype=torch.int32, device="meta"), 7, None)
    assert out.shape == q.shape
    grads = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_a_configuration_first_met_inside_a_backward_runs_the_loop_there(kernel):
    """The self-check's thread needs the autograd engine: inside a backward (this thread holds it) a configuration
    not yet checked runs the loop, unchecked; one already checked runs the kernel there too (a checkpointed
    layer's recompute must repeat its forward)."""
    fake = kernel("2.13")
    bounds = [0, 5, 9]
    q, k, v, cu = packed_qkv(bounds)
    seen = []

    class CallsAttentionInItsBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(va.varlen_causal_attention(q.detach(), k.detach(), v.detach(), cu, bounds))
            return grad

    x = torch.ones(2, requires_grad=True)
    CallsAttentionInItsBackward.apply(x).sum().backward()
    assert seen == [None] and not fake.calls and not va._self_checks
    assert va.varlen_causal_attention(q, k, v, cu, bounds) is not None  # checked now, in a forward
    CallsAttentionInItsBackward.apply(x).sum().backward()
    assert seen[-1] is not None and len(fake.calls) == 3


def test_mismatched_key_dtype_and_a_first_call_that_fell_back(kernel):
    fake = kernel("2.13")
    bounds = [0, 5, 9]
    q, k, v, cu = packed_qkv(bounds)
    assert "key/value in torch.float32" in va.varlen_unavailable(q, k.float())
    assert va.varlen_causal_attention(q, k, v, cu, bounds, dropout=0.1) is None  # this call: the loop
    assert va.varlen_causal_attention(q, k, v, cu, bounds) is not None and fake.calls
    assert va.new_decisions("cpu").endswith("one flash varlen call per layer")  # what the configuration runs


def test_a_layer_that_is_not_causal_cannot_be_packed(kernel):
    """The packed attention keeps each sequence causal: a non-causal layer is refused (not silently made causal),
    and a call that says is_causal=True itself is fine."""
    import pacs.model.sequence_parallel as sp_module
    from pacs.model.packed_attention import packed_call, packed_sdpa_attention

    kernel("2.13")
    bounds = [0, 5, 9]
    q, k, v, cu = packed_qkv(bounds)
    layer = torch.nn.Module()
    with packed_call(bounds):
        out, _ = packed_sdpa_attention(layer, q, k, v, None, cu_seq_lens_q=cu, is_causal=True)
        torch.testing.assert_close(out, va.loop_causal_attention(q, k, v, bounds).transpose(1, 2))
        layer.is_causal = False
        with pytest.raises(ValueError, match="Module is not a causal attention layer.*cannot be packed"):
            packed_sdpa_attention(layer, q, k, v, None, cu_seq_lens_q=cu)
        one_rank = type("OneRank", (), {"size": 1})()
        with pytest.raises(ValueError, match="sequence parallelism keeps every packed sequence causal"):
            _ulysses_attention(layer, q, k, v, None, cu_seq_lens_q=cu, **{sp_module.SEQUENCE_PARALLEL_KWARG: one_rank})


def test_under_autocast_a_float32_query_and_key_take_the_kernel_in_16_bit(kernel):
    """bfloat16 autocast over float32 weights (the trainer's default on a GPU): Hugging Face's RoPE multiplies the
    16-bit query and key by float32 cos/sin, so they reach the attention in float32 beside a 16-bit value. Autocast
    casts an SDPA call's inputs to its dtype; the kernel's caller does the same, instead of refusing float32 and
    running the per-sequence loop (what the GPU run's trainer reported before)."""
    fake = kernel("2.13")
    bounds = [0, 5, 12]
    q, k, v, cu = packed_qkv(bounds, head_dim=16)
    q32, k32 = (x.detach().float().requires_grad_() for x in (q, k))
    v16 = v.detach().bfloat16().requires_grad_()
    assert va.varlen_causal_attention(q32, k32, v16, cu, bounds) is None and not fake.calls  # no autocast: refused
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = va.varlen_causal_attention(q32, k32, v16, cu, bounds)
        ref = va.loop_causal_attention(q32, k32, v16, bounds)
    assert out is not None and out.dtype == ref.dtype == torch.bfloat16 and len(fake.calls) == 2
    torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2, atol=3e-2)
    grads = torch.autograd.grad(out.float().sum(), (q32, k32, v16))
    assert [g.dtype for g in grads] == [torch.float32, torch.float32, torch.bfloat16]
    assert all(bool(g.abs().sum() > 0) for g in grads)


def test_a_mixed_precision_policy_runs_its_packed_rows_through_the_kernel(kernel):
    """The policy as the trainer builds it on a GPU (float32 parameters, bfloat16 autocast): the packed forward
    reaches the kernel in bfloat16 in every layer, and the report says bfloat16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pacs.model.mixed_precision import Precision
    from pacs.model.packed_attention import packed_call
    from pacs.model.packing import enable_packed_attention, packed_backbone_kwargs
    from pacs.model.policy import Policy

    fake = kernel("2.13")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    enable_packed_attention(model, torch.device("cpu"))
    policy = Policy(model, Precision(torch.bfloat16, torch.float32), autocast=True)
    bounds = [0, 5, 12]
    ids = torch.randint(0, 64, (1, 12))
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with packed_call(bounds):
        hidden, _, _ = policy(ids, None, **packed_backbone_kwargs(positions, torch.tensor(bounds), 7))
    hidden.float().sum().backward()
    assert len(fake.calls) == 1 + 2  # the self-check, then one per layer
    assert va.new_decisions("cpu") == "bfloat16, 4 heads / 2 key-value heads of 16: one flash varlen call per layer"
    assert all(p.grad is not None and p.dtype == torch.float32 for p in policy.backbone.parameters())
