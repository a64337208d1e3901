"""Megatron-core's inference path (the real package, 0.19.2 in the newest CI env) on this package.

What Megatron-core 0.19.2 does when a GPTModel built with its TransformerEngine layer spec generates:

* Static batching (``StaticInferenceContext``, ``GPTInferenceWrapper``,
  ``TextGenerationController.generate_all_output_tokens_static_batch``, which
  ``StaticInferenceEngine(..., legacy=True)`` runs) is the path that reaches TransformerEngine's
  attention. The controller runs one prefill step over the shortest prompt's tokens, then one token
  per step (a longer prompt's next prompt token replaces the sampled one until its prompt is used up).
* Megatron keeps the KV cache itself (``Attention._adjust_key_value_for_inference``): per layer a
  ``[max_sequence_length, max_batch_size, h_kv, d]`` key and value buffer in the context's
  ``key_value_memory_dict``. Core attention (``TEDotProductAttention``, a subclass of this package's
  ``DotProductAttention``) gets sbhd ``q`` of the step's tokens and ``k``, ``v`` = the buffers' first
  ``offset + step`` positions, ``attention_mask=None``, and ``attn_mask_type="causal"`` for the
  prefill step, ``"no_mask"`` for every later step (``sequence_len_offset > 0``; TEDotProductAttention
  makes a one-token ``no_mask`` step ``"causal_bottom_right"`` when the config has a sliding window).
  It never passes ``inference_params``: this package's KV cache API is not involved.
* Dynamic batching (``DynamicInferenceContext``, ``DynamicInferenceEngine``, and
  ``StaticInferenceEngine`` without ``legacy=True``, which runs on the dynamic engine) and
  ``flash_decode`` call flash-attn's kernels directly, never TransformerEngine's attention.

Tests (CPU fp32; CUDA bf16 with this package's fused kernels):

* greedy generation through Megatron's wrapper and context completes, and this package's
  DotProductAttention served every attention call with the masks and shapes above;
* each call's output rows are bitwise the rows of a training-style call (causal, over the whole final
  sequence, with other tokens after them) for the same tokens;
* with every GEMM computed one token row at a time (so its bits do not depend on how many rows a call
  has), the generated tokens' logits are bitwise those of one training-style forward over the final
  sequences; with Megatron's ordinary GEMMs they are not (torch's CPU GEMM and cuBLAS pick kernels and
  reduction orders by the row count: a decode step's GEMMs over b rows and the forward's over b * s
  rows round differently), and
  the difference is no larger than Megatron's local spec (no TransformerEngine) shows for the same
  comparison;
* on CUDA, Megatron's own TextGenerationController generates the same tokens.

On CPU the test drives ``GPTInferenceWrapper`` with the controller's step schedule itself, because the
controller and Megatron's KV-cache allocation are CUDA-only (``torch.cuda.Event`` timings, ``.cuda()``,
``torch.cuda.current_device()``); it hands Megatron CPU KV buffers of the shape Megatron allocates.
Full attention, and a sliding window with GQA. Learned absolute position embeddings on CPU (Megatron's
RotaryEmbedding moves its frequencies to CUDA); RoPE too on CUDA. Skipped with the reason when
megatron-core is not installed.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed (pip install megatron-core==0.19.2)", allow_module_level=True)

import transformer_engine.pytorch as te  # noqa: E402
from test_megatron_gpt import VOCAB, _ScoreBuffer, _config, _load, _te_to_local, megatron_world  # noqa: E402,F401

PROMPTS = ([3, 17, 5, 9, 41], [8, 2, 60, 33, 12, 7, 25])  # different lengths: prefill 5, then 6 steps
NEW = 4
TOTAL = max(map(len, PROMPTS)) + NEW
FIRST = min(map(len, PROMPTS))
# Attention variants: (window_size, num_query_groups). "swa_gqa": each token sees itself and the 2
# tokens before it, 2 KV heads for the 4 query heads; "gqa": its full-attention twin.
VARIANTS = {"mha": (None, None), "swa_gqa": ((2, 0), 2), "gqa": (None, 2)}
# (device, position embedding, variant); the local-spec comparison takes the "mha" cases.
CASES = [("cpu", "learned_absolute", "mha"), ("cpu", "learned_absolute", "swa_gqa")]
if torch.cuda.is_available():
    CASES += [("cuda", "learned_absolute", "mha"), ("cuda", "rope", "mha"), ("cuda", "rope", "swa_gqa")]
MHA_CASES = [c[:2] for c in CASES if c[2] == "mha"]


@pytest.fixture
def world(megatron_world, monkeypatch):
    # Megatron sets NVTE_FLASH_ATTN, NVTE_FUSED_ATTN and NVTE_UNFUSED_ATTN from the config's
    # attention_backend when it builds a model, and refuses values an earlier model left that differ:
    # each test starts without them (and gets the values it started with back).
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.delenv(name, raising=False)
    return megatron_world


def _build(spec_name, device, pos_emb, variant="mha", seed=0):
    import dataclasses

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.enums import AttnBackend

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    spec = get_gpt_layer_with_transformer_engine_spec() if spec_name == "te" else get_gpt_layer_local_spec()
    torch.manual_seed(seed)
    window, groups = VARIANTS[variant]
    # On a GPU, Megatron's attention_backend="fused" (NVTE_FLASH_ATTN=0, NVTE_UNFUSED_ATTN=0): the
    # generation and the training-style forward both run this package's fused kernels (flash-attn-4,
    # where installed and selected, makes no bitwise promise between them). On CPU the default (auto).
    backend = AttnBackend.fused if device == "cuda" else AttnBackend.auto
    config = dataclasses.replace(_config(dtype, device), window_size=window, num_query_groups=groups,
                                 attention_backend=backend)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                     max_sequence_length=TOTAL, position_embedding_type=pos_emb)
    return model.to(device=device, dtype=dtype).eval()


def _causal_mask(n, device):
    """Megatron's causal mask, [1, 1, n, n], True = masked out (what the local spec needs; the
    TransformerEngine spec builds its own)."""
    return torch.triu(torch.ones(1, 1, n, n, dtype=torch.bool, device=device), 1)


def _generate(model, prompts=PROMPTS, new=NEW, explicit_mask=False):
    """Greedy generation with Megatron's GPTInferenceWrapper and StaticInferenceContext, stepping as
    TextGenerationController.generate_all_output_tokens_static_batch does. Returns the final tokens
    [b, TOTAL] and, for each step, the logits that chose position FIRST + step: [b, steps, vocab]."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.utils import InferenceMode
    from megatron.core.transformer.attention import Attention

    device = next(model.parameters()).device
    lens = torch.tensor([len(p) for p in prompts], device=device)
    total = int(lens.max()) + new
    # A context with room for more sequences than the batch, as a server's: Megatron then passes k, v as
    # strided views of its cache buffers (their batch dim a slice of max_batch_size).
    room = len(prompts) + 1
    context = StaticInferenceContext(max_batch_size=room, max_sequence_length=total)
    if device.type == "cpu":
        # Attention._allocate_memory allocates on torch.cuda.current_device(); Megatron uses buffers
        # already in key_value_memory_dict, so on CPU it gets these (the same shape and dtype).
        for m in model.modules():
            if isinstance(m, Attention):
                context.key_value_memory_dict[m.layer_number] = tuple(
                    torch.empty(total, room, m.num_query_groups_per_partition, dim,
                                dtype=next(model.parameters()).dtype)
                    for dim in (m.key_hidden_size, m.val_hidden_size))
    wrapper = GPTInferenceWrapper(model, context)
    wrapper.prep_model_for_inference()
    tokens = torch.zeros(len(prompts), total, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p)
    inputs = wrapper.prep_inference_input(tokens)
    if explicit_mask:
        inputs["attention_mask"] = _causal_mask(total, device)
    start, end, chosen = 0, int(lens.min()), []
    while end < total:
        batch = wrapper.get_batch_for_context_window(inputs, start, end)
        with InferenceMode.active():  # as the engines set it: the logits of each row's last token only
            logits = wrapper.run_one_forward_step(batch)  # [b, 1, vocab]
        assert logits.shape == (len(prompts), 1, VOCAB), logits.shape
        chosen.append(logits[:, -1].clone())
        started = lens <= end
        tokens[started, end] = logits[started, -1].argmax(-1)
        start = end
        if bool(started.all()):
            context.enable_decode_mode()
        end += 1
    return tokens, torch.stack(chosen, 1)


