"""GroupedLinear and Fp8Padding/Fp8Unpadding: forward and backward against a plain per-expert torch reference in
float64 (both GEMM paths: per-expert, and torch's grouped GEMM, which CUDA uses for bf16/fp16 and which this
test also runs on the CPU), empty and uneven splits, bitwise run to run and under
torch.use_deterministic_algorithms(True), main_grad fusion, FP8 under each recipe (equal to a loop of Linear with
the same weights; one state per GEMM in the extra state), the batch-invariant mode (an expert's output rows do
not depend on its token count), argument checks, and the padding round trip."""

import io
import os

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import grouped_gemm
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

DEVICE = "cpu"  # the CPU paths (what CI runs); the CUDA grouped-GEMM test at the end builds on CUDA
IN, OUT = 32, 48
SPLITS = [(5, 0, 9, 2), (0, 0, 16, 0), (1, 1, 1, 1)]
PATHS = {"per_expert": False, "grouped_mm": True}


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    FP8GlobalStateManager.reset()
    yield
    FP8GlobalStateManager.reset()


@pytest.fixture(params=list(PATHS))
def path(request, monkeypatch):
    monkeypatch.setattr(grouped_gemm, "FORCE_GROUPED_MM", PATHS[request.param])
    return request.param


def _module(n=4, bias=True, dtype=torch.float64, **kwargs):
    torch.manual_seed(0)
    m = te.GroupedLinear(n, IN, OUT, bias=bias, params_dtype=dtype, device=DEVICE, **kwargs)
    if bias:
        with torch.no_grad():
            for i in range(n):
                getattr(m, f"bias{i}").uniform_(-0.5, 0.5)
    return m


def _reference(x, splits, weights, biases):
    """Per expert, ``x_i W_i^T + b_i`` in float64 with autograd (the plain torch reference)."""
    outs = []
    for i, xi in enumerate(x.split(list(splits))):
        y = xi @ weights[i].t()
        outs.append(y + biases[i] if biases is not None else y)
    return torch.cat(outs)


def _run(m, x, splits, dy):
    x = x.clone().requires_grad_()
    for p in m.parameters():
        p.grad = None
    y = m(x, list(splits))
    y.backward(dy)
    return y.detach(), x.grad, [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("bias", [True, False])
def test_matches_per_expert_reference(path, splits, bias):
    # float64 on the per-expert path; torch's grouped GEMM has no float64 kernel, so float32 there.
    dtype = torch.float64 if path == "per_expert" else torch.float32
    m = _module(bias=bias, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    rows = sum(splits)
    x = torch.randn(rows, IN, generator=g, dtype=torch.float64)
    dy = torch.randn(rows, OUT, generator=g, dtype=torch.float64)
    y, gx, grads = _run(m, x.to(dtype), splits, dy.to(dtype))
    w = [getattr(m, f"weight{i}").detach().double().requires_grad_() for i in range(4)]
    b = [getattr(m, f"bias{i}").detach().double().requires_grad_() for i in range(4)] if bias else None
    xr = x.clone().requires_grad_()
    ref = _reference(xr, splits, w, b)
    ref.backward(dy)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.double(), ref.detach(), **tol)
    torch.testing.assert_close(gx.double(), xr.grad, **tol)
    ref_grads = [t for i in range(4) for t in ([w[i], b[i]] if bias else [w[i]])]
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want.grad, **tol)
    for i, mi in enumerate(splits):  # an expert without tokens: zero gradients, not None
        if mi == 0:
            assert not getattr(m, f"weight{i}").grad.any()


