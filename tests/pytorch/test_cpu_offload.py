"""transformer_engine.pytorch.cpu_offload.get_cpu_offload_context: the saved-tensor hooks run in the offloaded
layers only, the gradients are bitwise those without offloading (on the CPU the tensors stay where they are, and
with the host copy forced on CPU tensors too they go through the copy and back), host buffers are reused when
retained, Megatron's call, and the refusals. On CUDA the activations really move to the host."""

import warnings

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch import cpu_offload

H, LAYERS = 32, 3


class _Layer(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.norm = te.LayerNorm(H, device=device)
        self.fc = te.Linear(H, H, device=device)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.fc(self.norm(x)))


def _model(device="cpu"):
    torch.manual_seed(0)
    return torch.nn.ModuleList(_Layer(device) for _ in range(LAYERS))


def _step(model, context=None, sync=None, seed=0, device="cpu"):
    x = torch.randn(2, 8, H, generator=torch.Generator().manual_seed(seed)).to(device).requires_grad_()
    h = x
    for layer in model:
        if context is None:
            h = layer(h)
        else:
            with context:
                h = layer(h)
            h = sync(h)
    h.square().sum().backward()
    grads = [x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return h.detach(), grads


def _assert_bitwise(a, b):
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(u, v) for u, v in zip(a[1], b[1]))


def test_hooks_run_in_offloaded_layers_and_gradients_are_bitwise():
    model = _model()
    plain = _step(model)
    context, sync = cpu_offload.get_cpu_offload_context(True, 2, LAYERS)
    _assert_bitwise(_step(model, context, sync), plain)
    assert context.num_packed > 0 and context.num_unpacked == context.num_packed
    assert context.num_moved == 0  # CPU tensors stay where they are
    packed_two = context.num_packed
    context1, sync1 = cpu_offload.get_cpu_offload_context(True, 1, LAYERS)
    _assert_bitwise(_step(model, context1, sync1), plain)
    assert 0 < context1.num_packed < packed_two  # only the first layer's tensors
    context0, sync0 = cpu_offload.get_cpu_offload_context(True, 0, LAYERS)
    _assert_bitwise(_step(model, context0, sync0), plain)
    assert context0.num_packed == 0


@pytest.mark.parametrize("retain", [False, True])
def test_host_copies_round_trip_exactly(monkeypatch, retain):
    """With the copy forced on CPU tensors, each offloaded activation goes to a host buffer and back."""
    monkeypatch.setattr(cpu_offload, "_STAYING_DEVICE_TYPES", ("meta",))
    model = _model()
    plain = [_step(model, seed=s) for s in range(2)]
    context, sync = cpu_offload.get_cpu_offload_context(True, 2, LAYERS, retain_pinned_cpu_buffers=retain)
    _assert_bitwise(_step(model, context, sync, seed=0), plain[0])
    assert context.num_moved > 0 and context.num_unpacked == context.num_packed
    first = [list(layer.buffers) for layer in context._layers]
    _assert_bitwise(_step(model, context, sync, seed=1), plain[1])
    second = [list(layer.buffers) for layer in context._layers]
    if retain:
        assert first[0] and all(a is b for f, s in zip(first, second) for a, b in zip(f, s))
    else:
        assert first == [[], []] and second == [[], []]


def test_mark_not_offload_and_enabled_flag(monkeypatch):
    monkeypatch.setattr(cpu_offload, "_STAYING_DEVICE_TYPES", ("meta",))
    context, sync = cpu_offload.get_cpu_offload_context(True, 1, 2)
    kept = torch.randn(4, H)
    cpu_offload.mark_not_offload(kept, None)
    w = torch.randn(H, H, requires_grad=True)
    assert not cpu_offload.is_cpu_offload_enabled()
    with context:
        assert cpu_offload.is_cpu_offload_enabled() and context.inside_context
        y = (kept @ w).sum()
    assert not cpu_offload.is_cpu_offload_enabled()
    assert context.num_packed == 1 and context.num_moved == 0
    y.backward()
    assert torch.equal(w.grad, kept.sum(0)[:, None].expand(H, H))


def test_disabled_megatron_call_and_refusals():
    # Megatron-core 0.19.2's call (TE >= 2.10): six positional arguments, then retain_pinned_cpu_buffers.
    context, sync = cpu_offload.get_cpu_offload_context(False, 1, 2, True, False, False, retain_pinned_cpu_buffers=False)
    x = torch.ones(2)
    with context:
        pass
    assert sync(x) is x
    context, sync = cpu_offload.get_cpu_offload_context(True, 1, 2, True, False, False, retain_pinned_cpu_buffers=True)
    with context:
        with pytest.raises(RuntimeError, match="entered again"):
            context.__enter__()
        with pytest.raises(RuntimeError, match="inside the CPU offload context"):
            sync(x)
    with pytest.raises(NotImplementedError, match="manual_synchronization"):
        cpu_offload.get_cpu_offload_context(True, 1, 2, manual_synchronization=True)
    with pytest.raises(NotImplementedError, match="offload_stream"):
        cpu_offload.get_cpu_offload_context(True, 1, 2, offload_stream=object())
    with pytest.raises(ValueError, match="`num_layers`"):
        cpu_offload.get_cpu_offload_context(True, 2, 2)
    with pytest.raises(ValueError, match="`offload_activations` or `offload_weights`"):
        cpu_offload.get_cpu_offload_context(True, 1, 2, False, False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        context, sync = cpu_offload.get_cpu_offload_context(True, 1, 2, False, True)
    assert any(issubclass(w.category, DeprecationWarning) for w in caught) and sync(x) is x


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: activations move to host memory and back")
def test_cuda_activations_move_to_host_and_back_bitwise():
    model = _model("cuda")
    plain = _step(model, device="cuda")
    context, sync = cpu_offload.get_cpu_offload_context(True, 2, LAYERS)
    _assert_bitwise(_step(model, context, sync, device="cuda"), plain)
    assert context.num_moved > 0 and context.num_unpacked == context.num_packed
