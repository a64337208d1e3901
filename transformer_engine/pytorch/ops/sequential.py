"""``Sequential``: a container of operations and modules, run in order.

There is no operation fuser: each operation runs as written (plain autograd over this package's functions),
one after another, so a ``Sequential`` gives the bits of the same operations called by hand, and of the modules
they stand for. The container follows TransformerEngine's: ``append``, ``extend``, ``insert``, ``pop``,
indexing and slicing, ``+`` / ``+=``, and the extra tensors: ``forward(input, *extra_inputs)`` hands each
operation with ``num_extra_inputs`` its extra inputs in order, and returns ``(output, *extra_outputs)`` when
operations (``MakeExtraOutput``) gave extra outputs, else the output alone.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional, Union

import torch

from transformer_engine.pytorch.ops.op import FusibleOperation

__all__ = ["Sequential"]


class Sequential(torch.nn.Module):
    """Operations (and any ``torch.nn.Module``) run in order; ``Sequential(op1, op2, ...)`` or
    ``Sequential({"name": op, ...})``."""

    def __init__(self, *args: Union[torch.nn.Module, dict]) -> None:
        super().__init__()
        if len(args) == 1 and isinstance(args[0], dict):
            for key, module in args[0].items():
                self.add_module(key, module)
        else:
            for module in args:
                self.append(module)

    def _keys(self, idx: Union[int, slice]) -> list:
        keys = list(self._modules.keys())
        if isinstance(idx, slice):
            return keys[idx]
        if isinstance(idx, bool) or not isinstance(idx, int):
            raise TypeError(f"Sequential indices must be ints or slices, got {idx!r}")
        if not -len(keys) <= idx < len(keys):
            raise IndexError(f"index {idx} is out of range for a Sequential of {len(keys)} modules")
        return [keys[idx]]

    def _next_key(self) -> str:
        numeric = [int(k) for k in self._modules if k.isdigit()]
        return str(max(numeric) + 1 if numeric else 0)

    def __getitem__(self, idx: Union[int, slice]) -> torch.nn.Module:
        keys = self._keys(idx)
        if isinstance(idx, slice):
            return Sequential(*(self._modules[k] for k in keys))
        return self._modules[keys[0]]

    def __setitem__(self, idx: int, module: torch.nn.Module) -> None:
        self._modules[self._keys(idx)[0]] = module

    def __delitem__(self, idx: Union[int, slice]) -> None:
        for key in self._keys(idx):
            del self._modules[key]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[torch.nn.Module]:
        return iter(self._modules.values())

    def append(self, module: torch.nn.Module) -> "Sequential":
        """Add ``module`` at the end."""
        if not isinstance(module, torch.nn.Module):
            raise ValueError(f"`module` must be a torch.nn.Module, got {type(module).__name__}")
        self.add_module(self._next_key(), module)
        return self

    def extend(self, modules: Iterable[torch.nn.Module]) -> "Sequential":
        """Add ``modules`` at the end, in order."""
        for module in modules:
            self.append(module)
        return self

    def insert(self, idx: int, module: torch.nn.Module) -> "Sequential":
        """Put ``module`` at position ``idx``; the modules from there on move one place later."""
        modules = list(self._modules.values())
        modules.insert(idx, module)
        self._modules.clear()
        self.extend(modules)
        return self

    def pop(self, idx: Union[int, slice]) -> torch.nn.Module:
        """Remove and return the module (or ``Sequential`` of modules) at ``idx``."""
        out = self[idx]
        del self[idx]
        return out

    def __iadd__(self, modules: Iterable[torch.nn.Module]) -> "Sequential":
        return self.extend(modules)

    def __add__(self, modules: Iterable[torch.nn.Module]) -> "Sequential":
        return Sequential(*self, *modules)

    def forward(self, input: torch.Tensor, *extra_inputs: torch.Tensor,  # noqa: A002 - TransformerEngine's name
                op_kwargs: Optional[dict] = None) -> Union[torch.Tensor, tuple]:
        if op_kwargs:
            raise NotImplementedError("Sequential: `op_kwargs` is not implemented: no operation here takes "
                                      "per-call keyword arguments")
        needed = sum(m.num_extra_inputs for m in self if isinstance(m, FusibleOperation))
        if len(extra_inputs) != needed:
            raise ValueError(f"Sequential must get {needed} extra inputs (one per extra input its operations take), "
                             f"got {len(extra_inputs)}")
        x, remaining, extra_outputs = input, list(extra_inputs), []
        for module in self:
            if isinstance(module, FusibleOperation):
                mine, remaining = remaining[:module.num_extra_inputs], remaining[module.num_extra_inputs:]
                x, outs = module.op_run(x, tuple(mine))
                extra_outputs.extend(outs)
            else:
                x = module(x)
        return (x, *extra_outputs) if extra_outputs else x
