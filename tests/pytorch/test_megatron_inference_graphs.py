"""Megatron-core's inference with its CUDA graphs on (``cuda_graph_impl="local"``), on this package.

Which path captures: in megatron-core 0.19.2 only static batching captures a decode step (one graph per
TransformerLayer, key ``(tokens, decode)``, replayed at every later step), and only with ``flash_decode=True``:
``Attention.forward`` raises "CUDA graphs must use flash decode with static batching!" otherwise, and with it calls
the module-level ``flash_attn_with_kvcache`` (flash-attn's), not ``core_attention``. Dynamic batching calls
flash-attn's varlen kernels directly. So with Megatron unchanged no captured step reaches this package's
DotProductAttention; ``transformer_engine.pytorch.integrations.megatron.install()`` puts this package's
``flash_attn_with_kvcache`` (a capturable step on DotProductAttention) there. Prefill steps stay eager, on
``TEDotProductAttention`` as without graphs.

CPU (fp32; fused kernels under TRITON_INTERPRET=1, else the unfused backend): the setup up to the capture. The
config Megatron needs validates; generation with ``flash_decode`` on this package's step gives the tokens and
logits of the ordinary path bitwise; every decode step's call is the same call (shapes, Python arguments, the
cache's storage) with the lengths only in device tensors; the step reads nothing on the host while a capture
is simulated. No capture is faked on CPU.

CUDA: Megatron's TextGenerationController generates with graphs on and off; tokens and every step's logits
equal bitwise, and the graphs were captured (one per layer) and replayed (one per layer and decode step),
counted on torch.cuda.CUDAGraph and on Megatron's record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from unittest import mock

import pytest
import torch

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed (pip install megatron-core==0.19.2)", allow_module_level=True)

import transformer_engine.pytorch as te  # noqa: E402
from test_host_sync import count_host_reads  # noqa: E402
from test_megatron_gpt import VOCAB, _config, megatron_world  # noqa: E402,F401
from test_megatron_inference import _generate  # noqa: E402
from transformer_engine.pytorch.integrations import megatron as te_megatron  # noqa: E402

PROMPTS = ([3, 17, 5, 9, 41], [8, 2, 60, 33, 12, 7, 25])
NEW = 6
TOTAL = max(map(len, PROMPTS)) + NEW
DECODE_STEPS = NEW - 1  # after the prompts: the step that ends the longer prompt samples its first token
ON_GPU = torch.cuda.is_available()


@pytest.fixture
def world(megatron_world, monkeypatch):
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.delenv(name, raising=False)
    return megatron_world


@pytest.fixture
def installed(monkeypatch):
    """This package's flash_attn_with_kvcache in Megatron's attention module, counted."""
    import megatron.core.transformer.attention as mattn

    calls = []

    def counted(*args, **kwargs):
        capturing = ON_GPU and torch.cuda.is_current_stream_capturing()
        calls.append(dict(args=args, kwargs=kwargs, capturing=capturing))
        return te_megatron.flash_attn_with_kvcache(*args, **kwargs)

    original = mattn.flash_attn_with_kvcache
    previous = te_megatron.install()
    assert previous is original and mattn.flash_attn_with_kvcache is te_megatron.flash_attn_with_kvcache
    monkeypatch.setattr(mattn, "flash_attn_with_kvcache", counted)
    yield calls
    monkeypatch.undo()
    te_megatron.uninstall(previous)
    assert mattn.flash_attn_with_kvcache is original


def _build(device, pos_emb="learned_absolute", seed=0, **changes):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.enums import AttnBackend

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(seed)
    # inference_cuda_graph_scope=None: replace() reruns Megatron's __post_init__, which derives the scope from
    # cuda_graph_impl only when it is unset (the base config's is already resolved to "none").
    config = dataclasses.replace(_config(dtype, device), attention_backend=AttnBackend.fused if device == "cuda"
                                 else AttnBackend.auto, inference_cuda_graph_scope=None, **changes)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
                     vocab_size=VOCAB, max_sequence_length=TOTAL, position_embedding_type=pos_emb)
    return model.to(device=device, dtype=dtype).eval()


def test_megatron_accepts_the_graph_config_on_this_package(world):
    """The config Megatron's inference graphs need validates (on any machine): local graphs, per-layer
    inference scope, flash decode. Building the model with it needs CUDA (graph pool), done in the CUDA test."""
    from megatron.core.transformer.enums import InferenceCudaGraphScope

    config = dataclasses.replace(_config(torch.float32, "cpu"), flash_decode=True, cuda_graph_impl="local",
                                 inference_cuda_graph_scope=None)
    assert config.cuda_graph_impl == "local" and config.flash_decode
    assert config.inference_cuda_graph_scope == InferenceCudaGraphScope.layer
    assert not config.cuda_graph_modules  # empty: each TransformerLayer is graphed whole


def _cuda_offsets_on_cpu(monkeypatch):
    # GPTModel.forward makes the step's sequence_len_offset tensor (with graphs or flash decode) on
    # torch.cuda.current_device(): on CPU it gets the CPU (the only CUDA-only line on these paths; Megatron's
    # cache buffers are handed in by _generate).
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))


@pytest.mark.skipif(ON_GPU, reason="CPU: the CUDA test builds the graphed model itself")
def test_megatron_static_decode_with_graphs_needs_flash_decode(world, monkeypatch):
    """Why the adapter: with local CUDA graphs configured, Megatron's static-batch decode step refuses the
    ordinary call (TEDotProductAttention's) and asks for flash decode; the prefill steps before it run."""
    _cuda_offsets_on_cpu(monkeypatch)
    model = _build("cpu")
    model.config.cuda_graph_impl = "local"  # after the build: graph managers need CUDA, the check does not
    with pytest.raises(ValueError, match="CUDA graphs must use flash decode with static batching"):
        _generate(model, PROMPTS, NEW)


@pytest.mark.skipif(ON_GPU, reason="the CPU setup check; on CUDA the graph test runs the real capture")
def test_flash_decode_on_this_package_generates_the_ordinary_path_bitwise_on_cpu(world, monkeypatch, installed):
    _cuda_offsets_on_cpu(monkeypatch)
    plain = _build("cpu")
    flash = _build("cpu", flash_decode=True)
    flash.load_state_dict(plain.state_dict())
    layers = plain.config.num_layers

    dpa_calls = []
    forward = te.DotProductAttention.forward

    def spy(module, q, k, v, *args, **kwargs):
        dpa_calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), k_ptr=k.untyped_storage().data_ptr(),
                              kwargs={n: x for n, x in kwargs.items() if not torch.is_tensor(x)},
                              cu_kv=kwargs.get("cu_seqlens_kv"), module=module))
        out = forward(module, q, k, v, *args, **kwargs)
        dpa_calls[-1]["backend"] = module.last_backend
        return out

    monkeypatch.setattr(te.DotProductAttention, "forward", spy)
    tokens, logits = _generate(plain, PROMPTS, NEW)
    plain_calls, dpa_calls[:] = list(dpa_calls), []
    assert not installed
    reads = []
    with mock.patch.object(te_megatron, "flash_attn_with_kvcache",
                           _reading_nothing_while_capturing(te_megatron.flash_attn_with_kvcache, reads)):
        flash_tokens, flash_logits = _generate(flash, PROMPTS, NEW)
    assert torch.equal(flash_tokens, tokens) and torch.equal(flash_logits, logits)

    # Every decode step of every layer went through this package's flash_attn_with_kvcache (and then its
    # DotProductAttention); the earlier steps through TEDotProductAttention as without flash decode.
    assert len(installed) == layers * DECODE_STEPS
    assert reads == [[]] * len(installed), reads  # no host read in any step while "capturing"
    decode = [c for c in dpa_calls if c["kwargs"].get("qkv_format") == "bshd"]
    assert len(decode) == layers * DECODE_STEPS and len(dpa_calls) - len(decode) == len(plain_calls) - len(decode)
    # One backend for all: the fused kernels under TRITON_INTERPRET=1, else the unfused backend.
    backends = {c["backend"] for c in dpa_calls}
    assert len(backends) == 1 and backends <= {"FusedAttention", "UnfusedDotProductAttention"}, backends
    b = len(PROMPTS)
    for layer in range(layers):
        steps = decode[layer::layers]
        first = steps[0]
        for i, c in enumerate(steps):
            # The same call at every step: shapes (the whole cache: TOTAL positions of the first b slots),
            # Python arguments, and the cache's storage; only the device lengths change.
            assert c["q"] == first["q"] == (b, 1, 4, 8) and c["k"] == first["k"] == (b, TOTAL, 4, 8), c
            assert c["kwargs"] == first["kwargs"] and c["kwargs"]["max_seqlen_kv"] == TOTAL
            assert c["k_ptr"] == first["k_ptr"] and c["module"] is first["module"]
            # sequence_len_offset + 1 keys per sequence at decode step i
            n = TOTAL - NEW + 1 + i
            assert c["cu_kv"].tolist() == [0, n, 2 * n], (i, c["cu_kv"])


