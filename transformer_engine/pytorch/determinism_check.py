"""Is training with our attention bitwise reproducible here? Train a small transformer twice and compare.

    python -m transformer_engine.pytorch.determinism_check [--steps N] [--seq-len S] [--device auto|cpu|cuda]
    python -m transformer_engine.pytorch.determinism_check --fused-interpreter   # the fused kernels, on CPU

Builds :class:`~transformer_engine.pytorch.models.TinyTransformerLM` (causal, GQA, the project's
``DotProductAttention``), trains it for N steps twice from the same seed with
``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` (unless ``--nondeterministic``), then a third time with the
unfused backend forced (``NVTE_FUSED_ATTN_BACKEND=unfused``), and for float16/bfloat16 one step
unfused in float32 (which measures the unfused path's own low-precision error). It reports the attention backend
each run selected, whether losses, every gradient at every step and every final parameter are
bitwise identical across the first two runs, the largest deviation of the first run from the
unfused one, and the time per step.

Exit status: 0 when the runs agree (or determinism was not requested), 1 when determinism was
requested and not met, 3 when ``--expect-backend`` names a backend that was not selected, 4 when
the step-1 gradients deviate from the unfused ones beyond the tolerance
(:func:`~transformer_engine.common.determinism_report.deviation_tolerance`), 2 for bad arguments
or a configuration no backend can run.

On CPU attention runs unfused (PyTorch math), so the check is of the training loop, not of the fused
kernels; the report says so. ``--fused-interpreter`` (or ``TRITON_INTERPRET=1`` set before the first
import of triton) runs the fused Triton kernels on CPU under Triton's interpreter, at small default
shapes, in float32 or float16 (bfloat16 dots are computed wrongly by the interpreter), and requires
every call to select them (as ``--expect-backend fused``). On a GPU the fused kernels run natively.

The comparison, the report, the JSON, the exit statuses and the options shared with the JAX check
are :mod:`transformer_engine.common.determinism_report`; this module trains.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Iterator, Optional, Sequence

import torch

from transformer_engine.common import determinism_report as report
from transformer_engine.common.determinism_report import CheckResult, Progress, RunResult
from transformer_engine.common.settings import environment
from transformer_engine.pytorch.attention.config import triton_interpreting
from transformer_engine.pytorch.models import TinyConfig, TinyTransformerLM

__all__ = ["main", "run_check", "CheckResult"]

_DTYPES = {name: getattr(torch, name) for name in report.DTYPES}

_DEFAULTS = {
    "cuda": report.GPU_DEFAULTS,
    "cpu": report.CPU_DEFAULTS,
    # The Triton interpreter executes every program instance in Python: tiny shapes only.
    "cpu-interpret": dict(report.CPU_DEFAULTS, seq_len=32, steps=3),
}
# Where each set of defaults applies, as --help says it.
_DEFAULTS_HELP = {"on a GPU": _DEFAULTS["cuda"], "on CPU": _DEFAULTS["cpu"],
                  "with --fused-interpreter": _DEFAULTS["cpu-interpret"]}


# -- one training run ------------------------------------------------------------------------------


def _digest(t: torch.Tensor) -> str:
    # Viewed as bytes: numpy has no bfloat16.
    return report.digest(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy())


def _to_numpy(t: torch.Tensor):
    return t.detach().float().cpu().numpy()


@contextlib.contextmanager
def _torch_deterministic(enabled: bool) -> Iterator[None]:
    """torch.use_deterministic_algorithms(True) for the block when ``enabled``, restored afterwards."""
    if not enabled:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled()
    # cuBLAS needs a fixed workspace configuration for reproducible results under this flag; it is
    # read when cuBLAS initialises, so it only takes effect if set before the first GPU matmul.
    with environment(CUBLAS_WORKSPACE_CONFIG=os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8")):
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(before)


@contextlib.contextmanager
def _one_cpu_thread(device: torch.device) -> Iterator[None]:
    """On CPU, torch's intra-op threads set to one for the block (restored afterwards).

    The check's subject is the attention path; the rest of the training step is torch's own CPU kernels, which
    split an operation's elements over the threads that join it, and not every kernel gives the same bits for
    every split. Seen here: with two threads on a loaded two-core machine, about one run in 30 to 160 updated
    half of the embedding table in different bits (AdamW), while every attention call's inputs and outputs were
    bitwise equal. One thread takes the split out of the comparison. GPU runs are unaffected."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train(label: str, cfg: TinyConfig, args, device: torch.device, dtype: torch.dtype,
           progress: Progress) -> RunResult:
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
        result.losses.append(float(loss.detach().float()))
        result.loss_bits.append(_digest(loss.detach()))
        grads = {n: p.grad for n, p in model.named_parameters()}
        result.grad_digests.append({n: _digest(grads[n]) for n in names})
        if step == 0:
            result.first_grads = {n: _to_numpy(g) for n, g in grads.items()}
        if step == args.steps - 1:
            result.last_grads = {n: _to_numpy(g) for n, g in grads.items()}
        result.add_backends(model.attention_backends())
        progress.step(label, step + 1, args.steps, result.losses[-1], result.step_seconds[-1])
    result.params = {n: _to_numpy(p) for n, p in model.named_parameters()}
    result.param_digests = {n: _digest(p) for n, p in model.named_parameters()}
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _batch_invariance_probe(cfg: TinyConfig, args, device: torch.device, dtype: torch.dtype) -> dict:
    """Whole-model batch invariance in batch-invariant mode: a stack of ``TransformerLayer`` (RMSNorm, SwiGLU,
    the check's heads and GQA groups) with a final norm and an output ``Linear`` scores ``batch_size`` sequences
    in one batch and each alone, then decodes the first one token by token through the KV cache. Counts the
    sequences (alone) and positions (decode) whose logits differ in any bit from the batch's."""
    from collections import OrderedDict

    from transformer_engine.pytorch import InferenceParams, Linear, RMSNorm, TransformerLayer
    from transformer_engine.pytorch.batch_invariance import batch_invariant

    torch.manual_seed(args.seed)
    layers = [TransformerLayer(cfg.hidden_size, cfg.ffn_size, cfg.num_attention_heads,
                               num_gqa_groups=cfg.num_gqa_groups, normalization="RMSNorm", activation="swiglu",
                               attn_input_format="bshd", hidden_dropout=0.0, attention_dropout=0.0,
                               layer_number=i + 1, params_dtype=dtype, device=device).eval()
              for i in range(cfg.num_layers)]
    norm = RMSNorm(cfg.hidden_size, params_dtype=dtype, device=device)
    head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, params_dtype=dtype, device=device)

    def model(x, **kw):
        for layer in layers:
            x = layer(x, **kw)
        return head(norm(x))

    gen = torch.Generator(device="cpu").manual_seed(args.seed + 2)
    x = torch.randn(args.batch_size, args.seq_len, cfg.hidden_size, generator=gen).to(device=device, dtype=dtype)
    with torch.no_grad(), batch_invariant():
        batch = model(x)
        alone_bad = sum(not torch.equal(model(x[i:i + 1])[0], batch[i]) for i in range(args.batch_size))
        params = InferenceParams(1, args.seq_len, cfg.num_gqa_groups, cfg.head_dim, dtype, qkv_format="bshd")
        decoded = []
        for t in range(args.seq_len):
            params.pre_step(OrderedDict([(0, 1)]))
            decoded.append(model(x[:1, t:t + 1], inference_params=params)[0])
        decode_bad = int((torch.cat(decoded) != batch[0]).any(-1).sum())
    return {"sequences": args.batch_size, "positions_decoded": args.seq_len, "sequences_differing_alone": alone_bad,
            "positions_differing_decoded": decode_bad, "bitwise": alone_bad == 0 and decode_bad == 0}