def _forward_logits(model, tokens, explicit_mask=False):
    """One training-style forward over the final sequences (no inference context); the logits at the
    positions generation chose tokens from: [b, steps, vocab]."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)[None].expand_as(tokens)
    mask = _causal_mask(tokens.shape[1], tokens.device) if explicit_mask else None
    with torch.inference_mode():
        logits = model(tokens, positions, mask)
    return logits[:, FIRST - 1:tokens.shape[1] - 1]


class _AttentionSpy:
    """Records every call of this package's DotProductAttention.forward (Megatron's
    TEDotProductAttention reaches it through super().forward)."""

    def __init__(self, monkeypatch):
        self.calls = []
        self.forward = te.DotProductAttention.forward
        spy = self

        def forward(module, query, key, value, attention_mask=None, *args, **kwargs):
            out = spy.forward(module, query, key, value, attention_mask, *args, **kwargs)
            spy.calls.append(dict(module=module, q=query.clone(), k=key.clone(), v=value.clone(), out=out.clone(),
                                  kv_contiguous=key.is_contiguous() and value.is_contiguous(),
                                  mask=attention_mask, args=args, kwargs=dict(kwargs),
                                  backend=module.last_backend, fmt=module.qkv_format))
            return out

        monkeypatch.setattr(te.DotProductAttention, "forward", forward)


def _row_by_row_gemms(monkeypatch):
    """Every GEMM of the model (this package's Linear and LayerNormLinear, Megatron's output layer)
    computed one token row at a time: the same 1-row GEMM for a row whatever the call's row count."""
    import megatron.core.tensor_parallel.layers as mlayers

    linear, calls = torch.nn.functional.linear, {"linear": 0, "megatron": 0}

    def rowwise(x, weight, bias=None):
        calls["linear"] += 1
        rows = x.reshape(-1, x.shape[-1])
        out = torch.cat([linear(rows[i:i + 1], weight) for i in range(rows.shape[0])])
        out = out.reshape(*x.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias

    def megatron_linear(input, weight, bias, *args, **kwargs):
        calls["megatron"] += 1
        return rowwise(input, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", rowwise)
    monkeypatch.setattr(mlayers, "linear_with_grad_accumulation_and_async_allreduce", megatron_linear)
    monkeypatch.setattr(mlayers, "linear_with_frozen_weight", megatron_linear)
    return calls


@pytest.mark.parametrize("device,pos_emb,variant", CASES)
def test_megatron_static_generation_runs_on_this_package_attention(world, monkeypatch, device, pos_emb, variant):
    spy = _AttentionSpy(monkeypatch)
    model = _build("te", device, pos_emb, variant)
    window, groups = VARIANTS[variant]
    layers = model.config.num_layers
    cores = [m.core_attention for m in model.modules() if type(m).__name__ == "SelfAttention"]
    assert len(cores) == layers and all(isinstance(c, te.DotProductAttention) for c in cores)

    tokens, logits = _generate(model)
    steps = TOTAL - FIRST
    assert tokens.shape == (len(PROMPTS), TOTAL) and logits.shape == (len(PROMPTS), steps, VOCAB)
    assert torch.isfinite(logits.float()).all()
    for i, p in enumerate(PROMPTS):  # the prompts stay; the rest are greedy choices
        assert tokens[i, :len(p)].tolist() == list(p)
        assert torch.equal(tokens[i, len(p):], logits[i, len(p) - FIRST:].argmax(-1))

    # Every attention call reached this package's DotProductAttention: a causal prefill over the
    # shortest prompt, then one no_mask step per token over the cache's prefix (causal_bottom_right
    # with a sliding window: TEDotProductAttention turns a 1-token no_mask step into it); sbhd, no mask
    # tensor, no inference_params (Megatron keeps the cache), only attn_mask_type passed.
    b, h, d = len(PROMPTS), model.config.num_attention_heads, model.config.kv_channels
    g = groups or h
    step_mask = "no_mask" if window is None else "causal_bottom_right"
    expected = [("causal", (FIRST, b, h, d), (FIRST, b, g, d))] * layers
    for n in range(FIRST + 1, TOTAL):
        expected += [(step_mask, (1, b, h, d), (n, b, g, d))] * layers
    got = [(c["kwargs"].get("attn_mask_type"), tuple(c["q"].shape), tuple(c["k"].shape)) for c in spy.calls]
    assert got == expected, got
    assert [c["module"] for c in spy.calls] == cores * (steps)
    for c in spy.calls:
        assert c["mask"] is None and not c["args"] and set(c["kwargs"]) == {"attn_mask_type"}, c["kwargs"]
        assert c["fmt"] == "sbhd" and c["v"].shape == c["k"].shape and c["module"].window_size == window
        # Views of Megatron's cache buffers, whose batch dim (max_batch_size) exceeds the batch's.
        assert not c["kv_contiguous"]
    if window is not None:  # the window took effect: full attention chooses from other logits
        assert not torch.equal(logits, _generate(_build("te", device, pos_emb, "gqa"))[1])

    # One backend for all: on CUDA the fused kernels; on CPU the unfused backend, or the fused kernels
    # under TRITON_INTERPRET=1 (as CI runs this file).
    backends = {c["backend"] for c in spy.calls}
    if device == "cuda":
        assert backends == {"FusedAttention"}, backends
    else:
        assert len(backends) == 1 and backends <= {"FusedAttention", "UnfusedDotProductAttention"}, backends


@pytest.mark.parametrize("device,pos_emb,variant", CASES)
def test_each_attention_call_gives_the_training_rows_bitwise(world, monkeypatch, device, pos_emb, variant):
    """Each call Megatron made (prefill: causal over the prompt; decode: no_mask over the cache's prefix)
    equals, bitwise, the rows a training-style causal call over the whole final sequence gives the same
    queries, keys and values, with other queries and later keys around them."""
    spy = _AttentionSpy(monkeypatch)
    _generate(_build("te", device, pos_emb, variant))
    gen = torch.Generator().manual_seed(7)
    for c in spy.calls:
        q, k, v, out = c["q"], c["k"], c["v"], c["out"]
        sq, n = q.shape[0], k.shape[0]

        def around(x, rows, lo):
            full = torch.randn(TOTAL, *x.shape[1:], generator=gen).to(x.device, x.dtype)
            full[lo:lo + rows] = x
            return full

        with torch.no_grad():
            ref = spy.forward(c["module"], around(q, sq, n - sq), around(k, n, 0), around(v, n, 0), None,
                              attn_mask_type="causal")
        assert torch.equal(ref[n - sq:n], out), (c["kwargs"], tuple(q.shape), tuple(k.shape))


@pytest.mark.parametrize("device,pos_emb,variant", CASES)
def test_generated_logits_are_the_forward_logits_bitwise_with_row_invariant_gemms(world, monkeypatch, device,
                                                                                  pos_emb, variant):
    calls = _row_by_row_gemms(monkeypatch)
    model = _build("te", device, pos_emb, variant)
    tokens, logits = _generate(model)
    steps = TOTAL - FIRST
    # Per step and layer 4 GEMMs of this package's modules (qkv, proj, fc1, fc2), 1 output layer per step.
    assert calls == {"linear": 4 * model.config.num_layers * steps + steps, "megatron": steps}, calls
    assert torch.equal(logits, _forward_logits(model, tokens))


@pytest.mark.parametrize("device,pos_emb", MHA_CASES)
def test_generated_logits_match_the_forward_like_megatrons_local_spec(world, monkeypatch, device, pos_emb):
    """With Megatron's ordinary GEMMs a decode step's GEMMs (one row per sequence) round differently
    from the forward's (every token's row), so the logits differ by rounding: no more than with the
    local spec (its attention, no TransformerEngine), run from the same weights through the same
    inference path."""
    if device == "cpu":
        monkeypatch.setattr(world, "_GLOBAL_MEMORY_BUFFER", _ScoreBuffer())
    te_model = _build("te", device, pos_emb)
    local = _build("local", device, pos_emb)
    _load(local, _te_to_local(te_model.state_dict()))
    tokens, logits = _generate(te_model)
    te_err = (logits.double() - _forward_logits(te_model, tokens).double()).abs().max().item()
    local_tokens, local_logits = _generate(local, explicit_mask=True)
    ref = _forward_logits(local, local_tokens, explicit_mask=True).double()
    local_err = (local_logits.double() - ref).abs().max().item()
    eps = torch.finfo(logits.dtype).eps
    assert te_err <= 4 * max(local_err, eps * ref.abs().max().item()), (te_err, local_err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Megatron's TextGenerationController is CUDA-only")
@pytest.mark.parametrize("pos_emb", ["learned_absolute", "rope"])
def test_megatron_text_generation_controller_generates_the_same_tokens(world, monkeypatch, pos_emb):
    """Megatron's own static-batch generation loop (what StaticInferenceEngine(legacy=True) runs),
    greedy, on this package's attention: the tokens of the wrapper-driven loop above."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.inference_request import InferenceRequest
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.utils import InferenceMode
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    class Tokenizer:
        eod = VOCAB - 1

        def detokenize(self, tokens):
            return " ".join(map(str, tokens))

    spy = _AttentionSpy(monkeypatch)
    model = _build("te", "cuda", pos_emb)
    tokens, _ = _generate(model)
    layers, calls = model.config.num_layers, len(spy.calls)
    context = StaticInferenceContext(max_batch_size=len(PROMPTS), max_sequence_length=TOTAL)
    controller = TextGenerationController(GPTInferenceWrapper(model, context), Tokenizer())
    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW)
    params.no_early_termination = True  # read with getattr by the controller: never stop at eod
    requests = {str(i): InferenceRequest(request_id=str(i), prompt=Tokenizer().detokenize(p), prompt_tokens=list(p),
                                         sampling_params=params)
                for i, p in enumerate(PROMPTS)}
    with InferenceMode.active():
        done = controller.generate_all_output_tokens_static_batch(requests)
    for i, p in enumerate(PROMPTS):
        assert done[str(i)].generated_tokens.tolist() == tokens[i, len(p):len(p) + NEW].tolist()
    assert len(spy.calls) == 2 * calls == 2 * layers * (TOTAL - FIRST)
    assert {c["backend"] for c in spy.calls} == {"FusedAttention"}