def test_grouped_path_equals_per_expert_path(monkeypatch):
    """The two GEMM paths agree to float32 rounding on uneven splits with an empty expert."""
    m = _module(dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    x, dy = torch.randn(16, IN, generator=g), torch.randn(16, OUT, generator=g)
    outs = []
    for force in (False, True):
        monkeypatch.setattr(grouped_gemm, "FORCE_GROUPED_MM", force)
        outs.append(_run(m, x, SPLITS[0], dy))
    (y0, gx0, g0), (y1, gx1, g1) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=1e-6, atol=1e-6)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_bitwise_run_to_run_and_under_deterministic_algorithms(path):
    m = _module(dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(16, IN, generator=g), torch.randn(16, OUT, generator=g)
    first = _run(m, x, SPLITS[0], dy)
    again = _run(m, x, SPLITS[0], dy)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        det = _run(m, x, SPLITS[0], dy)
    finally:
        torch.use_deterministic_algorithms(prev)
    for other in (again, det):
        assert torch.equal(first[0], other[0]) and torch.equal(first[1], other[1])
        assert all(torch.equal(a, b) for a, b in zip(first[2], other[2]))


def test_input_shape_kept_and_m_splits_as_tensor(path):
    m = _module(dtype=torch.float32)
    x = torch.randn(4, 4, IN)  # [s, b, h] flattened to 16 rows in expert order
    y = m(x, torch.tensor([5, 0, 9, 2]))
    assert y.shape == (4, 4, OUT)
    torch.testing.assert_close(y.reshape(16, OUT), m(x.reshape(16, IN), [5, 0, 9, 2]), rtol=0, atol=0)


def test_return_bias_returns_the_biases_unadded(path):
    m = _module(dtype=torch.float32, return_bias=True)
    x = torch.randn(16, IN)
    y, biases = m(x, [5, 0, 9, 2])
    assert len(biases) == 4 and all(b is getattr(m, f"bias{i}") for i, b in enumerate(biases))
    plain = _module(dtype=torch.float32)
    torch.testing.assert_close(y + torch.cat([b.expand(n, -1) for b, n in zip(biases, [5, 0, 9, 2])]),
                               plain(x, [5, 0, 9, 2]), rtol=0, atol=0)
    nob = _module(bias=False, dtype=torch.float32, return_bias=True)
    _, empty = nob(x, [5, 0, 9, 2])
    assert [b.numel() for b in empty] == [0] * 4


@pytest.mark.parametrize("flagged", [False, True])
def test_fuse_wgrad_accumulation_into_main_grad(path, flagged):
    """Megatron's contract: the weight gradient goes into main_grad (written on is_first_microbatch=True,
    added after), autograd gets None (or a zero with the grad_added_to_main_grad flag); biases as usual."""
    m = _module(dtype=torch.float32, fuse_wgrad_accumulation=True)
    ref = _module(dtype=torch.float32)
    weights = [getattr(m, f"weight{i}") for i in range(4)]
    for w in weights:
        w.main_grad = torch.full_like(w, 7.0)
        if flagged:
            w.grad_added_to_main_grad = False
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(16, IN, generator=g) for _ in range(2)]
    dys = [torch.randn(16, OUT, generator=g) for _ in range(2)]
    for step, (x, dy) in enumerate(zip(xs, dys)):
        m(x, [5, 0, 9, 2], is_first_microbatch=step == 0).backward(dy)
        ref(x, [5, 0, 9, 2]).backward(dy)
    for i, w in enumerate(weights):
        torch.testing.assert_close(w.main_grad, getattr(ref, f"weight{i}").grad, rtol=1e-6, atol=1e-6)
        if flagged:
            assert w.grad_added_to_main_grad and not w.grad.any()
        else:
            assert w.grad is None
        torch.testing.assert_close(getattr(m, f"bias{i}").grad, getattr(ref, f"bias{i}").grad, rtol=0, atol=0)