def _reading_nothing_while_capturing(fn, reads):
    """``fn`` with its host reads recorded (one list per call) as they would be while a graph is captured."""

    def wrapped(*args, **kwargs):
        with count_host_reads(capturing=True) as got:
            out = fn(*args, **kwargs)
        reads.append(list(got))
        return out

    return wrapped


def test_flash_attn_with_kvcache_writes_the_cache_and_attends_like_the_ordinary_call():
    """One step, several tokens per sequence and ragged lengths, RoPE on: the cache gets the rotated keys at
    each sequence's length, and the rows are DotProductAttention's over exactly the cached keys."""
    g = torch.Generator().manual_seed(0)
    b, s, cap, h, hk, d = 3, 2, 10, 4, 2, 16
    kc = torch.randn(cap, b + 1, hk, d, generator=g)  # Megatron's layout: [S, max_batch, h_kv, d]
    vc = torch.randn(cap, b + 1, hk, d, generator=g)
    q, k, v = (torch.randn(b, s, n, d, generator=g) for n in (h, hk, hk))
    lens = torch.tensor([0, 3, 7], dtype=torch.int32)
    freqs = torch.outer(torch.arange(cap, dtype=torch.float32), torch.rand(d // 2, generator=g))
    cos, sin = freqs.cos(), freqs.sin()
    before_k, before_v = kc.clone(), vc.clone()
    out = te_megatron.flash_attn_with_kvcache(q, kc.permute(1, 0, 2, 3), vc.permute(1, 0, 2, 3), k, v, cos, sin,
                                              cache_seqlens=lens, causal=True, rotary_interleaved=False)
    assert out.shape == (b, s, h, d)

    def rope(x, pos):  # the halves convention, written out per position
        c, sn = cos[pos][:, None], sin[pos][:, None]
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        return torch.cat((x1 * c - x2 * sn, x1 * sn + x2 * c), -1)

    dpa = te.DotProductAttention(h, d, num_gqa_groups=hk, qkv_format="bshd")
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(n, n + s)
        ref_k, ref_v = before_k[:, i].clone(), before_v[:, i].clone()
        ref_k[n:n + s], ref_v[n:n + s] = rope(k[i], pos), v[i]
        assert torch.equal(kc[:, i], ref_k) and torch.equal(vc[:, i], ref_v)
        ref = dpa(rope(q[i], pos)[None], ref_k[None, :n + s], ref_v[None, :n + s], attn_mask_type="causal_bottom_right")
        assert torch.equal(out[i].reshape(s, -1), ref[0]), i
    assert torch.equal(kc[:, b], before_k[:, b]) and torch.equal(vc[:, b], before_v[:, b])  # the spare slot


def test_flash_attn_with_kvcache_refuses_what_it_does_not_implement():
    q = torch.zeros(1, 1, 2, 8)
    kc = torch.zeros(1, 4, 2, 8)
    for kwargs in (dict(return_softmax_lse=True), dict(window_size=(2, 0)), dict(block_table=torch.zeros(1, 1)),
                   dict(alibi_slopes=torch.zeros(2))):
        with pytest.raises(NotImplementedError):
            te_megatron.flash_attn_with_kvcache(q, kc, kc, **kwargs)


# ------------------------------------------------------------------------------------------------ CUDA


@contextlib.contextmanager
def _graph_counts():
    """Counts torch.cuda.CUDAGraph captures (capture_begin) and replays, whoever makes them."""
    counts = {"captures": 0, "replays": 0}
    begin, replay = torch.cuda.CUDAGraph.capture_begin, torch.cuda.CUDAGraph.replay

    def counted_begin(self, *args, **kwargs):
        counts["captures"] += 1
        return begin(self, *args, **kwargs)

    def counted_replay(self, *args, **kwargs):
        counts["replays"] += 1
        return replay(self, *args, **kwargs)

    with mock.patch.object(torch.cuda.CUDAGraph, "capture_begin", counted_begin), \
            mock.patch.object(torch.cuda.CUDAGraph, "replay", counted_replay):
        yield counts


@pytest.fixture
def graph_world(world):
    """Megatron's CUDA graphs need a graph-safe RNG tracker (its inference tracker); afterwards its graphs,
    global record, mempool and the side stream it switched to are dropped."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import cuda_graphs

    model_parallel_cuda_manual_seed(123, inference_rng_tracker=True, force_reset_rng=True)
    yield world
    cuda_graphs.delete_cuda_graphs()
    torch.cuda.set_stream(torch.cuda.default_stream())
    model_parallel_cuda_manual_seed(123, te_rng_tracker=True, force_reset_rng=True)


def _controller_generate(model):
    """Megatron's TextGenerationController, greedy, batch = max_batch_size (no padding rows, so graphs on and
    off run the same shapes). Returns the generated tokens [b, NEW] and every step's logits."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.inference_request import InferenceRequest
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )
    from megatron.core.inference.utils import InferenceMode

    class Tokenizer:
        eod = VOCAB - 1

        def detokenize(self, tokens):
            return " ".join(map(str, tokens))

    context = StaticInferenceContext(max_batch_size=len(PROMPTS), max_sequence_length=TOTAL)
    wrapper = GPTInferenceWrapper(model, context)
    step, logits = wrapper.run_one_forward_step, []

    def recorded(*args, **kwargs):
        out = step(*args, **kwargs)
        logits.append(out.clone())
        return out

    wrapper.run_one_forward_step = recorded
    controller = TextGenerationController(wrapper, Tokenizer())
    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW)
    params.no_early_termination = True
    requests = {str(i): InferenceRequest(request_id=str(i), prompt=Tokenizer().detokenize(p), prompt_tokens=list(p),
                                         sampling_params=params) for i, p in enumerate(PROMPTS)}
    with InferenceMode.active():
        done = controller.generate_all_output_tokens_static_batch(requests)
    torch.cuda.synchronize()
    return torch.stack([done[str(i)].generated_tokens for i in range(len(PROMPTS))]), logits


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA: Megatron's CUDA graphs (CudaGraphManager, graph pool) and its "
                    "TextGenerationController are CUDA-only")
