"""Megatron-core (the real package, 0.19.2 in the newest CI env) on this package.

``import megatron.core`` must succeed with transformer_engine installed (Megatron takes its
TransformerEngine code paths from ``transformer_engine.__version__``), and a tiny GPTModel built
with Megatron's default TransformerEngine layer spec (get_gpt_layer_with_transformer_engine_spec:
TELayerNormColumnParallelLinear, TEDotProductAttention, TERowParallelLinear, all built on this
package's modules) must train:

* twice from the same seed: the same losses and parameters, bitwise;
* like the same model with Megatron's local spec (get_gpt_layer_local_spec, no TransformerEngine),
  started from the same weights: its error against the local spec run in fp64 is within a small
  multiple of the local spec's own error at the same precision.

World size 1, torch.distributed initialized in this process, Megatron's parallel_state
initialized. CPU: fp32 (gloo). CUDA: bf16, this package's fused attention kernels (NCCL).
Skipped with the reason when megatron-core is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest
import torch

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed (pip install megatron-core==0.19.2)", allow_module_level=True)

import transformer_engine  # noqa: E402
import transformer_engine.pytorch as te  # noqa: E402

VOCAB, SEQ, BATCH, STEPS, LR = 64, 16, 2, 3, 0.5
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_import_megatron_core_and_its_version_gates():
    import megatron.core  # noqa: F401
    from megatron.core import fp8_utils
    from megatron.core.extensions import transformer_engine as mte
    from megatron.core.utils import get_te_version, is_te_min_version

    version = get_te_version()
    assert version.public == transformer_engine.te_api_level == "2.10.0"
    assert version.local == f"da{transformer_engine.package_version}"
    # Gates whose arguments DotProductAttention takes pass: num_splits (2.10), qk-clip's
    # return_max_logit (2.9), softmax_type (2.8); the 2.14 grouped-linear paths stay off.
    assert is_te_min_version("2.10.0") and is_te_min_version("2.9.0") and is_te_min_version("2.8.0")
    assert not is_te_min_version("2.14.0")
    assert fp8_utils.HAVE_TE and mte.HAVE_TE
    assert issubclass(mte.TELayerNormColumnParallelLinear, te.LayerNormLinear)
    assert issubclass(mte.TERowParallelLinear, te.Linear)
    assert issubclass(mte.TEDotProductAttention, te.DotProductAttention)
    assert mte.FP8GlobalStateManager.is_fp8_available()[0] is True  # FP8 GEMMs run on CPU (torch._scaled_mm)


def test_import_megatron_core_finds_our_optimizers_without_a_fallback_warning():
    """Megatron-core imports FusedAdam, FusedSGD and the multi-tensor ops from
    transformer_engine.pytorch.optimizers first and warns when it falls back to torch's."""
    import subprocess
    import sys

    code = (
        "import megatron.core, megatron.core.optimizer as mo, megatron.core.optimizer.clip_grads as cg\n"
        "from transformer_engine.pytorch import optimizers as teo\n"
        "assert mo.Adam is teo.FusedAdam and mo.SGD is teo.FusedSGD and not mo.USING_PYTORCH_OPTIMIZER\n"
        "assert cg.l2_norm_impl is teo.multi_tensor_l2norm\n"
    )
    run = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "are not installed" not in run.stderr, run.stderr[-3000:]


class _ScoreBuffer:
    """Megatron-core 0.19.2's local-spec attention (megatron/core/transformer/dot_product_attention.py,
    DotProductAttention.forward) takes its score buffer from parallel_state's GlobalMemoryBuffer,
    which allocates on torch.cuda.current_device(); the reference model gets this one, on the test's device
    (set by every test: the world is shared by the module's tests). The buffer is only an output for baddbmm
    with beta=0, so its contents never matter."""

    def __init__(self, device="cpu"):
        self.device = device

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        return torch.empty(tensor_shape, dtype=dtype, device=self.device)


