"""Is training with our attention bitwise reproducible here? Train a small transformer twice and compare.

    python -m transformer_engine.pytorch.determinism_check [--steps N] [--seq-len S] [--device auto|cpu|cuda]

Builds :class:`~transformer_engine.pytorch.models.TinyTransformerLM` (causal, GQA, the project's
``DotProductAttention``), trains it for N steps twice from the same seed with
``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` (unless ``--nondeterministic``), then a third time with the
unfused backend forced (``NVTE_FUSED_ATTN_BACKEND=unfused``). It reports the attention backend
each run selected, whether losses, every gradient at every step and every final parameter are
bitwise identical across the first two runs, the largest deviation of the first run from the
unfused one, and the time per step.

Exit status: 0 when the runs agree (or determinism was not requested), 1 when determinism was
requested and not met, 3 when ``--expect-backend`` names a backend that was not selected, 2 for
bad arguments or a configuration no backend can run.

On CPU attention runs unfused; with ``TRITON_INTERPRET=1`` (set before the first import of triton)
the fused Triton kernels run on CPU under Triton's interpreter (slow: keep shapes tiny). On a GPU
the fused kernels run natively.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence

import torch

from transformer_engine.common.attention.backends import NoBackendError
from transformer_engine.pytorch.models import TinyConfig, TinyTransformerLM

__all__ = ["main", "run_check", "CheckResult"]

_BACKEND_NAMES = {"fused": "FusedAttention", "unfused": "UnfusedDotProductAttention", "flash": "FlashAttention"}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Defaults by where the attention runs: (batch, seq_len, hidden, heads, gqa_groups, layers, steps, dtype).
_DEFAULTS = {
    "cuda": dict(batch_size=4, seq_len=1024, hidden_size=512, num_heads=8, gqa_groups=2, layers=4, steps=10,
                 dtype="bfloat16"),
    "cpu": dict(batch_size=2, seq_len=64, hidden_size=64, num_heads=4, gqa_groups=2, layers=2, steps=5,
                dtype="float32"),
    # The Triton interpreter executes every program instance in Python: tiny shapes only.
    "cpu-interpret": dict(batch_size=2, seq_len=32, hidden_size=64, num_heads=4, gqa_groups=2, layers=2, steps=3,
                          dtype="float32"),
}


# -- one training run ------------------------------------------------------------------------------


@dataclass
class RunResult:
    label: str
    losses: List[float] = field(default_factory=list)
    loss_bits: List[str] = field(default_factory=list)
    grad_digests: List[Dict[str, str]] = field(default_factory=list)  # per step: param name -> sha256
    first_grads: Dict[str, torch.Tensor] = field(default_factory=dict)
    last_grads: Dict[str, torch.Tensor] = field(default_factory=dict)
    params: Dict[str, torch.Tensor] = field(default_factory=dict)
    param_digests: Dict[str, str] = field(default_factory=dict)
    backends: List[str] = field(default_factory=list)
    step_seconds: List[float] = field(default_factory=list)

    @property
    def time_per_step_ms(self) -> float:
        # Median over steps; the first step (kernel compilation, allocator warm-up) is left out when we can.
        times = sorted(self.step_seconds[1:] if len(self.step_seconds) > 1 else self.step_seconds)
        if not times:
            return float("nan")
        mid = len(times) // 2
        return 1e3 * (times[mid] if len(times) % 2 else 0.5 * (times[mid - 1] + times[mid]))


def _digest(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


@contextlib.contextmanager
def _env(**values: Optional[str]) -> Iterator[None]:
    """Set (or, with None, unset) environment variables for the duration of the block."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _torch_deterministic(enabled: bool) -> Iterator[None]:
    """torch.use_deterministic_algorithms(True) for the block when ``enabled``, restored afterwards."""
    if not enabled:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled()
    # cuBLAS needs a fixed workspace configuration for reproducible results under this flag; it is
    # read when cuBLAS initialises, so it only takes effect if set before the first GPU matmul.
    with _env(CUBLAS_WORKSPACE_CONFIG=os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8")):
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(before)


class _Progress:
    """One line per run: redrawn in place on a terminal, one line per step otherwise."""

    def __init__(self, stream, enabled: bool) -> None:
        self.stream, self.enabled = stream, enabled
        self.tty = enabled and hasattr(stream, "isatty") and stream.isatty()

    def step(self, label: str, step: int, steps: int, loss: float, seconds: float) -> None:
        if not self.enabled:
            return
        width = 20
        done = int(width * step / steps)
        line = (f"{label:<22} [{'#' * done}{'.' * (width - done)}] step {step}/{steps}  "
                f"loss {loss:.6f}  {1e3 * seconds:8.1f} ms/step")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if step == steps else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train(label: str, cfg: TinyConfig, args, device: torch.device, dtype: torch.dtype,
           progress: _Progress) -> RunResult:
    result = RunResult(label)
    torch.manual_seed(args.seed)
    model = TinyTransformerLM(cfg).to(device=device, dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    data = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (args.steps, args.batch_size, args.seq_len + 1), generator=data)
    names = [name for name, _ in model.named_parameters()]
    for step in range(args.steps):
        batch = tokens[step].to(device)
        _sync(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model.loss(batch[:, :-1], batch[:, 1:])
        loss.backward()
        optimizer.step()
        _sync(device)
        result.step_seconds.append(time.perf_counter() - start)
        # Record after timing: copies and hashes are not part of a step.
        loss_value = loss.detach().float()
        result.losses.append(float(loss_value))
        result.loss_bits.append(_digest(loss.detach()))
        grads = {n: p.grad for n, p in model.named_parameters()}
        result.grad_digests.append({n: _digest(grads[n]) for n in names})
        if step == 0:
            result.first_grads = {n: g.detach().float().cpu() for n, g in grads.items()}
        if step == args.steps - 1:
            result.last_grads = {n: g.detach().float().cpu() for n, g in grads.items()}
        for backend in model.attention_backends():
            if backend not in result.backends:
                result.backends.append(backend)
        progress.step(label, step + 1, args.steps, result.losses[-1], result.step_seconds[-1])
    result.params = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    result.param_digests = {n: _digest(p) for n, p in model.named_parameters()}
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# -- comparison and report -------------------------------------------------------------------------


@dataclass
class CheckResult:
    device: str
    dtype: str
    deterministic_requested: bool
    steps: int
    backends: List[str]
    reference_backends: List[str]
    losses_equal: bool
    grads_equal: bool
    params_equal: bool
    first_mismatch: Optional[str]
    max_deviation: Dict[str, float]
    time_per_step_ms: Dict[str, float]
    model: Dict[str, object]
    exit_status: int = 0
    message: str = ""

    @property
    def bitwise_identical(self) -> bool:
        return self.losses_equal and self.grads_equal and self.params_equal

    def to_json(self) -> Dict[str, object]:
        out = dict(self.__dict__)
        out["bitwise_identical"] = self.bitwise_identical
        return out


def _first_difference(a: RunResult, b: RunResult) -> Optional[str]:
    for step, (la, lb) in enumerate(zip(a.loss_bits, b.loss_bits), 1):
        if la != lb:
            return f"loss at step {step} ({a.losses[step - 1]!r} vs {b.losses[step - 1]!r})"
        for name, digest in a.grad_digests[step - 1].items():
            if b.grad_digests[step - 1].get(name) != digest:
                return f"gradient of {name} at step {step}"
    for name, digest in a.param_digests.items():
        if b.param_digests.get(name) != digest:
            return f"parameter {name} after step {len(a.losses)}"
    return None


def _max_abs_diff(x: Dict[str, torch.Tensor], y: Dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for name, t in x.items():
        worst = max(worst, (t.double() - y[name].double()).abs().max().item())
    return worst


def _compare(a: RunResult, b: RunResult) -> Dict[str, bool]:
    return {
        "losses_equal": a.loss_bits == b.loss_bits,
        "grads_equal": a.grad_digests == b.grad_digests,
        "params_equal": a.param_digests == b.param_digests,
    }


def _fmt(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return "0" if x == 0 else f"{x:.3e}"


def _report(result: CheckResult, stream) -> None:
    yes = {True: "yes", False: "NO"}
    m = result.model
    rows = [
        ("attention backend", ", ".join(result.backends)),
        ("reference backend", ", ".join(result.reference_backends) or "(skipped)"),
        ("losses bitwise equal", f"{yes[result.losses_equal]} ({result.steps} steps)"),
        ("gradients bitwise equal", f"{yes[result.grads_equal]} (every step, {m['num_tensors']} tensors)"),
        ("parameters bitwise equal", f"{yes[result.params_equal]} ({m['num_tensors']} tensors)"),
    ]
    if result.first_mismatch:
        rows.append(("first difference", result.first_mismatch))
    dev = result.max_deviation
    if dev:
        rows += [
            ("max |loss - unfused|", _fmt(dev.get("loss"))),
            ("max |grad - unfused| step 1", _fmt(dev.get("grad_first_step"))),
            (f"max |grad - unfused| step {result.steps}", _fmt(dev.get("grad_last_step"))),
            ("max |param - unfused|", _fmt(dev.get("param"))),
        ]
    rows.append(("time per step", ", ".join(f"{k} {v:.1f} ms" for k, v in result.time_per_step_ms.items())))
    width = max(len(r[0]) for r in rows)
    stream.write("\n" + "-" * (width + 40) + "\n")
    for key, value in rows:
        stream.write(f"  {key:<{width}}  {value}\n")
    stream.write("-" * (width + 40) + "\n")
    stream.write(result.message + "\n")
    stream.flush()


# -- command line ----------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m transformer_engine.pytorch.determinism_check",
        description="Train a small transformer twice with the same seed and check bitwise reproducibility.",
    )
    p.add_argument("--steps", type=int, help="training steps per run")
    p.add_argument("--seq-len", type=int, help="tokens per sequence")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--num-heads", type=int, help="query heads")
    p.add_argument("--gqa-groups", type=int, help="key/value heads (GQA); equal to --num-heads for MHA")
    p.add_argument("--layers", type=int)
    p.add_argument("--qkv-format", choices=("bshd", "sbhd"), default="bshd")
    p.add_argument("--window", type=int, default=-1, help="sliding-window left size (-1: plain causal)")
    p.add_argument("--dtype", choices=("auto",) + tuple(_DTYPES), default="auto")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--nondeterministic", action="store_true",
                   help="do not request determinism (NVTE_ALLOW_NONDETERMINISTIC_ALGO=1)")
    p.add_argument("--torch-deterministic", action="store_true",
                   help="also call torch.use_deterministic_algorithms(True) for the runs (the other way to ask)")
    p.add_argument("--no-reference", action="store_true", help="skip the run with the unfused backend forced")
    p.add_argument("--expect-backend", choices=tuple(_BACKEND_NAMES),
                   help="exit 3 unless every attention call used this backend")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-' for stdout)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    return p


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("`--device cuda` was asked for but no CUDA device is available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"`--device` must be auto, cpu or cuda[:N], got {name!r}")
    return device


def run_check(args: argparse.Namespace, out=None, err=None) -> CheckResult:
    """Run the check for parsed ``args``; the header goes to ``out``, progress to ``err`` (default: stdout, stderr)."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    device = _resolve_device(args.device)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    defaults = _DEFAULTS["cuda" if device.type == "cuda" else ("cpu-interpret" if interpret else "cpu")]
    for key, value in defaults.items():
        if getattr(args, key, None) is None or (key == "dtype" and args.dtype == "auto"):
            setattr(args, key, value)
    for key in ("steps", "seq_len", "batch_size", "hidden_size", "num_heads", "gqa_groups", "layers"):
        if getattr(args, key) < 1:
            raise ValueError(f"`--{key.replace('_', '-')}` must be >= 1, got {getattr(args, key)}")
    dtype = _DTYPES[args.dtype]
    cfg = TinyConfig(
        hidden_size=args.hidden_size, num_layers=args.layers, num_attention_heads=args.num_heads,
        num_gqa_groups=args.gqa_groups, qkv_format=args.qkv_format, window_size=(args.window, 0),
    )
    cfg.validate()
    deterministic = not args.nondeterministic or args.torch_deterministic
    progress = _Progress(err, not args.quiet)

    how = []
    if not args.nondeterministic:
        how.append("NVTE_ALLOW_NONDETERMINISTIC_ALGO=0")
    if args.torch_deterministic:
        how.append("torch.use_deterministic_algorithms(True)")
    mode = f"requested ({', '.join(how)})" if deterministic else "not requested"
    out.write(
        f"Determinism check: {args.steps} steps x 2 runs{'' if args.no_reference else ' + unfused reference'}\n"
        f"  model: {args.layers} layers, hidden {args.hidden_size}, {args.num_heads} heads / {args.gqa_groups} "
        f"kv heads (d={cfg.head_dim}), causal{'' if args.window < 0 else f' window {args.window}'}, "
        f"{args.qkv_format}\n"
        f"  data: batch {args.batch_size} x seq {args.seq_len}, {args.dtype} on {device}"
        f"{' (Triton interpreter)' if interpret and device.type == 'cpu' else ''}, seed {args.seed}\n"
        f"  determinism: {mode}\n"
    )
    out.flush()

    nondet_value = "1" if args.nondeterministic else "0"
    with _env(NVTE_ALLOW_NONDETERMINISTIC_ALGO=nondet_value), _torch_deterministic(args.torch_deterministic):
        run1 = _train("run 1", cfg, args, device, dtype, progress)
        run2 = _train("run 2", cfg, args, device, dtype, progress)
        reference = None
        if not args.no_reference:
            with _env(NVTE_FUSED_ATTN_BACKEND="unfused"):
                reference = _train("reference (unfused)", cfg, args, device, dtype, progress)

    equal = _compare(run1, run2)
    max_dev: Dict[str, float] = {}
    if reference is not None:
        max_dev = {
            "loss": max(abs(a - b) for a, b in zip(run1.losses, reference.losses)),
            "grad_first_step": _max_abs_diff(run1.first_grads, reference.first_grads),
            "grad_last_step": _max_abs_diff(run1.last_grads, reference.last_grads),
            "param": _max_abs_diff(run1.params, reference.params),
        }
    times = {"run 1": run1.time_per_step_ms, "run 2": run2.time_per_step_ms}
    if reference is not None:
        times["unfused"] = reference.time_per_step_ms
    result = CheckResult(
        device=str(device), dtype=args.dtype, deterministic_requested=deterministic, steps=args.steps,
        backends=sorted(set(run1.backends) | set(run2.backends)),
        reference_backends=reference.backends if reference is not None else [],
        first_mismatch=_first_difference(run1, run2), max_deviation=max_dev, time_per_step_ms=times,
        model=dict(layers=args.layers, hidden_size=args.hidden_size, num_heads=args.num_heads,
                   gqa_groups=args.gqa_groups, seq_len=args.seq_len, batch_size=args.batch_size,
                   qkv_format=args.qkv_format, window=args.window, num_tensors=len(run1.params)),
        **equal,
    )
    if result.bitwise_identical:
        result.message = "RESULT: PASS: the two runs are bitwise identical"
    elif deterministic:
        result.exit_status = 1
        result.message = f"RESULT: FAIL: determinism was requested but the runs differ (first: {result.first_mismatch})"
    else:
        result.message = "RESULT: the runs differ (allowed: determinism was not requested)"
    if args.expect_backend is not None:
        want = _BACKEND_NAMES[args.expect_backend]
        if result.backends != [want]:
            result.exit_status = result.exit_status or 3
            result.message += f"\nRESULT: FAIL: expected every attention call on {want}, got {', '.join(result.backends)}"
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        result = run_check(args)
    except (ValueError, NoBackendError) as error:
        sys.stderr.write(f"determinism_check: error: {error}\n")
        return 2
    _report(result, sys.stdout)
    if args.json:
        text = json.dumps(result.to_json(), indent=2)
        if args.json == "-":
            sys.stdout.write(text + "\n")
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return result.exit_status


if __name__ == "__main__":
    sys.exit(main())