# -- command line ----------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    return report.build_parser(
        prog="python -m transformer_engine.pytorch.determinism_check",
        description="Train a small transformer twice with the same seed and check bitwise reproducibility.",
        device_help="auto, cpu, cuda or cuda:N",
        nondeterministic_help="do not request determinism (NVTE_ALLOW_NONDETERMINISTIC_ALGO=1)",
        expect_backends=("fused", "unfused", "flash"),
        defaults=_DEFAULTS_HELP,
        shape_options=[("--qkv-format", dict(choices=("bshd", "sbhd"), default="bshd",
                                              help="layout of the attention inputs"))],
        determinism_options=[
            ("--torch-deterministic", dict(
                action="store_true",
                help="also call torch.use_deterministic_algorithms(True) for the runs (the other way to ask)")),
            ("--batch-invariant", dict(
                action="store_true",
                help="also check whole-model batch invariance: a stack of TransformerLayers and an output Linear in "
                     "batch-invariant mode (NVTE_BATCH_INVARIANT) score each sequence in a batch, alone and decoded "
                     "token by token through the KV cache; every logit must be bitwise equal (CUDA, or the CPU "
                     "with --fused-interpreter)")),
            ("--fused-interpreter", dict(
                action="store_true",
                help="run the fused Triton kernels on CPU under Triton's interpreter (sets TRITON_INTERPRET=1 for "
                     "a child process; slow, so small shapes by default; --dtype float32, the default, or "
                     "float16)")),
        ],
    )


