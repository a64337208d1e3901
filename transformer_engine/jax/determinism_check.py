"""Is JAX training with our attention bitwise reproducible here? Train a small transformer twice and compare.

    python -m transformer_engine.jax.determinism_check [--steps N] [--seq-len S] [--device auto|cpu|gpu]
    python -m transformer_engine.jax.determinism_check --fused-interpreter   # the fused kernels, on CPU
    python -m transformer_engine.jax.determinism_check --batch-invariant     # + whole-model batch invariance

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

On CPU attention runs unfused (jnp math), so the check is of the training loop, not of the fused
kernels; the report says so. ``--fused-interpreter`` runs the fused Triton kernels on CPU under Triton's
interpreter (``TRITON_INTERPRET=1`` and ``NVTE_JAX_TRITON_INTERPRET=1``, in a child process; torch must be
installed, as the interpreter reads torch CPU tensors), at small default shapes, in float32 or float16, and
requires every call to select them (as ``--expect-backend fused``). On a GPU the fused kernels run natively.

``--batch-invariant`` adds a whole-model batch-invariance report (``extra["batch_invariance"]`` in the
JSON): a stack of Flax ``TransformerLayer`` in batch-invariant mode scores each sequence in a batch and alone,
and every logit and input gradient must be bitwise equal.

Exit status: 0 when the runs agree (or determinism was not requested), 1 when determinism was
requested and not met, 3 when ``--expect-backend`` names a backend that was not selected, 2 for
bad arguments or a configuration no backend can run.

The comparison, the report, the JSON, the exit statuses and the options shared with the PyTorch
check are :mod:`transformer_engine.common.determinism_report`; this module trains.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import time
from typing import Dict, Optional, Sequence

from transformer_engine.common import determinism_report as report
from transformer_engine.common.determinism_report import CheckResult, Progress, RunResult
from transformer_engine.common.settings import environment

__all__ = ["main", "run_check", "CheckResult"]

_XLA_DETERMINISTIC = "--xla_gpu_deterministic_ops=true"
_DEFAULTS = {
    "gpu": report.GPU_DEFAULTS,
    "cpu": report.CPU_DEFAULTS,
    # The Triton interpreter executes every program instance in Python: tiny shapes only.
    "cpu-interpret": dict(report.CPU_DEFAULTS, seq_len=32, steps=3),
}
# Where each set of defaults applies, as --help says it.
_DEFAULTS_HELP = {"on a GPU": _DEFAULTS["gpu"], "on CPU": _DEFAULTS["cpu"],
                  "with --fused-interpreter": _DEFAULTS["cpu-interpret"]}


# -- one training run ------------------------------------------------------------------------------


def _named_leaves(tree) -> Dict[str, object]:
    import jax

    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _train(label: str, cfg, args, device, progress: Progress) -> RunResult:
    """One run: model, optimizer and the jitted step are built anew, so attention is traced (and
    its backend selected, its determinism switch read) again."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from transformer_engine.common.log import selected_backends as recording_backend_selections
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
                result.loss_bits.append(report.digest(loss))
                named = _named_leaves(grads)
                result.grad_digests.append({n: report.digest(g) for n, g in named.items()})
                if i == 0:
                    result.first_grads = {n: np.asarray(g, np.float64) for n, g in named.items()}
                if i == args.steps - 1:
                    result.last_grads = {n: np.asarray(g, np.float64) for n, g in named.items()}
                progress.step(label, i + 1, args.steps, result.losses[-1], result.step_seconds[-1])
        result.add_backends(selected)
    named = _named_leaves(params)
    result.params = {n: np.asarray(p, np.float64) for n, p in named.items()}
    result.param_digests = {n: report.digest(p) for n, p in named.items()}
    return result