@pytest.fixture(scope="module")
def megatron_world():
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"  # Megatron's deterministic_mode requires it
    started = not dist.is_initialized()
    if started:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        with tempfile.NamedTemporaryFile(delete=False) as f:
            store = f.name
        os.unlink(store)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel(1, 1)
    saved_buffer = parallel_state._GLOBAL_MEMORY_BUFFER
    # Megatron's own RNG tracker keeps CUDA states only; this package's (TECudaRNGStatesTracker,
    # te_rng_tracker=True) tracks the CPU generator when there is no GPU.
    model_parallel_cuda_manual_seed(123, te_rng_tracker=True)
    yield parallel_state
    parallel_state._GLOBAL_MEMORY_BUFFER = saved_buffer
    parallel_state.destroy_model_parallel()
    if started:
        dist.destroy_process_group()


def _config(dtype, device):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        attention_dropout=0.0, hidden_dropout=0.0, deterministic_mode=True,
        gradient_accumulation_fusion=False,  # fused wgrad accumulation is not implemented here
        bias_dropout_fusion=device == "cuda", masked_softmax_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False,
    )


def _build(spec_name, dtype, device, seed=0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    spec = get_gpt_layer_with_transformer_engine_spec() if spec_name == "te" else get_gpt_layer_local_spec()
    torch.manual_seed(seed)
    model = GPTModel(config=_config(dtype, device), transformer_layer_spec=spec, vocab_size=VOCAB,
                     max_sequence_length=SEQ)
    return model.to(device=device, dtype=dtype)


def _te_to_local(state):
    """The TE spec's norms live inside LayerNormLinear; the local spec has them as separate layers."""
    out = {}
    for key, value in state.items():
        if not torch.is_tensor(value) or key.endswith("_extra_state"):
            continue  # FP8 state (TE's modules, DotProductAttention included); the local spec has none
        key = key.replace("self_attention.linear_qkv.layer_norm_", "input_layernorm.")
        key = key.replace("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm.")
        out[key] = value
    return out


def _load(model, state):
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)


def _train(model, device, steps=STEPS):
    """``steps`` SGD steps of ``model`` on seeded tokens: (losses, parameters). The FP8 tests train with it too."""
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(device) for _ in range(steps)]
    position_ids = torch.arange(SEQ, device=device)[None].expand(BATCH, -1)
    # Megatron's causal mask, [b, 1, s, s], True = masked out (the layer specs also pass causal).
    mask = torch.triu(torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool, device=device), 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for tokens in data:
        opt.zero_grad()
        if hasattr(model, "set_is_first_microbatch"):
            # What Megatron's schedules do each step: the TE layers quantize their (updated) weights in FP8 again
            # on the step's first micro-batch instead of reusing the first step's.
            model.set_is_first_microbatch()
        loss = model(tokens, position_ids, mask, labels=torch.roll(tokens, -1, dims=1)).float().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return torch.stack(losses), params


@pytest.mark.parametrize("device", DEVICES)
def test_te_spec_gpt_uses_this_package_and_trains_bitwise_reproducibly(megatron_world, device):
    low = torch.float32 if device == "cpu" else torch.bfloat16
    megatron_world._GLOBAL_MEMORY_BUFFER = _ScoreBuffer(device)
    first = _build("te", low, device)
    layers = first.config.num_layers
    # Per layer: qkv and fc1 (LayerNormLinear), proj and fc2 (Linear), core attention; and the final norm.
    for cls, count in ((te.LayerNormLinear, 2 * layers), (te.Linear, 2 * layers), (te.DotProductAttention, layers),
                       (te.LayerNorm, 1)):
        assert sum(isinstance(m, cls) for m in first.modules()) == count, cls
    init = {k: v.clone() for k, v in first.state_dict().items() if torch.is_tensor(v)}
    losses1, params1 = _train(first, device)
    second = _build("te", low, device)
    assert all(torch.equal(v, second.state_dict()[k]) for k, v in init.items())
    losses2, params2 = _train(second, device)
    assert torch.equal(losses1, losses2), (losses1, losses2)
    assert params1.keys() == params2.keys() and all(torch.equal(params1[k], params2[k]) for k in params1)
    assert torch.isfinite(losses1).all() and not torch.equal(params1[next(iter(params1))], init[next(iter(params1))])