def test_m_splits_and_arguments_checked_by_name():
    m = _module(dtype=torch.float32)
    x = torch.randn(16, IN)
    for bad, match in (([5, 0, 9], "num_gemms=4"), ([5, 0, 9, 3], "sum"), ([5, -1, 10, 2], "non-negative"),
                       (torch.tensor([5.0, 0, 9, 2]), "integer"), ("5,0,9,2", "m_splits")):
        with pytest.raises(ValueError, match=match):
            m(x, bad)
    with pytest.raises(ValueError, match="in_features"):
        m(torch.randn(16, IN + 1), [5, 0, 9, 2])
    with pytest.raises(NotImplementedError, match="`out=...`"):
        m(x, [5, 0, 9, 2], out=torch.empty(16, OUT))
    for kwargs, err, match in ((dict(single_grouped_weight=True), NotImplementedError, "single_grouped_weight"),
                               (dict(delay_wgrad_compute=True), NotImplementedError, "delay_wgrad_compute"),
                               (dict(ub_overlap_ag=True), NotImplementedError, "ub_overlap_ag"),
                               (dict(tp_size=2, bias=True), ValueError, "bias"),
                               (dict(parallel_mode="diagonal"), ValueError, "parallel_mode"),
                               (dict(num_gemms=0), ValueError, "num_gemms")):
        args = dict(num_gemms=2, in_features=IN, out_features=OUT, device=DEVICE)
        args.update(kwargs)
        with pytest.raises(err, match=match):
            te.GroupedLinear(**args)