def _rerun_interpreted(argv: Sequence[str]) -> int:
    """This command again in a child with TRITON_INTERPRET=1: Triton reads it when kernels are defined."""
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.call([sys.executable, "-m", "transformer_engine.pytorch.determinism_check", *argv], env=env)


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
    if getattr(args, "fused_interpreter", False):
        if args.device not in ("auto", "cpu"):
            raise ValueError(f"`--fused-interpreter` runs on CPU, got `--device {args.device}`")
        if args.dtype == "bfloat16":
            raise ValueError("`--fused-interpreter` needs `--dtype float32` or `float16`: Triton's interpreter "
                             "computes bfloat16 dots wrongly")
        args.device = "cpu"
        args.expect_backend = args.expect_backend or "fused"
    device = _resolve_device(args.device)
    interpret = triton_interpreting() and device.type == "cpu"
    report.apply_defaults(args, _DEFAULTS["cpu-interpret" if interpret else device.type])
    dtype = _DTYPES[args.dtype]
    cfg = TinyConfig(
        hidden_size=args.hidden_size, num_layers=args.layers, num_attention_heads=args.num_heads,
        num_gqa_groups=args.gqa_groups, qkv_format=args.qkv_format, window_size=(args.window, 0),
    )
    cfg.validate()
    deterministic = not args.nondeterministic or args.torch_deterministic
    progress = Progress(err, not args.quiet)

    how = []
    if not args.nondeterministic:
        how.append("NVTE_ALLOW_NONDETERMINISTIC_ALGO=0")
    if args.torch_deterministic:
        how.append("torch.use_deterministic_algorithms(True)")
    out.write(report.header(
        "Determinism check", args, head_dim=cfg.head_dim, qkv_format=args.qkv_format,
        device=f"{device}{' (Triton interpreter)' if interpret else ''}", deterministic=deterministic, how=how,
    ))
    out.flush()

    nondet_value = "1" if args.nondeterministic else "0"
    with environment(NVTE_ALLOW_NONDETERMINISTIC_ALGO=nondet_value), _torch_deterministic(args.torch_deterministic), \
            _one_cpu_thread(device):
        run1 = _train("run 1", cfg, args, device, dtype, progress)
        run2 = _train("run 2", cfg, args, device, dtype, progress)
        reference = reference_fp32 = None
        if not args.no_reference:
            with environment(NVTE_FUSED_ATTN_BACKEND="unfused"):
                reference = _train("reference (unfused)", cfg, args, device, dtype, progress)
                if dtype != torch.float32:  # the unfused path's own low-precision error, at step 1
                    reference_fp32 = _train("reference (unfused, float32, 1 step)", cfg,
                                            argparse.Namespace(**dict(vars(args), steps=1)), device, torch.float32,
                                            progress)

    result = report.check_result(args, run1, run2, reference, device=str(device), qkv_format=args.qkv_format,
                                 deterministic=deterministic, reference_fp32=reference_fp32)
    note = report.what_is_checked(result.backends, device.type == "cpu", interpret, "PyTorch math")
    if note:
        result.message += "\n" + note
    if args.batch_invariant:
        if device.type == "cpu" and not interpret:
            raise ValueError("`--batch-invariant` needs CUDA or `--fused-interpreter` (the batch-invariant kernels "
                             "are Triton kernels)")
        with environment(NVTE_ALLOW_NONDETERMINISTIC_ALGO=nondet_value):
            probe = _batch_invariance_probe(cfg, args, device, dtype)
        result.extra["batch_invariance"] = probe
        result.message += (
            f"\nWhole-model batch invariance (TransformerLayer stack, batch-invariant mode): "
            f"{probe['sequences_differing_alone']} of {probe['sequences']} sequences differ alone from in the batch, "
            f"{probe['positions_differing_decoded']} of {probe['positions_decoded']} positions differ when decoded "
            f"token by token: {'bitwise equal' if probe['bitwise'] else 'NOT batch-invariant'}.")
        if not probe["bitwise"] and result.exit_status == report.EXIT_PASS:
            result.exit_status = report.EXIT_NOT_DETERMINISTIC
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def rerun(args: argparse.Namespace) -> Optional[int]:
        # Decided on the parsed options (which take no abbreviations), so the child gets exactly what was asked.
        return _rerun_interpreted(argv) if args.fused_interpreter and not triton_interpreting() else None

    return report.main(_parser(), run_check, argv, rerun=rerun)


if __name__ == "__main__":
    sys.exit(main())