def _batch_invariance_probe(cfg, args, device) -> dict:
    """Whole-model batch invariance in batch-invariant mode (:mod:`transformer_engine.jax.batch_invariance`): a
    stack of Flax ``TransformerLayer`` (RMSNorm, SwiGLU, causal, the check's heads and GQA groups) with a final
    norm and an output ``DenseGeneral`` scores ``batch_size`` sequences in one batch and each alone, and the
    gradient of a loss of the logits with respect to the input in both. Counts the sequences whose logits or
    input gradients differ in any bit (the same probe as PyTorch's, without the KV-cache decode: the Flax
    ``TransformerLayer`` has none)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    from transformer_engine.jax.batch_invariance import batch_invariant
    from transformer_engine.jax.flax import DenseGeneral, LayerNorm, TransformerLayer

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(cfg.num_layers):
                x = TransformerLayer(
                    hidden_size=cfg.hidden_size, mlp_hidden_size=cfg.ffn_size,
                    num_attention_heads=cfg.num_attention_heads, num_gqa_groups=cfg.num_gqa_groups,
                    layernorm_type="rmsnorm", hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0,
                    mlp_activations=("silu", "linear"), enable_relative_embedding=False, scale_attn_logits=True,
                    self_attn_mask_type="causal", name=f"layer_{i}")(x, deterministic=True)
            x = LayerNorm(layernorm_type="rmsnorm", name="norm")(x)
            return DenseGeneral(cfg.vocab_size, use_bias=False, name="head")(x)

    model = Model()
    data = np.random.default_rng(args.seed + 2)
    x = jnp.asarray(data.standard_normal((args.batch_size, args.seq_len, cfg.hidden_size)), cfg.dtype)
    dlogits = jnp.asarray(data.standard_normal((args.batch_size, args.seq_len, cfg.vocab_size)), jnp.float32)
    with jax.default_device(device):
        params = model.init(jax.random.PRNGKey(args.seed), x[:1])

        def logits_and_dx(params, x, dlogits):
            logits, vjp = jax.vjp(lambda x: model.apply(params, x), x)
            return logits, vjp(dlogits.astype(logits.dtype))[0]

        with batch_invariant():
            run = jax.jit(logits_and_dx)  # traced inside the context: the mode's kernels
            batch, dx = run(params, x, dlogits)
            differing = 0
            for i in range(args.batch_size):
                alone, dx_alone = run(params, x[i:i + 1], dlogits[i:i + 1])
                same = np.array_equal(np.asarray(alone[0]), np.asarray(batch[i]))
                differing += not (same and np.array_equal(np.asarray(dx_alone[0]), np.asarray(dx[i])))
    return {"sequences": args.batch_size, "sequences_differing_alone": differing, "bitwise": differing == 0}


# -- command line ----------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    return report.build_parser(
        prog="python -m transformer_engine.jax.determinism_check",
        description="Train a small Flax transformer twice with the same seed and check bitwise reproducibility.",
        device_help="auto, cpu or gpu",
        nondeterministic_help="do not request determinism (NVTE_ALLOW_NONDETERMINISTIC_ALGO=1, XLA_FLAGS untouched)",
        expect_backends=("fused", "unfused"),
        defaults=_DEFAULTS_HELP,
        determinism_options=[
            ("--no-xla-flag", dict(
                action="store_true", help=f"do not add {_XLA_DETERMINISTIC} to XLA_FLAGS (attention's switch only)")),
            ("--batch-invariant", dict(
                action="store_true",
                help="also check whole-model batch invariance: a stack of Flax TransformerLayers and an output "
                     "DenseGeneral in batch-invariant mode (NVTE_BATCH_INVARIANT) score each sequence in a batch "
                     "and alone; every logit and input gradient must be bitwise equal (a CUDA GPU, or the CPU with "
                     "--fused-interpreter)")),
            ("--fused-interpreter", dict(
                action="store_true",
                help="run the fused Triton kernels on CPU under Triton's interpreter (sets both TRITON_INTERPRET=1 "
                     "and NVTE_JAX_TRITON_INTERPRET=1 for a child process; needs torch; slow, so small shapes by "
                     "default; --dtype float32, the default, or float16)")),
        ],
    )


def _interpreting() -> bool:
    """Whether this process loads the kernels for Triton's interpreter (TRITON_INTERPRET=1, read by Triton)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _rerun_interpreted(argv: Sequence[str]) -> int:
    """This command again in a child with TRITON_INTERPRET=1: Triton reads it when kernels are defined."""
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1", NVTE_JAX_TRITON_INTERPRET="1")
    return subprocess.call([sys.executable, "-m", "transformer_engine.jax.determinism_check", *argv], env=env)


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
    interpret = getattr(args, "fused_interpreter", False)
    if interpret:
        if args.device not in ("auto", "cpu"):
            raise ValueError(f"`--fused-interpreter` runs on CPU, got `--device {args.device}`")
        if args.dtype == "bfloat16":
            raise ValueError("`--fused-interpreter` needs `--dtype float32` or `float16`: Triton's interpreter "
                             "computes bfloat16 dots wrongly")
        if importlib.util.find_spec("torch") is None:
            raise ValueError("`--fused-interpreter` needs torch installed: Triton's interpreter reads torch CPU tensors")
        args.device = "cpu"
        args.expect_backend = args.expect_backend or "fused"
    deterministic = not args.nondeterministic
    if deterministic and not args.no_xla_flag:
        _request_xla_determinism()

    import jax.numpy as jnp

    from transformer_engine.jax.flax.models import TinyConfig

    device = _resolve_device(args.device)
    interpret = interpret and device.platform == "cpu"
    if getattr(args, "batch_invariant", False) and device.platform == "cpu" and not interpret:
        raise ValueError("`--batch-invariant` needs a CUDA GPU or `--fused-interpreter` (the batch-invariant "
                         "kernels are Triton kernels)")
    report.apply_defaults(args, _DEFAULTS["gpu" if device.platform == "gpu" else
                                          "cpu-interpret" if interpret else "cpu"])
    cfg = TinyConfig(
        hidden_size=args.hidden_size, num_layers=args.layers, num_attention_heads=args.num_heads,
        num_gqa_groups=args.gqa_groups, window_size=(args.window, 0), dtype=jnp.dtype(args.dtype),
    )
    cfg.validate()
    progress = Progress(err, not args.quiet)
    xla_flags = os.environ.get("XLA_FLAGS", "")
    how = [] if args.nondeterministic else ["NVTE_ALLOW_NONDETERMINISTIC_ALGO=0"]
    if deterministic and "xla_gpu_deterministic_ops" in xla_flags:
        how.append("XLA_FLAGS " + _XLA_DETERMINISTIC)
    out.write(report.header("Determinism check (JAX)", args, head_dim=cfg.head_dim, qkv_format="bshd",
                            device=f"{device}{' (Triton interpreter)' if interpret else ''}",
                            deterministic=deterministic, how=how))
    out.flush()

    interpreted = {"NVTE_JAX_TRITON_INTERPRET": "1"} if interpret else {}
    with environment(NVTE_ALLOW_NONDETERMINISTIC_ALGO="1" if args.nondeterministic else "0", **interpreted):
        run1 = _train("run 1", cfg, args, device, progress)
        run2 = _train("run 2", cfg, args, device, progress)
        reference = reference_fp32 = None
        if not args.no_reference:
            with environment(NVTE_FUSED_ATTN_BACKEND="unfused"):
                reference = _train("reference (unfused)", cfg, args, device, progress)
                if args.dtype != "float32":  # the unfused path's own low-precision error, at step 1
                    reference_fp32 = _train("reference (unfused, float32, 1 step)",
                                            dataclasses.replace(cfg, dtype=jnp.dtype("float32")),
                                            argparse.Namespace(**dict(vars(args), steps=1)), device, progress)

    result = report.check_result(args, run1, run2, reference, device=f"{device.platform}:{device.id}",
                                 qkv_format="bshd", deterministic=deterministic, extra={"xla_flags": xla_flags},
                                 framework="jax", reference_fp32=reference_fp32)
    note = report.what_is_checked(result.backends, device.platform == "cpu", interpret, "jnp math")
    if note and not interpret:
        # The backend's reasons name both variables; say that both are needed and that the flag sets them.
        note += (" --fused-interpreter sets both variables the interpreted kernels need, TRITON_INTERPRET=1 (read "
                 "when triton is first imported) and NVTE_JAX_TRITON_INTERPRET=1, in a child process.")
    if note:
        result.message += "\n" + note
    if getattr(args, "batch_invariant", False):
        with environment(NVTE_ALLOW_NONDETERMINISTIC_ALGO="1" if args.nondeterministic else "0", **interpreted):
            probe = _batch_invariance_probe(cfg, args, device)
        result.extra["batch_invariance"] = probe
        result.message += (
            f"\nWhole-model batch invariance (Flax TransformerLayer stack, batch-invariant mode): "
            f"{probe['sequences_differing_alone']} of {probe['sequences']} sequences differ alone from in the batch "
            f"(logits or input gradients): {'bitwise equal' if probe['bitwise'] else 'NOT batch-invariant'}.")
        if not probe["bitwise"] and result.exit_status == report.EXIT_PASS:
            result.exit_status = report.EXIT_NOT_DETERMINISTIC
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def rerun(args: argparse.Namespace) -> Optional[int]:
        # Decided on the parsed options (which take no abbreviations), so the child gets exactly what was asked.
        return _rerun_interpreted(argv) if args.fused_interpreter and not _interpreting() else None

    return report.main(_parser(), run_check, argv, rerun=rerun)


if __name__ == "__main__":
    sys.exit(main())