@pytest.mark.parametrize("mode, shape, dim", [(None, (OUT, IN), 0), ("column", (OUT // 2, IN), 0),
                                              ("row", (OUT, IN // 2), 1)])
def test_parallel_modes_shape_the_weights(mode, shape, dim):
    """As in TransformerEngine, the tensor-parallel split only shapes the weights: the MoE dispatcher moves the
    tokens, the module communicates nothing."""
    m = te.GroupedLinear(3, IN, OUT, tp_size=2, bias=False, parallel_mode=mode, sequence_parallel=True,
                         device=DEVICE)
    assert [tuple(getattr(m, f"weight{i}").shape) for i in range(3)] == [shape] * 3
    assert m.weight2.partition_dim == dim and m.weight2.tensor_model_parallel and m.sequence_parallel
    x = torch.randn(6, shape[1])
    torch.testing.assert_close(m(x, [2, 4, 0]), torch.cat([x[:2] @ m.weight0.t(), x[2:] @ m.weight1.t()]),
                               rtol=0, atol=0)


# --- FP8 ---------------------------------------------------------------------------------------

RECIPES = {"delayed": lambda: recipe.DelayedScaling(amax_history_len=3),
           "current": lambda: recipe.Float8CurrentScaling(),
           "block": lambda: recipe.Float8BlockScaling()}


@pytest.mark.parametrize("name", list(RECIPES))
def test_fp8_equals_a_loop_of_linear_per_gemm_state(name):
    """Each expert is one FP8 GEMM with its own quantization state: the outputs and gradients are bitwise those
    of one Linear per expert with the same weights, over three steps (delayed scaling: the updated scales and
    histories too)."""
    splits = [5, 0, 9, 2]
    m = _module(dtype=torch.float32)
    linears = []
    for i in range(4):
        lin = te.Linear(IN, OUT, params_dtype=torch.float32, device=DEVICE)
        with torch.no_grad():
            lin.weight.copy_(getattr(m, f"weight{i}"))
            lin.bias.copy_(getattr(m, f"bias{i}"))
        linears.append(lin)

    def grouped(x):
        return m(x, splits, is_first_microbatch=True)

    def loop(x):
        return torch.cat([lin(xi, is_first_microbatch=True) for lin, xi in zip(linears, x.split(splits))])

    def train(fn, params):
        g = torch.Generator().manual_seed(5)
        out = []
        for _ in range(3):
            x = torch.randn(16, IN, generator=g).requires_grad_()
            with te.fp8_autocast(enabled=True, fp8_recipe=RECIPES[name]()):
                y = fn(x)
            y.backward(torch.randn(16, OUT, generator=g))
            out.append([y.detach(), x.grad] + [p.grad.clone() for p in params])
            for p in params:
                p.grad = None
        FP8GlobalStateManager.reset()  # the next run's autocasts must not update this run's metas
        return out

    got = train(grouped, [p for i in range(4) for p in (getattr(m, f"weight{i}"), getattr(m, f"bias{i}"))])
    want = train(loop, [p for lin in linears for p in (lin.weight, lin.bias)])
    for a, b in zip(got, want):
        assert all(torch.equal(u, v) for u, v in zip(a, b))
    if name == "delayed":
        for i in range(4):
            a, b = m.__dict__[f"_fp8_state_{i}"], linears[i]._fp8_state
            assert torch.equal(a.fwd_meta.amax_history, b.fwd_meta.amax_history)
            assert torch.equal(a.bwd_meta.scale, b.bwd_meta.scale)
            assert torch.equal(a.bwd_meta.amax_history, b.bwd_meta.amax_history)
    # FP8 differs from the float32 GEMM by FP8 rounding only.
    x = torch.randn(16, IN)
    with te.fp8_autocast(enabled=True, fp8_recipe=RECIPES[name]()):
        y8 = m(x, splits)
    torch.testing.assert_close(y8, m(x, splits), rtol=0.1, atol=0.1)


def test_fp8_extra_state_carries_every_gemm():
    m = _module(dtype=torch.float32)
    x = torch.randn(16, IN)
    for _ in range(2):
        with te.fp8_autocast(enabled=True, fp8_recipe=RECIPES["delayed"]()):
            m(x.requires_grad_(), [5, 0, 9, 2]).sum().backward()
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    fresh = _module(dtype=torch.float32)
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    for i in range(4):
        a, b = m.__dict__[f"_fp8_state_{i}"], fresh.__dict__[f"_fp8_state_{i}"]
        assert torch.equal(a.fwd_meta.scale, b.fwd_meta.scale)
        assert torch.equal(a.bwd_meta.amax_history, b.bwd_meta.amax_history)
    with te.fp8_autocast(enabled=True, fp8_recipe=RECIPES["delayed"]()):
        assert torch.equal(m(x, [5, 0, 9, 2]), fresh(x, [5, 0, 9, 2]))
    with pytest.raises(ValueError, match="hold 3 GEMM.*got 4"):
        te.GroupedLinear(3, IN, OUT, device=DEVICE).load_state_dict(m.state_dict(), strict=False)



def test_fp8_activation_recompute_is_bitwise():
    """te.checkpoint around GroupedLinear under delayed scaling: the recompute reads each GEMM's recorded scales
    (no second amax record), so three steps give the bits of the run without recompute."""
    runs = []
    for recompute in (False, True):
        FP8GlobalStateManager.reset()
        m = _module(n=3, dtype=torch.float32)
        g = torch.Generator().manual_seed(8)
        out = []
        for _ in range(3):
            x = torch.randn(10, IN, generator=g).requires_grad_()
            with te.fp8_autocast(enabled=True, fp8_recipe=RECIPES["delayed"]()):
                y = te.checkpoint(m, x, [3, 0, 7]) if recompute else m(x, [3, 0, 7])
            y.square().sum().backward()
            out += [y.detach(), x.grad] + [p.grad.clone() for p in m.parameters()]
            for p in m.parameters():
                p.grad = None
        runs.append(out)
    assert all(torch.equal(a, b) for a, b in zip(*runs))

# --- batch-invariant mode ------------------------------------------------------------------------

@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the batch-invariant kernels run on CUDA or under TRITON_INTERPRET=1")
def test_batch_invariant_expert_rows_do_not_depend_on_token_count():
    """A token's output and input gradient are bitwise the same whether its expert got 1, 7 or 64 tokens
    (and whatever the other experts got)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    m = te.GroupedLinear(3, IN, OUT, params_dtype=torch.float32, device=dev)
    g = torch.Generator().manual_seed(6)
    token = torch.randn(1, IN, generator=g).to(dev)
    results = []
    for count in (1, 7, 64):
        others = torch.randn(count - 1, IN, generator=g).to(dev)
        before = torch.randn(3, IN, generator=g).to(dev)
        x = torch.cat([before, others, token]).requires_grad_()  # expert 0: 3 rows; expert 1: count rows
        splits = [3, count, 0]
        with te.batch_invariant():
            y = m(x, splits)
        dy = torch.zeros_like(y)
        dy[-1] = 1.0
        y.backward(dy)
        results.append((y[-1].detach(), x.grad[-1]))
    for y, gx in results[1:]:
        assert torch.equal(y, results[0][0]) and torch.equal(gx, results[0][1])
    torch.testing.assert_close(results[0][0], (token @ m.weight1.t() + m.bias1)[0].detach(), rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="batch-invariant"):
        with te.batch_invariant(), te.fp8_autocast(enabled=True, fp8_recipe=RECIPES["current"]()):
            m(x, splits)


# --- Fp8Padding / Fp8Unpadding -------------------------------------------------------------------

@pytest.mark.parametrize("align, splits", [(16, [5, 0, 17, 16]), (4, [1, 2, 3, 4]), (16, [16, 0, 32, 16])])
def test_padding_round_trip_exact(align, splits):
    pad, unpad = te.Fp8Padding(4, align), te.Fp8Unpadding(4, align)
    x = torch.randn(sum(splits), 8, requires_grad=True)
    y, padded = pad(x, splits)
    assert padded == [(m + align - 1) // align * align for m in splits] and y.shape[0] == sum(padded)
    start = pstart = 0
    for m, p in zip(splits, padded):  # each block followed by zero rows
        assert torch.equal(y[pstart:pstart + m], x[start:start + m].detach()) and not y[pstart + m:pstart + p].any()
        start, pstart = start + m, pstart + p
    z = unpad(y, splits)
    assert torch.equal(z, x.detach())
    dz = torch.randn_like(z)
    z.backward(dz)
    assert torch.equal(x.grad, dz)
    if padded == splits:
        assert y is x and z is y


def test_padding_alignment_from_the_recipe_and_checks():
    assert te.Fp8Padding(2)(torch.randn(3, 4), [1, 2])[1] == [16, 16]  # outside FP8: the default recipe's 16
    p = te.Fp8Padding(2)
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe.Float8BlockScaling()):
        assert p(torch.randn(3, 4), [1, 2])[1] == [16, 16]
    from transformer_engine.pytorch.module.fp8_padding import align_size_for_recipe

    assert align_size_for_recipe(recipe.MXFP8BlockScaling()) == 32
    assert align_size_for_recipe(recipe.NVFP4BlockScaling()) == 128
    with pytest.raises(ValueError, match="num_gemms=2"):
        te.Fp8Padding(2, 16)(torch.randn(3, 4), [3])
    with pytest.raises(ValueError, match="rows"):
        te.Fp8Unpadding(2, 16)(torch.randn(3, 4), [1, 2])
    with pytest.raises(ValueError, match="align_size"):
        te.Fp8Unpadding(2, 0)


def test_padding_then_grouped_linear_then_unpadding_equals_unpadded():
    """The MoE expert path under FP8 (Megatron's TEGroupedMLP): padded rows do not change the real rows."""
    m = _module(dtype=torch.float32)
    splits = [5, 0, 9, 2]
    x = torch.randn(16, IN)
    xp, padded = te.Fp8Padding(4, 16)(x, splits)
    y = te.Fp8Unpadding(4, 16)(m(xp, padded), splits)
    # Equal to float32 rounding: the host BLAS may block a GEMM differently for another row count.
    torch.testing.assert_close(y, m(x, splits), rtol=1e-6, atol=1e-6)


# --- CUDA: torch's grouped GEMM ------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's grouped GEMM path runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_grouped_gemm_deterministic_and_close_to_per_expert(monkeypatch, dtype):
    torch.manual_seed(0)
    m = te.GroupedLinear(8, 256, 512, params_dtype=dtype, device="cuda")
    splits = [0, 1, 300, 17, 0, 64, 5, 613]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(sum(splits), 256, generator=g).to("cuda", dtype)
    dy = torch.randn(sum(splits), 512, generator=g).to("cuda", dtype)
    used = grouped_gemm.grouped_mm_supported(x, [m.weight0])
    runs = [_run(m, x, splits, dy) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][2], runs[1][2]))
    monkeypatch.setattr(grouped_gemm, "FORCE_GROUPED_MM", False)
    loop = _run(m, x, splits, dy)
    tol = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(runs[0][0].float(), loop[0].float(), **tol)
    torch.testing.assert_close(runs[0][1].float(), loop[1].float(), **tol)
    for a, b in zip(runs[0][2], loop[2]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=5e-1)
    print(f"grouped GEMM path used for {dtype}: {used}")