@pytest.mark.parametrize("pos_emb", ["learned_absolute", "rope"])
def test_megatron_cuda_graph_decode_equals_eager_bitwise(graph_world, installed, pos_emb):
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

    eager = _build("cuda", pos_emb, flash_decode=True)
    graphed = _build("cuda", pos_emb, flash_decode=True, cuda_graph_impl="local")
    graphed.load_state_dict(eager.state_dict())
    layers = eager.config.num_layers
    assert all(hasattr(layer, "cudagraph_manager") for layer in graphed.decoder.layers)
    assert not any(hasattr(layer, "cudagraph_manager") for layer in eager.decoder.layers)

    with _graph_counts() as counts:
        tokens, logits = _controller_generate(eager)
    assert counts == {"captures": 0, "replays": 0}
    assert len(installed) == layers * DECODE_STEPS and not any(c["capturing"] for c in installed)
    installed.clear()

    with _graph_counts() as counts:
        graph_tokens, graph_logits = _controller_generate(graphed)
    # One graph per layer, captured at the first decode step (Megatron's key: one token, decode mode), then
    # replayed at that step and every later one.
    assert counts == {"captures": layers, "replays": layers * DECODE_STEPS}, counts
    record = _CudagraphGlobalRecord.cudagraph_inference_record
    assert len(record) == layers and all(r[0].fwd_graph_recorded for r in record)
    assert sum(c["capturing"] for c in installed) == layers  # the captured step is this package's call

    assert torch.equal(graph_tokens, tokens)
    assert len(graph_logits) == len(logits)
    for i, (a, b) in enumerate(zip(graph_logits, logits)):
        assert torch.equal(a, b), f"step {i}: logits with CUDA graphs differ from eager"
