"""Is JAX training with our attention bitwise reproducible here? Train a small transformer twice and compare.

    python -m transformer_engine.jax.determinism_check [--steps N] [--seq-len S] [--device auto|cpu|gpu]

The JAX half of the project's determinism check (the PyTorch half is
``transformer_engine.pytorch.determinism_check``; same options where they apply, same report and
JSON keys, same exit statuses). It builds :class:`~transformer_engine.jax.flax.models.TinyTransformerLM`
(causal, GQA, the project's Flax ``DotProductAttention``), trains it for N steps twice from the
same seed with ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` (unless ``--nondeterministic``), each run
traced and compiled anew, then a third time with the unfused backend forced
(``NVTE_FUSED_ATTN_BACKEND=unfused``). It reports the attention backend each run selected, whether
losses, every gradient at every step and every final parameter are bitwise identical across the
first two runs, the largest deviation of the first run from the unfused one, and the time per step.

The rest of the model runs on XLA, whose own GPU kernels (autotuned matmuls, scatter, some
reductions) are reproducible only under ``--xla_gpu_deterministic_ops=true``; when determinism is
requested the check adds that flag to ``XLA_FLAGS`` before JAX starts (``--no-xla-flag`` leaves
``XLA_FLAGS`` alone, to see what attention alone guarantees). The flag also selects our
deterministic attention backward by itself.

Exit status: 0 when the runs agree (or determinism was not requested), 1 when determinism was
requested and not met, 3 when ``--expect-backend`` names a backend that was not selected, 2 for
bad arguments or a configuration no backend can run.
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

__all__ = ["main", "run_check", "CheckResult"]

_BACKEND_NAMES = {"fused": "FusedAttention", "unfused": "UnfusedDotProductAttention"}
_DTYPES = ("float32", "float16", "bfloat16")
_XLA_DETERMINISTIC = "--xla_gpu_deterministic_ops=true"

# Defaults by where the attention runs: (batch, seq_len, hidden, heads, gqa_groups, layers, steps, dtype).
_DEFAULTS = {
    "gpu": dict(batch_size=4, seq_len=1024, hidden_size=512, num_heads=8, gqa_groups=2, layers=4, steps=10,
                dtype="bfloat16"),
    "cpu": dict(batch_size=2, seq_len=64, hidden_size=64, num_heads=4, gqa_groups=2, layers=2, steps=5,
                dtype="float32"),
}


# -- one training run ------------------------------------------------------------------------------


@dataclass
class RunResult:
    label: str
    losses: List[float] = field(default_factory=list)
    loss_bits: List[str] = field(default_factory=list)
    grad_digests: List[Dict[str, str]] = field(default_factory=list)  # per step: param path -> sha256
    first_grads: Dict[str, object] = field(default_factory=dict)
    last_grads: Dict[str, object] = field(default_factory=dict)
    params: Dict[str, object] = field(default_factory=dict)
    param_digests: Dict[str, str] = field(default_factory=dict)
    backends: List[str] = field(default_factory=list)
    step_seconds: List[float] = field(default_factory=list)

    @property
    def time_per_step_ms(self) -> float:
        # Median over steps, leaving out the first (tracing and compilation) when there are others.
        times = sorted(self.step_seconds[1:] if len(self.step_seconds) > 1 else self.step_seconds)
        if not times:
            return float("nan")
        mid = len(times) // 2
        return 1e3 * (times[mid] if len(times) % 2 else 0.5 * (times[mid - 1] + times[mid]))


def _digest(array) -> str:
    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(np.asarray(array)).tobytes()).hexdigest()


def _named_leaves(tree) -> Dict[str, object]:
    import jax

    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


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
        self.stream.write(("\r" + line + ("\n" if step == steps else "")) if self.tty else line + "\n")
        self.stream.flush()


def _train(label: str, cfg, args, device, progress: _Progress) -> RunResult:
    """One run: model, optimizer and the jitted step are built anew, so attention is traced (and
    its backend selected, its determinism switch read) again."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from transformer_engine.jax.attention import recording_backend_selections
    from transformer_engine.jax.flax.models import TinyTransformerLM

    result = RunResult(label)
    model = TinyTransformerLM(cfg)
    data = np.random.default_rng(args.seed + 1)
    tokens = data.integers(0, cfg.vocab_size, size=(args.steps, args.batch_size, args.seq_len + 1), dtype=np.int32)
    with jax.default_device(device):
        params = model.init(jax.random.PRNGKey(args.seed), jnp.asarray(tokens[0, :, :-1]))
        optimizer = optax.adamw(args.lr, weight_decay=0.01)
        # Committed to the device like the step's outputs, so step 2 reuses step 1's compilation.
        params, opt_state = jax.device_put((params, optimizer.init(params)), device)

        def step_fn(params, opt_state, batch):
            loss, grads = jax.value_and_grad(lambda p: model.apply(p, batch[:, :-1], batch[:, 1:],
                                                                   method=TinyTransformerLM.loss))(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return loss, grads, optax.apply_updates(params, updates), opt_state

        step = jax.jit(step_fn)
        with recording_backend_selections() as selected:
            for i in range(args.steps):
                batch = jax.device_put(tokens[i], device)
                start = time.perf_counter()
                loss, grads, params, opt_state = step(params, opt_state, batch)
                jax.block_until_ready((loss, params))
                result.step_seconds.append(time.perf_counter() - start)
                # Record after timing: copies and hashes are not part of a step.
                result.losses.append(float(loss))
                result.loss_bits.append(_digest(loss))
                named = _named_leaves(grads)
                result.grad_digests.append({n: _digest(g) for n, g in named.items()})
                if i == 0:
                    result.first_grads = {n: np.asarray(g, np.float64) for n, g in named.items()}
                if i == args.steps - 1:
                    result.last_grads = {n: np.asarray(g, np.float64) for n, g in named.items()}
                progress.step(label, i + 1, args.steps, result.losses[-1], result.step_seconds[-1])
        for name in selected:
            if name not in result.backends:
                result.backends.append(name)
    named = _named_leaves(params)
    result.params = {n: np.asarray(p, np.float64) for n, p in named.items()}
    result.param_digests = {n: _digest(p) for n, p in named.items()}
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
    xla_flags: str = ""
    exit_status: int = 0
    message: str = ""

    @property
    def bitwise_identical(self) -> bool:
        return self.losses_equal and self.grads_equal and self.params_equal

    def to_json(self) -> Dict[str, object]:
        out = dict(self.__dict__)
        out["bitwise_identical"] = self.bitwise_identical
        out["framework"] = "jax"
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


def _max_abs_diff(x: Dict[str, object], y: Dict[str, object]) -> float:
    import numpy as np

    return max((float(np.max(np.abs(x[n] - y[n]))) for n in x if np.size(x[n])), default=0.0)


def _fmt(x: Optional[float]) -> str:
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
        prog="python -m transformer_engine.jax.determinism_check",
        description="Train a small Flax transformer twice with the same seed and check bitwise reproducibility.",
    )
    p.add_argument("--steps", type=int, help="training steps per run")
    p.add_argument("--seq-len", type=int, help="tokens per sequence")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--num-heads", type=int, help="query heads")
    p.add_argument("--gqa-groups", type=int, help="key/value heads (GQA); equal to --num-heads for MHA")
    p.add_argument("--layers", type=int)
    p.add_argument("--window", type=int, default=-1, help="sliding-window left size (-1: plain causal)")
    p.add_argument("--dtype", choices=("auto",) + _DTYPES, default="auto")
    p.add_argument("--device", default="auto", help="auto, cpu or gpu")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--nondeterministic", action="store_true",
                   help="do not request determinism (NVTE_ALLOW_NONDETERMINISTIC_ALGO=1, XLA_FLAGS untouched)")
    p.add_argument("--no-xla-flag", action="store_true",
                   help=f"do not add {_XLA_DETERMINISTIC} to XLA_FLAGS (attention's switch only)")
    p.add_argument("--no-reference", action="store_true", help="skip the run with the unfused backend forced")
    p.add_argument("--expect-backend", choices=tuple(_BACKEND_NAMES),
                   help="exit 3 unless every attention call used this backend")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-' for stdout)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    return p