@pytest.mark.parametrize("device", DEVICES)
def test_te_spec_gpt_trains_like_the_local_spec(megatron_world, device):
    low = torch.float32 if device == "cpu" else torch.bfloat16
    megatron_world._GLOBAL_MEMORY_BUFFER = _ScoreBuffer(device)
    te_model = _build("te", low, device)
    init = {k: v.clone() for k, v in te_model.state_dict().items() if torch.is_tensor(v)}
    local_low, local_ref = _build("local", low, device), _build("local", torch.float64, device)
    _load(local_low, _te_to_local(init))
    _load(local_ref, {k: v.double() for k, v in _te_to_local(init).items()})

    te_losses, te_params = _train(te_model, device)
    low_losses, low_params = _train(local_low, device)
    ref_losses, ref_params = _train(local_ref, device)
    te_params = _te_to_local(te_params)

    def err(losses):
        return (losses.double() - ref_losses).abs().max().item()

    eps = torch.finfo(low).eps
    # The local spec's own error at this precision (floored at one ulp of the loss) sets the bar.
    bound = 4 * max(err(low_losses), eps * ref_losses.abs().max().item())
    assert err(te_losses) <= bound, (te_losses, low_losses, ref_losses)
    for name, ref in ref_params.items():
        own = (low_params[name].double() - ref).abs().max().item()
        got = (te_params[name].double() - ref).abs().max().item()
        assert got <= 4 * max(own, eps * ref.abs().max().item()), (name, got, own)


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_te_spec_gpt_tensor_parallel_on_two_ranks_matches_one_rank():
    """tests/pytorch/distributed/megatron_gpt_tp.py in two gloo processes (sequence parallelism
    needs CUDA there: the script prints a SKIP line for it on CPU and runs it with --device cuda)."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(here))]
                                        + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(here, "distributed", "megatron_gpt_tp.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    report = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0 and lines == ["PASS gpt tp=2 sequence_parallel=False"], report


def _build_with_fusions(fusions, seed=0, spec="te"):
    """The TE-spec GPT with rotary embeddings and Megatron-LM's defaults for the two fusions
    (apply_rope_fusion, gradient_accumulation_fusion) on or off, fp32 on CPU."""
    import dataclasses
    from unittest import mock

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.tensor_parallel import layers

    config = dataclasses.replace(_config(torch.float32, "cpu"), apply_rope_fusion=fusions,
                                 gradient_accumulation_fusion=fusions)
    torch.manual_seed(seed)
    # Megatron's own output layer (ColumnParallelLinear, not TransformerEngine's) needs Apex's
    # fused_weight_gradient_mlp_cuda for the fusion; here it accumulates as without the fusion.
    with mock.patch.object(layers, "_grad_accum_fusion_available", True):
        layer_spec = get_gpt_layer_with_transformer_engine_spec() if spec == "te" else get_gpt_layer_local_spec()
        model = GPTModel(config=config, transformer_layer_spec=layer_spec,
                         vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")
    model.output_layer.gradient_accumulation_fusion = False
    return model


def _train_with_main_grads(model):
    """Megatron's data-parallel gradient path at world size 1: fp32 main_grad buffers, the hook that
    adds .grad into main_grad unless the layer already did (grad_added_to_main_grad), the optimizer
    reading main_grad; Megatron's Adam (its import of this package's FusedAdam)."""
    from megatron.core import optimizer as megatron_optimizer

    params = [p for p in model.parameters() if p.requires_grad]

    def hook(param):
        if param.grad is not None and not param.grad_added_to_main_grad:
            param.main_grad.add_(param.grad)
        param.grad = None

    for p in params:
        p.main_grad = torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32))
        p.grad_added_to_main_grad = False
        p.register_post_accumulate_grad_hook(hook)
    opt = megatron_optimizer.Adam(params, lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, adam_w_mode=True)
    gen = torch.Generator().manual_seed(1)
    position_ids = torch.arange(SEQ)[None].expand(BATCH, -1)
    mask = torch.triu(torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool), 1)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        for p in params:
            p.main_grad.zero_()
            p.grad_added_to_main_grad = False
        loss = model(tokens, position_ids, mask, labels=torch.roll(tokens, -1, dims=1)).float().mean()
        loss.backward()
        for p in params:
            p.grad = p.main_grad
        opt.step()
        for p in params:
            p.grad = None  # else the next backward accumulates into main_grad through .grad as well
        losses.append(loss.detach())
    return torch.stack(losses), {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU check (fp32); the CUDA run is the GPU acceptance's")
def test_te_spec_gpt_with_megatron_lm_default_fusions_trains_bitwise_and_like_without_them(megatron_world):
    """apply_rope_fusion and gradient_accumulation_fusion on (Megatron-LM's defaults), Megatron's
    FusedAdam: twice bitwise, and close to the same model with both fusions off."""
    from unittest import mock

    from megatron.core import optimizer as megatron_optimizer
    from megatron.core.models.common.embeddings import rope_utils

    from transformer_engine.pytorch import optimizers

    assert megatron_optimizer.Adam is optimizers.FusedAdam and rope_utils.fused_apply_rotary_pos_emb is not None
    megatron_world._GLOBAL_MEMORY_BUFFER = _ScoreBuffer("cpu")
    fused = _build_with_fusions(True)
    init = {k: v.clone() for k, v in fused.state_dict().items() if torch.is_tensor(v)}
    calls = []
    # Megatron's RotaryEmbedding moves its frequencies to torch.cuda.current_device(): the CPU here.
    with _count_calls(rope_utils, "fused_apply_rotary_pos_emb", calls), \
            mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
        losses1, params1 = _train_with_main_grads(fused)
        assert calls, "Megatron did not take its fused RoPE path"
        assert all(fused.get_parameter(n).grad_added_to_main_grad
                   for n in params1 if "linear_" in n and n.endswith(".weight"))
        losses2, params2 = _train_with_main_grads(_build_with_fusions(True))
        assert torch.equal(losses1, losses2) and all(torch.equal(params1[k], params2[k]) for k in params1)
        # The reference: Megatron's local spec (no TransformerEngine) in fp64.
        plain, exact = _build_with_fusions(False), _build_with_fusions(False, spec="local").double()
        _load(plain, init)
        _load(exact, {k: v.double() for k, v in _te_to_local(init).items()})
        losses3, params3 = _train_with_main_grads(plain)
        losses_ref, params_ref = _train_with_main_grads(exact)
    params1, params3 = _te_to_local(params1), _te_to_local(params3)

    # Against the same model in fp64: the fused run errs no more than a small multiple of the
    # unfused run's own fp32 error (floored at one ulp of the value).
    def bound(own, ref):
        return 4 * max(own, torch.finfo(torch.float32).eps * ref.abs().max().item())

    err = lambda a, ref: (a.double() - ref).abs().max().item()  # noqa: E731
    assert err(losses1, losses_ref) <= bound(err(losses3, losses_ref), losses_ref), (losses1, losses3, losses_ref)
    for k, ref in params_ref.items():
        assert err(params1[k], ref) <= bound(err(params3[k], ref), ref), k


class _count_calls:  # noqa: N801 - a context manager used like a function
    def __init__(self, module, name, calls):
        self.module, self.name, self.calls = module, name, calls

    def __enter__(self):
        self.original = getattr(self.module, self.name)

        def counted(*args, **kwargs):
            self.calls.append(1)
            return self.original(*args, **kwargs)

        setattr(self.module, self.name, counted)

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.original)


def test_documented_example_runs_as_written():
    """examples/megatron_gpt.py, which docs/megatron.rst includes whole, run as a user runs it."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "NVTE_ALLOW_NONDETERMINISTIC_ALGO")}
    env["PYTHONPATH"] = os.pathsep.join([repo] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, os.path.join(repo, "examples", "megatron_gpt.py")], capture_output=True,
                          text=True, env=env, cwd=repo, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "two runs bitwise equal: True" in proc.stdout, proc.stdout


def test_documented_decode_graph_example_runs_as_written():
    """examples/megatron_decode_graph.py, docs/megatron.rst's "Inference with CUDA graphs" block, run as a user runs
    it. On CPU no graph can be captured: the script must say so and still run the step a graph would capture
    (flash decode on this package's flash_attn_with_kvcache, once per layer and decode step)."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "NVTE_ALLOW_NONDETERMINISTIC_ALGO")}
    env["PYTHONPATH"] = os.pathsep.join([repo] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, os.path.join(repo, "examples", "megatron_decode_graph.py")],
                          capture_output=True, text=True, env=env, cwd=repo, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tokens and logits bitwise: True" in proc.stdout, proc.stdout
    if torch.cuda.is_available():
        # 2 layers, 6 new tokens: one graph per layer captured at the first decode step, replayed at all 5.
        assert "CUDA graphs: 2 captured, 10 replayed" in proc.stdout, proc.stdout
    else:
        assert "CPU: no CUDA graph was captured or replayed" in proc.stdout, proc.stdout
        assert "10 calls of te_megatron.flash_attn_with_kvcache (2 layers x 5 decode steps)" in proc.stdout, proc.stdout


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not torch.cuda.is_available() and not _INTERPRET,
                    reason="the RoPE kernel needs a CUDA GPU, or TRITON_INTERPRET=1 set before triton is imported")
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_megatron_fused_rope_runs_this_packages_kernel(megatron_world, packed, interleaved, monkeypatch):
    """Megatron's apply_rope_fusion path (rope_utils.apply_rotary_pos_emb with config.apply_rope_fusion: sbhd,
    and thd with cu_seqlens and its context-parallel group) launches this package's Triton RoPE kernel, forward
    and backward, on CUDA (the GPU run), and on the CPU under the interpreter; its bits are the unfused path's."""
    import dataclasses

    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from te_torch_testing import rope_kernel_launches

    from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cpu":  # Megatron's RotaryEmbedding makes its frequencies on torch.cuda.current_device()
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    config = dataclasses.replace(_config(dtype, device), apply_rope_fusion=True, rotary_interleaved=interleaved)
    freqs = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_interleaved=interleaved)(SEQ).to(device)
    gen = torch.Generator().manual_seed(2)
    shape = (3 * SEQ // 2, 4, 16) if packed else (SEQ, BATCH, 4, 16)
    cu = torch.tensor([0, SEQ // 2, SEQ // 2 + 3, 3 * SEQ // 2], dtype=torch.int32, device=device) if packed else None
    x = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_(True)
    dy = torch.randn(shape, generator=gen).to(device, dtype)
    with rope_kernel_launches() as launches:
        out = rope_utils.apply_rotary_pos_emb(x, freqs, config, cu_seqlens=cu)
        out.backward(dy)
    assert launches == [False, True]
    x2 = x.detach().clone().requires_grad_(True)
    want = apply_rotary_pos_emb(x2, freqs, "thd" if packed else "sbhd", interleaved=interleaved, cu_seqlens=cu)
    want.backward(dy)
    assert torch.equal(out, want) and torch.equal(x.grad, x2.grad)
