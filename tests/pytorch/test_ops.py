"""transformer_engine.pytorch.ops: each operation against a plain torch reference of its math (float64, and
float32 to a tight tolerance), against the module it stands for (bitwise, forward and backward), a Sequential
against LayerNormMLP (bitwise), the Sequential container, FP8, fused wgrad accumulation, deferred (meta)
parameters, determinism, and the refusals."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import ops

H, FFN, ROWS = 32, 64, 12
DEV = "cpu"


def _x(shape=(2, 6, H), seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype).requires_grad_()


def _grads(fn, x, params, seed=1):
    """(output, input grad, parameter grads) of fn(x) under a fixed random output gradient."""
    y = fn(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y.dtype)
    grads = torch.autograd.grad(y, [x, *params], dy)
    return y.detach(), grads[0], grads[1:]


def _same(a, b):
    ya, gxa, gpa = a
    yb, gxb, gpb = b
    assert torch.equal(ya, yb) and torch.equal(gxa, gxb)
    assert len(gpa) == len(gpb) and all(torch.equal(u, v) for u, v in zip(gpa, gpb))


def _close(a, b, tol):
    for u, v in zip((a[0], a[1], *a[2]), (b[0], b[1], *b[2])):
        torch.testing.assert_close(u.to(v.dtype), v, rtol=tol, atol=tol)


# --- norms -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm_op_is_the_module_bitwise_and_the_formula(kind, zero_centered_gamma):
    op = getattr(ops, kind)(H, eps=1e-5, device=DEV, zero_centered_gamma=zero_centered_gamma)
    mod = getattr(te, kind)(H, eps=1e-5, device=DEV, zero_centered_gamma=zero_centered_gamma)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in op.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        for p, q in zip(mod.parameters(), op.parameters()):
            p.copy_(q)
    params = list(op.parameters())
    got = _grads(op, _x(), params)
    _same(got, _grads(mod, _x(), list(mod.parameters())))

    def ref(x64):
        w = params[0].double() + (1 if zero_centered_gamma else 0)
        if kind == "LayerNorm":
            y = (x64 - x64.mean(-1, keepdim=True)) / torch.sqrt(x64.var(-1, unbiased=False, keepdim=True) + 1e-5)
            return y * w + params[1].double()
        return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    x64 = _x().double().detach().requires_grad_()
    p64 = [p.detach().double().requires_grad_() for p in params]
    params[:] = p64
    ref64 = _grads(ref, x64, p64)
    _close(got, ref64, 2e-5)


# --- BasicLinear and Bias --------------------------------------------------------------------------------

def test_basic_linear_and_bias_are_linear_bitwise_and_the_formula():
    lin = ops.BasicLinear(H, FFN, device=DEV)
    bias = ops.Bias(FFN, device=DEV)
    with torch.no_grad():
        bias.bias.copy_(torch.randn(FFN, generator=torch.Generator().manual_seed(5)))
    mod = te.Linear(H, FFN, bias=True, device=DEV)
    with torch.no_grad():
        mod.weight.copy_(lin.weight)
        mod.bias.copy_(bias.bias)
    seq = ops.Sequential(lin, bias)
    got = _grads(seq, _x(), [lin.weight, bias.bias])
    _same(got, _grads(mod, _x(), [mod.weight, mod.bias]))
    x64 = _x().double()
    y64 = x64 @ lin.weight.double().t() + bias.bias.double()
    torch.testing.assert_close(got[0].double(), y64.detach(), rtol=1e-5, atol=1e-5)
    dy = torch.randn(got[0].shape, generator=torch.Generator().manual_seed(1)).double()
    torch.testing.assert_close(got[2][0].double(), dy.reshape(-1, FFN).t() @ x64.detach().reshape(-1, H),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2][1].double(), dy.reshape(-1, FFN).sum(0), rtol=1e-5, atol=1e-5)
    assert lin.weight.shape == (FFN, H) and bias.bias.shape == (FFN,)
    bound = 1 / H ** 0.5  # kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))
    assert lin.weight.abs().max() <= bound and lin.weight.std() > bound / 3


def test_meta_parameters_are_made_at_the_first_forward_on_the_inputs_device():
    lin, bias, norm = ops.BasicLinear(H, FFN, device="meta"), ops.Bias(FFN, device="meta"), ops.RMSNorm(H, device="meta")
    assert all(p.device.type == "meta" for m in (lin, bias, norm) for p in m.parameters())
    torch.manual_seed(0)
    y = ops.Sequential(norm, lin, bias)(_x())
    assert y.shape == (2, 6, FFN) and all(p.device.type == "cpu" for m in (lin, bias, norm) for p in m.parameters())
    assert torch.equal(bias.bias, torch.zeros(FFN)) and torch.equal(norm.weight, torch.ones(H))
    torch.manual_seed(0)
    ref = torch.empty(FFN, H)
    torch.nn.init.kaiming_uniform_(ref, a=5 ** 0.5)
    assert torch.equal(lin.weight, ref)


def test_basic_linear_accumulates_into_main_grad():
    lin = ops.BasicLinear(H, FFN, device=DEV, accumulate_into_main_grad=True)
    ref = ops.BasicLinear(H, FFN, device=DEV)
    with torch.no_grad():
        ref.weight.copy_(lin.weight)
    lin.weight.main_grad = torch.ones(FFN, H)
    x = _x()
    lin(x).square().sum().backward()
    assert lin.weight.grad is None
    ref(_x()).square().sum().backward()
    assert torch.equal(lin.weight.main_grad, ref.weight.grad + 1)
    lin.weight.overwrite_main_grad = True
    lin(_x()).square().sum().backward()
    assert torch.equal(lin.weight.main_grad, ref.weight.grad)


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_basic_linear_in_fp8_is_linear_in_fp8_bitwise(name):
    rec = {"delayed": lambda: recipe.DelayedScaling(amax_history_len=4), "current": recipe.Float8CurrentScaling}[name]
    lin = ops.BasicLinear(H, FFN, device=DEV)
    mod = te.Linear(H, FFN, bias=False, device=DEV)
    with torch.no_grad():
        mod.weight.copy_(lin.weight)
    outs = []
    for fn, w in ((lin, lin.weight), (mod, mod.weight)):
        res = []
        for step in range(2):
            with te.autocast(enabled=True, recipe=rec()):
                res.append(_grads(fn, _x(seed=step), [w]))
        outs.append(res)
    for a, b in zip(*outs):
        _same(a, b)
    hp = _grads(lin, _x(seed=0), [lin.weight])
    assert not torch.equal(outs[0][0][0], hp[0])  # the FP8 GEMM ran
    torch.testing.assert_close(outs[0][0][0], hp[0], rtol=0.1, atol=0.1)


# --- activations -----------------------------------------------------------------------------------------

_REFS = {
    "GELU": lambda x: F.gelu(x, approximate="tanh"),
    "ReLU": F.relu,
    "SiLU": F.silu,
    "GEGLU": lambda x: F.gelu(x.chunk(2, -1)[0], approximate="tanh") * x.chunk(2, -1)[1],
    "ReGLU": lambda x: F.relu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1],
    "SwiGLU": lambda x: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1],
}


@pytest.mark.parametrize("name", sorted(_REFS))
def test_activation_op_against_torch(name):
    op = getattr(ops, name)()
    got = _grads(op, _x(), [])
    x64 = _x().double().detach().requires_grad_()
    ref = _grads(_REFS[name], x64, [])
    _close(got, ref, 2e-6)
    assert got[0].dtype == torch.float32
    half = _grads(op, _x(dtype=torch.bfloat16), [])
    assert half[0].dtype == torch.bfloat16
    torch.testing.assert_close(half[0].double(), ref[0], rtol=2e-2, atol=2e-2)


_CAN_BATCH_INVARIANT = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("activation,batch_invariant", [
    ("gelu", False), ("swiglu", False),
    pytest.param("swiglu", True, marks=pytest.mark.skipif(
        not _CAN_BATCH_INVARIANT, reason="batch-invariant kernels need CUDA or TRITON_INTERPRET=1"))])
def test_sequential_mlp_is_layernorm_mlp_bitwise(activation, batch_invariant):
    gated = activation == "swiglu"
    mod = te.LayerNormMLP(H, FFN, normalization="RMSNorm", activation=activation, device=DEV)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.2)
    norm = ops.RMSNorm(H, device="meta")
    fc1 = ops.BasicLinear(H, FFN * (2 if gated else 1), device="meta")
    b1 = ops.Bias(FFN * (2 if gated else 1), device="meta")
    fc2 = ops.BasicLinear(FFN, H, device="meta")
    b2 = ops.Bias(H, device="meta")
    # Megatron's way: ops on meta, the module's parameters assigned to them.
    norm.weight, fc1.weight, b1.bias = mod.layer_norm_weight, mod.fc1_weight, mod.fc1_bias
    fc2.weight, b2.bias = mod.fc2_weight, mod.fc2_bias
    seq = ops.Sequential(norm, fc1, b1, ops.SwiGLU() if gated else ops.GELU(), fc2, b2)
    params = list(mod.parameters())
    with te.batch_invariant(batch_invariant):
        got = _grads(seq, _x(), params)
        _same(got, _grads(mod, _x(), params))
        _same(got, _grads(seq, _x(), params))  # run to run
        if batch_invariant:  # a row alone gives the bits it has in the batch (the batch-invariant kernels ran)
            row = _grads(seq, _x()[:1, :1].detach().requires_grad_(), params)
            assert torch.equal(row[0], got[0][:1, :1])
    assert all(p.device.type == "cpu" for p in seq.parameters())


# --- extra inputs and outputs, the container ------------------------------------------------------------

def test_make_extra_output_with_rmsnorm_is_norm_plus_residual_bitwise():
    norm = ops.RMSNorm(H, device=DEV)
    seq = ops.Sequential(ops.MakeExtraOutput(), norm)
    mod = te.RMSNorm(H, device=DEV)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(H, generator=torch.Generator().manual_seed(2)) + 0.5)
        mod.weight.copy_(norm.weight)

    def fused(x):
        y, residual = seq(x)
        assert residual is x
        return torch.cat([y * 3, residual])

    def unfused(x):
        return torch.cat([mod(x) * 3, x])

    _same(_grads(fused, _x(), [norm.weight]), _grads(unfused, _x(), [mod.weight]))


def test_add_extra_input_and_the_container():
    seq = ops.Sequential(ops.GELU(), ops.AddExtraInput(), ops.MakeExtraOutput(), ops.ReLU())
    x, r = _x(seed=0), _x(seed=5)
    y, extra = seq(x, r)
    s = r + F.gelu(x, approximate="tanh")
    torch.testing.assert_close(extra, s, rtol=1e-6, atol=1e-6)
    assert torch.equal(y, F.relu(extra))
    (y.sum() + 2 * extra.sum()).backward()
    assert torch.equal(r.grad, (extra > 0).float() + 2)
    with pytest.raises(ValueError, match="1 extra inputs"):
        seq(x)
    # Container: indexing, slicing, insert, pop, +, torch modules among the ops.
    seq2 = ops.Sequential(ops.ReLU()) + [torch.nn.Identity()]
    seq2 += [ops.SiLU()]
    seq2.insert(0, ops.GELU())
    assert [type(m).__name__ for m in seq2] == ["GELU", "ReLU", "Identity", "SiLU"]
    assert isinstance(seq2[1:], ops.Sequential) and len(seq2[1:]) == 3
    assert type(seq2.pop(-1)).__name__ == "SiLU" and len(seq2) == 3
    z = _x().detach()
    assert torch.equal(seq2(z), F.relu(ops.GELU()(z)))
    named = ops.Sequential({"act": ops.ReLU()})
    assert isinstance(named.act, ops.ReLU)


# --- collectives at world size 1 and refusals ------------------------------------------------------------

def test_collectives_without_a_group_are_the_identity():
    x = _x().detach()
    assert ops.AllReduce()(x) is x and ops.ReduceScatter()(x) is x


def test_refusals_and_bad_arguments():
    with pytest.raises(NotImplementedError, match="cache_quantized_input"):
        ops.SwiGLU(cache_quantized_input=True)
    with pytest.raises(NotImplementedError, match="glu_interleave_size"):
        ops.SwiGLU(glu_interleave_size=32)
    with pytest.raises(NotImplementedError, match="userbuffers_options"):
        ops.BasicLinear(H, H, device=DEV, userbuffers_options={"comm_name": "fc1"})
    for cls in (ops.MakeExtraOutput, ops.AddExtraInput):
        with pytest.raises(NotImplementedError, match="in_place"):
            cls(in_place=True)
    with pytest.raises(NotImplementedError, match="op_kwargs"):
        ops.Sequential(ops.ReLU())(_x(), op_kwargs={0: {}})
    with pytest.raises(AttributeError, match="Dropout is not implemented"):
        ops.Dropout  # noqa: B018
    with pytest.raises(ValueError, match="`in_features`"):
        ops.BasicLinear(0, H, device=DEV)
    with pytest.raises(ValueError, match="`tensor_parallel_mode`"):
        ops.BasicLinear(H, H, device=DEV, tensor_parallel_mode="rows")
    with pytest.raises(ValueError, match="`eps`"):
        ops.RMSNorm(H, eps=0.0, device=DEV)
    with pytest.raises(ValueError, match="bias size"):
        ops.Bias(H, device=DEV)(torch.zeros(2, H + 1))
    with pytest.raises(ValueError, match="even last dim"):
        ops.SwiGLU()(torch.zeros(2, 3))


_TP_WORKER = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch import ops
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
    H, FFN, S = 32, 64, 8
    g = torch.Generator().manual_seed(0)
    w1, b1 = torch.randn(FFN, H, generator=g) * 0.2, torch.randn(FFN, generator=g)
    w2, b2 = torch.randn(H, FFN, generator=g) * 0.2, torch.randn(H, generator=g)
    x_full = torch.randn(S, 2, H, generator=g)
    dy_full = torch.randn(S, 2, H, generator=g)
    shard = slice(rank * FFN // 2, (rank + 1) * FFN // 2)
    for sp in (False, True):
        rows = slice(rank * S // 2, (rank + 1) * S // 2) if sp else slice(None)
        mod = te.LayerNormMLP(H, FFN, normalization="RMSNorm", tp_group=dist.group.WORLD, tp_size=2,
                              set_parallel_mode=True, sequence_parallel=sp, device="cpu")
        seq = ops.Sequential(
            ops.RMSNorm(H, device="meta"),
            ops.BasicLinear(H, FFN, device="meta", tensor_parallel_mode="column", sequence_parallel=sp),
            ops.Bias(FFN, device="meta", tensor_parallel=True), ops.GELU(),
            ops.BasicLinear(FFN // 2, H, device="meta"),
            ops.ReduceScatter() if sp else ops.AllReduce(), ops.Bias(H, device="meta"))
        assert seq[1].weight.shape == (FFN // 2, H) and seq[2].bias.shape == (FFN // 2,)
        with torch.no_grad():
            mod.fc1_weight.copy_(w1[shard]); mod.fc1_bias.copy_(b1[shard])
            mod.fc2_weight.copy_(w2[:, shard]); mod.fc2_bias.copy_(b2)
        seq[0].weight, seq[1].weight, seq[2].bias = mod.layer_norm_weight, mod.fc1_weight, mod.fc1_bias
        seq[4].weight, seq[6].bias = mod.fc2_weight, mod.fc2_bias
        results = []
        for fn in (mod, seq):
            x = x_full[rows].clone().requires_grad_()
            y = fn(x)
            params = list(mod.parameters())
            grads = torch.autograd.grad(y, [x] + params, dy_full[rows])
            results.append([y.detach()] + list(grads))
        for u, v in zip(*results):
            assert torch.equal(u, v), (sp, (u - v).abs().max())
        # against the unsplit math in float64
        xf = x_full.double()
        h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
        a = h @ w1.double().t() + b1.double()
        a = a * (0.5 + 0.5 * torch.tanh(a * (0.79788456 + 0.03567741 * a * a)))
        ref = a @ w2.double().t() + b2.double()
        torch.testing.assert_close(results[1][0].double(), ref[rows], rtol=1e-5, atol=1e-5)
    dist.barrier()
    print("PASS", rank, flush=True)
    os._exit(0)  # no gloo teardown at exit (it sometimes aborts after the work is done)
""")


def test_tensor_parallel_sequential_on_two_ranks_is_layernorm_mlp_bitwise(tmp_path):
    """Megatron's TEFusedMLP at tensor-parallel size 2: column BasicLinear (sequence parallel or not), a split
    Bias, the activation, a local BasicLinear and AllReduce / ReduceScatter: bitwise LayerNormMLP's
    tensor-parallel forward and backward, and the unsplit math in float64."""
    store = str(tmp_path / "store")
    script = tmp_path / "worker.py"
    script.write_text(_TP_WORKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), store], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"PASS {rank}" in out, err[-3000:]