def _request_xla_determinism() -> None:
    """Add XLA's determinism flag before JAX starts its backend (XLA reads XLA_FLAGS once)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_deterministic_ops" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " " + _XLA_DETERMINISTIC).strip()


def _resolve_device(name: str):
    import jax

    if name not in ("auto", "cpu", "gpu", "cuda"):
        raise ValueError(f"`--device` must be auto, cpu or gpu, got {name!r}")
    if name == "auto":
        return jax.devices()[0]
    platform = "gpu" if name in ("gpu", "cuda") else "cpu"
    try:
        return jax.devices(platform)[0]
    except RuntimeError:
        raise ValueError(f"`--device {name}` was asked for but JAX has no {platform} device") from None


def run_check(args: argparse.Namespace, out=None, err=None) -> CheckResult:
    """Run the check for parsed ``args``; the header goes to ``out``, progress to ``err`` (default: stdout, stderr)."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    deterministic = not args.nondeterministic
    if deterministic and not args.no_xla_flag:
        _request_xla_determinism()

    import jax.numpy as jnp

    from transformer_engine.jax.flax.models import TinyConfig

    device = _resolve_device(args.device)
    on_gpu = device.platform == "gpu"
    for key, value in _DEFAULTS["gpu" if on_gpu else "cpu"].items():
        if getattr(args, key, None) is None or (key == "dtype" and args.dtype == "auto"):
            setattr(args, key, value)
    for key in ("steps", "seq_len", "batch_size", "hidden_size", "num_heads", "gqa_groups", "layers"):
        if getattr(args, key) < 1:
            raise ValueError(f"`--{key.replace('_', '-')}` must be >= 1, got {getattr(args, key)}")
    cfg = TinyConfig(
        hidden_size=args.hidden_size, num_layers=args.layers, num_attention_heads=args.num_heads,
        num_gqa_groups=args.gqa_groups, window_size=(args.window, 0), dtype=jnp.dtype(args.dtype),
    )
    cfg.validate()
    progress = _Progress(err, not args.quiet)
    xla_flags = os.environ.get("XLA_FLAGS", "")
    how = [] if args.nondeterministic else ["NVTE_ALLOW_NONDETERMINISTIC_ALGO=0"]
    if deterministic and "xla_gpu_deterministic_ops" in xla_flags:
        how.append("XLA_FLAGS " + _XLA_DETERMINISTIC)
    mode = f"requested ({', '.join(how)})" if deterministic else "not requested"
    out.write(
        f"Determinism check (JAX): {args.steps} steps x 2 runs{'' if args.no_reference else ' + unfused reference'}\n"
        f"  model: {args.layers} layers, hidden {args.hidden_size}, {args.num_heads} heads / {args.gqa_groups} "
        f"kv heads (d={cfg.head_dim}), causal{'' if args.window < 0 else f' window {args.window}'}, bshd\n"
        f"  data: batch {args.batch_size} x seq {args.seq_len}, {args.dtype} on {device}, seed {args.seed}\n"
        f"  determinism: {mode}\n"
    )
    out.flush()

    with _env(NVTE_ALLOW_NONDETERMINISTIC_ALGO="1" if args.nondeterministic else "0"):
        run1 = _train("run 1", cfg, args, device, progress)
        run2 = _train("run 2", cfg, args, device, progress)
        reference = None
        if not args.no_reference:
            with _env(NVTE_FUSED_ATTN_BACKEND="unfused"):
                reference = _train("reference (unfused)", cfg, args, device, progress)

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
        device=f"{device.platform}:{device.id}", dtype=args.dtype, deterministic_requested=deterministic,
        steps=args.steps, backends=sorted(set(run1.backends) | set(run2.backends)),
        reference_backends=reference.backends if reference is not None else [],
        losses_equal=run1.loss_bits == run2.loss_bits, grads_equal=run1.grad_digests == run2.grad_digests,
        params_equal=run1.param_digests == run2.param_digests, first_mismatch=_first_difference(run1, run2),
        max_deviation=max_dev, time_per_step_ms=times,
        model=dict(layers=args.layers, hidden_size=args.hidden_size, num_heads=args.num_heads,
                   gqa_groups=args.gqa_groups, seq_len=args.seq_len, batch_size=args.batch_size,
                   qkv_format="bshd", window=args.window, num_tensors=len(run1.params)),
        xla_flags=xla_flags,
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
    from transformer_engine.common.attention.backends import NoBackendError

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
