"""The framework-free half of the determinism check: what a run records, how two runs are compared,
the verdict and its exit status, the report, the JSON and the command-line options both checks share.

``python -m transformer_engine.pytorch.determinism_check`` and
``python -m transformer_engine.jax.determinism_check`` each train a small model and fill one
:class:`RunResult` per run with plain Python values and numpy arrays (sha256 digests of every
loss, gradient and parameter; gradients and parameters as arrays for the deviation from the
unfused run). From there on the two are the same code, in this module: so they print the same
table, write the same JSON keys and exit with the same statuses.

Exit statuses: :data:`EXIT_PASS` (0) when the runs agree or determinism was not requested,
:data:`EXIT_NOT_DETERMINISTIC` (1) when it was requested and not met,
:data:`EXIT_BAD_ARGUMENTS` (2) for bad arguments or a configuration no backend can run,
:data:`EXIT_UNEXPECTED_BACKEND` (3) when ``--expect-backend`` names a backend that was not selected, and
:data:`EXIT_DEVIATES` (4) when the first run's step-1 gradients are further from the unfused
reference than :func:`deviation_tolerance` allows (reproducibly wrong is not a pass).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from dataclasses import dataclass, field, fields
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from transformer_engine.common import settings
from transformer_engine.common.attention.backends import BACKENDS, NoBackendError

__all__ = [
    "what_is_checked",
    "EXIT_PASS",
    "EXIT_NOT_DETERMINISTIC",
    "EXIT_BAD_ARGUMENTS",
    "EXIT_UNEXPECTED_BACKEND",
    "EXIT_DEVIATES",
    "deviation_tolerance",
    "BACKEND_NAMES",
    "DTYPES",
    "GPU_DEFAULTS",
    "CPU_DEFAULTS",
    "RunResult",
    "CheckResult",
    "Progress",
    "environment",
    "digest",
    "max_abs_diff",
    "first_difference",
    "deviation_from",
    "verdict",
    "check_result",
    "header",
    "format_report",
    "write_json",
    "build_parser",
    "apply_defaults",
    "check_environment",
    "main",
]

#: The runs are bitwise identical, or they differ and determinism was not requested.
EXIT_PASS = 0
#: Determinism was requested and the runs differ.
EXIT_NOT_DETERMINISTIC = 1
#: Bad arguments (argparse's own status too), or a configuration no backend can run.
EXIT_BAD_ARGUMENTS = 2
#: ``--expect-backend`` names a backend that not every attention call used.
EXIT_UNEXPECTED_BACKEND = 3
#: The first run's step-1 gradients deviate from the unfused reference beyond the tolerance.
EXIT_DEVIATES = 4

# The tolerance on max |grad - unfused| at step 1: OWN_ERROR_FACTOR times the framework's own
# low-precision error there (its unfused run in the check's dtype against an unfused fp32 run), and
# never below RTOL_FLOOR[dtype] times the largest reference gradient (fp32 has no own error to measure).
OWN_ERROR_FACTOR = 10.0
RTOL_FLOOR = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}

# ``--expect-backend`` values and the backend names the report prints.
BACKEND_NAMES = {b.SHORT_NAME: b.NAME for b in BACKENDS}
DTYPES = ("float32", "float16", "bfloat16")

# Defaults by where the attention runs; a frontend may adjust them (the Triton interpreter, say).
GPU_DEFAULTS = dict(batch_size=4, seq_len=1024, hidden_size=512, num_heads=8, gqa_groups=2, layers=4, steps=10,
                    dtype="bfloat16")
CPU_DEFAULTS = dict(batch_size=2, seq_len=64, hidden_size=64, num_heads=4, gqa_groups=2, layers=2, steps=5,
                    dtype="float32")
_SIZES = ("steps", "seq_len", "batch_size", "hidden_size", "num_heads", "gqa_groups", "layers")


# -- one training run ------------------------------------------------------------------------------


@dataclass
class RunResult:
    """What one training run leaves behind, in plain Python values and numpy arrays."""

    label: str
    losses: List[float] = field(default_factory=list)
    loss_bits: List[str] = field(default_factory=list)  # per step: sha256 of the loss
    grad_digests: List[Dict[str, str]] = field(default_factory=list)  # per step: parameter name -> sha256
    first_grads: Dict[str, np.ndarray] = field(default_factory=dict)  # step 1
    last_grads: Dict[str, np.ndarray] = field(default_factory=dict)  # last step
    params: Dict[str, np.ndarray] = field(default_factory=dict)  # after the last step
    param_digests: Dict[str, str] = field(default_factory=dict)
    backends: List[str] = field(default_factory=list)  # attention backends selected, in first-seen order
    step_seconds: List[float] = field(default_factory=list)

    def add_backends(self, names: Iterable[str]) -> None:
        """Record the attention backends seen, each once."""
        for name in names:
            if name not in self.backends:
                self.backends.append(name)

    @property
    def time_per_step_ms(self) -> float:
        """Median step time; the first step (compilation, warm-up) is left out when there are others."""
        times = sorted(self.step_seconds[1:] if len(self.step_seconds) > 1 else self.step_seconds)
        if not times:
            return float("nan")
        mid = len(times) // 2
        return 1e3 * (times[mid] if len(times) % 2 else 0.5 * (times[mid - 1] + times[mid]))


def digest(array) -> str:
    """sha256 of an array's bytes in C order: two arrays of one dtype and shape are bitwise equal
    exactly when their digests are. A frontend passes a numpy array (or anything ``np.asarray``
    takes), viewed as bytes first where numpy lacks the dtype (bfloat16)."""
    return hashlib.sha256(np.ascontiguousarray(np.asarray(array)).tobytes()).hexdigest()


class Progress:
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


# -- comparison and verdict ------------------------------------------------------------------------


def first_difference(a: RunResult, b: RunResult) -> Optional[str]:
    """The first loss, gradient (by step) or final parameter in which run ``b`` differs from ``a``."""
    for step, (la, lb) in enumerate(zip(a.loss_bits, b.loss_bits), 1):
        if la != lb:
            return f"loss at step {step} ({a.losses[step - 1]!r} vs {b.losses[step - 1]!r})"
        for name, value in a.grad_digests[step - 1].items():
            if b.grad_digests[step - 1].get(name) != value:
                return f"gradient of {name} at step {step}"
    for name, value in a.param_digests.items():
        if b.param_digests.get(name) != value:
            return f"parameter {name} after step {len(a.losses)}"
    return None


def max_abs_diff(x: Mapping[str, np.ndarray], y: Mapping[str, np.ndarray]) -> float:
    """Largest ``|x[name] - y[name]|`` over all names and elements, in float64 (0 for no elements)."""
    return max((float(np.max(np.abs(np.asarray(x[n], np.float64) - np.asarray(y[n], np.float64))))
                for n in x if np.size(x[n])), default=0.0)


def deviation_from(run: RunResult, reference: RunResult) -> Dict[str, float]:
    """How far ``run`` is from ``reference``: losses, gradients at the first and last step, parameters."""
    return {
        "loss": max(abs(a - b) for a, b in zip(run.losses, reference.losses)),
        "grad_first_step": max_abs_diff(run.first_grads, reference.first_grads),
        "grad_last_step": max_abs_diff(run.last_grads, reference.last_grads),
        "param": max_abs_diff(run.params, reference.params),
    }


def max_abs(x: Mapping[str, np.ndarray]) -> float:
    return max((float(np.max(np.abs(np.asarray(v, np.float64)))) for v in x.values() if np.size(v)), default=0.0)


def deviation_tolerance(dtype: str, reference: RunResult, reference_fp32: Optional[RunResult]) -> Dict[str, float]:
    """The bound on the largest step-1 gradient difference from the unfused run, and what it is made
    of: ``own_error`` (the largest difference between the unfused gradients in ``dtype`` and in fp32
    at step 1; 0 without an fp32 run) times :data:`OWN_ERROR_FACTOR`, at least :data:`RTOL_FLOOR`
    times the largest reference gradient."""
    own = max_abs_diff(reference.first_grads, reference_fp32.first_grads) if reference_fp32 is not None else 0.0
    floor = RTOL_FLOOR[dtype] * max_abs(reference.first_grads)
    return {"grad_first_step": max(OWN_ERROR_FACTOR * own, floor), "own_error": own, "floor": floor}


@dataclass
class CheckResult:
    """The outcome of a check: what :func:`format_report` prints and :meth:`to_json` writes."""

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
    tolerance: Dict[str, float]
    time_per_step_ms: Dict[str, float]
    model: Dict[str, object]
    extra: Dict[str, object] = field(default_factory=dict)  # a frontend's own keys, in the JSON after "model"
    exit_status: int = EXIT_PASS
    message: str = ""
    framework: Optional[str] = None  # the JSON's last key, "framework", when set

    @property
    def bitwise_identical(self) -> bool:
        return self.losses_equal and self.grads_equal and self.params_equal

    def to_json(self) -> Dict[str, object]:
        out: Dict[str, object] = {}
        for f in fields(self):
            if f.name == "extra":
                out.update(self.extra)
            elif f.name != "framework":
                out[f.name] = getattr(self, f.name)
        out["bitwise_identical"] = self.bitwise_identical
        if self.framework is not None:
            out["framework"] = self.framework
        return out


def verdict(result: CheckResult, expect_backend: Optional[str] = None) -> Tuple[int, str]:
    """The exit status and the RESULT line(s) for ``result``; ``expect_backend`` is a key of
    :data:`BACKEND_NAMES` that every attention call must have used (``--expect-backend``)."""
    status = EXIT_PASS
    if result.bitwise_identical:
        message = "RESULT: PASS: the two runs are bitwise identical"
    elif result.deterministic_requested:
        status = EXIT_NOT_DETERMINISTIC
        message = f"RESULT: FAIL: determinism was requested but the runs differ (first: {result.first_mismatch})"
    else:
        message = "RESULT: the runs differ (allowed: determinism was not requested)"
    dev, tol = result.max_deviation.get("grad_first_step"), result.tolerance.get("grad_first_step")
    if dev is not None and tol is not None and not dev <= tol:  # NaN deviates too
        status = status or EXIT_DEVIATES
        message += (f"\nRESULT: FAIL: max |grad - unfused| at step 1 is {_fmt(dev)}, above the tolerance {_fmt(tol)} "
                    f"({OWN_ERROR_FACTOR:g} x the unfused {result.dtype} error {_fmt(tol_own(result))}, at least "
                    f"{RTOL_FLOOR[result.dtype]:g} x max |grad|)")
    if expect_backend is not None:
        want = BACKEND_NAMES[expect_backend]
        if result.backends != [want]:
            status = status or EXIT_UNEXPECTED_BACKEND
            message += f"\nRESULT: FAIL: expected every attention call on {want}, got {', '.join(result.backends)}"
    return status, message


def tol_own(result: CheckResult) -> float:
    return result.tolerance.get("own_error", 0.0)


def check_result(args: argparse.Namespace, run1: RunResult, run2: RunResult, reference: Optional[RunResult], *,
                 device: str, qkv_format: str, deterministic: bool, extra: Optional[Dict[str, object]] = None,
                 framework: Optional[str] = None, reference_fp32: Optional[RunResult] = None) -> CheckResult:
    """Compare ``run1`` with ``run2`` (bitwise) and with ``reference`` (the unfused run, if any) and
    judge: the :class:`CheckResult` for the options in ``args`` (see :func:`build_parser`).
    ``reference_fp32``: an unfused fp32 run of at least one step, which measures the framework's
    own low-precision error for :func:`deviation_tolerance`."""
    times = {"run 1": run1.time_per_step_ms, "run 2": run2.time_per_step_ms}
    if reference is not None:
        times["unfused"] = reference.time_per_step_ms
    result = CheckResult(
        device=device, dtype=args.dtype, deterministic_requested=deterministic, steps=args.steps,
        backends=sorted(set(run1.backends) | set(run2.backends)),
        reference_backends=reference.backends if reference is not None else [],
        losses_equal=run1.loss_bits == run2.loss_bits, grads_equal=run1.grad_digests == run2.grad_digests,
        params_equal=run1.param_digests == run2.param_digests, first_mismatch=first_difference(run1, run2),
        max_deviation=deviation_from(run1, reference) if reference is not None else {},
        tolerance=deviation_tolerance(args.dtype, reference, reference_fp32) if reference is not None else {},
        time_per_step_ms=times,
        model=dict(layers=args.layers, hidden_size=args.hidden_size, num_heads=args.num_heads,
                   gqa_groups=args.gqa_groups, seq_len=args.seq_len, batch_size=args.batch_size,
                   qkv_format=qkv_format, window=args.window, num_tensors=len(run1.params)),
        extra=dict(extra or {}), framework=framework,
    )
    result.exit_status, result.message = verdict(result, args.expect_backend)
    return result


# -- report ----------------------------------------------------------------------------------------


def header(title: str, args: argparse.Namespace, *, head_dim: int, qkv_format: str, device: str,
           deterministic: bool, how: Sequence[str]) -> str:
    """The lines printed before the runs: what is trained, on what, and how determinism is requested."""
    mode = f"requested ({', '.join(how)})" if deterministic else "not requested"
    return (
        f"{title}: {args.steps} steps x 2 runs{'' if args.no_reference else ' + unfused reference'}\n"
        f"  model: {args.layers} layers, hidden {args.hidden_size}, {args.num_heads} heads / {args.gqa_groups} "
        f"kv heads (d={head_dim}), causal{'' if args.window < 0 else f' window {args.window}'}, {qkv_format}\n"
        f"  data: batch {args.batch_size} x seq {args.seq_len}, {args.dtype} on {device}, seed {args.seed}\n"
        f"  determinism: {mode}\n"
    )


def _fmt(x: Optional[float]) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return "0" if x == 0 else f"{x:.3e}"


def format_report(result: CheckResult) -> str:
    """The result table and the RESULT line(s), as printed after the runs."""
    yes = {True: "yes", False: "NO"}
    tensors = result.model["num_tensors"]
    rows = [
        ("attention backend", ", ".join(result.backends)),
        ("reference backend", ", ".join(result.reference_backends) or "(skipped)"),
        ("losses bitwise equal", f"{yes[result.losses_equal]} ({result.steps} steps)"),
        ("gradients bitwise equal", f"{yes[result.grads_equal]} (every step, {tensors} tensors)"),
        ("parameters bitwise equal", f"{yes[result.params_equal]} ({tensors} tensors)"),
    ]
    if result.first_mismatch:
        rows.append(("first difference", result.first_mismatch))
    dev = result.max_deviation
    if dev:
        rows += [
            ("max |loss - unfused|", _fmt(dev.get("loss"))),
            ("max |grad - unfused| step 1", f"{_fmt(dev.get('grad_first_step'))} "
                                             f"(tolerance {_fmt(result.tolerance.get('grad_first_step'))})"),
            (f"max |grad - unfused| step {result.steps}", _fmt(dev.get("grad_last_step"))),
            ("max |param - unfused|", _fmt(dev.get("param"))),
        ]
    rows.append(("time per step", ", ".join(f"{k} {v:.1f} ms" for k, v in result.time_per_step_ms.items())))
    width = max(len(key) for key, _ in rows)
    rule = "-" * (width + 40) + "\n"
    return "\n" + rule + "".join(f"  {key:<{width}}  {value}\n" for key, value in rows) + rule + result.message + "\n"


def write_json(result: CheckResult, path: str) -> None:
    """Write ``result`` as JSON to ``path`` (``-``: standard output)."""
    text = json.dumps(result.to_json(), indent=2) + "\n"
    if path == "-":
        sys.stdout.write(text)
    else:
        with open(path, "w") as f:
            f.write(text)


# -- command line ----------------------------------------------------------------------------------

Option = Tuple[str, Dict[str, object]]  # a flag and add_argument's keyword arguments


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default, except where there is none to show (unset sizes, whose
    defaults depend on the device and the help states; off switches)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in help_text or "default:" in help_text:
            return help_text
        return super()._get_help_string(action)


def _sizes_help(key: str, defaults: Mapping[str, Mapping[str, object]]) -> str:
    """Where each default of ``key`` applies, e.g. "default: 10 on a GPU, 5 on CPU, 3 with --fused-interpreter"
    (one value for all: "default: 2")."""
    places: Dict[object, List[str]] = {}  # value -> where it applies, in the order of ``defaults``
    for where, d in defaults.items():
        if key in d:
            places.setdefault(d[key], []).append(where)
    if len(places) <= 1:
        return "".join(f"default: {value}" for value in places)
    return "default: " + ", ".join(f"{value} {' and '.join(where)}" for value, where in places.items())


def build_parser(prog: str, description: str, *, device_help: str, nondeterministic_help: str,
                 expect_backends: Sequence[str], shape_options: Sequence[Option] = (),
                 determinism_options: Sequence[Option] = (),
                 defaults: Optional[Mapping[str, Mapping[str, object]]] = None) -> argparse.ArgumentParser:
    """The options both checks take, in the order ``--help`` lists them; a frontend's own options
    go after the model's sizes (``shape_options``) and after ``--nondeterministic``
    (``determinism_options``). ``expect_backends`` are the keys of :data:`BACKEND_NAMES` the
    frontend can run. ``defaults``: where each set of defaults applies (e.g. ``"on CPU"``) to the
    defaults :func:`apply_defaults` fills in there, for ``--help``.

    Options are never abbreviated (``allow_abbrev=False``): a frontend acts on some options before
    the check runs (``--fused-interpreter`` starts a child process), and a prefix must not be taken
    by the parser and missed there."""
    defaults = {"on a GPU": GPU_DEFAULTS, "on CPU": CPU_DEFAULTS} if defaults is None else defaults

    def sized(key: str, text: str = "") -> str:
        return "; ".join(t for t in (text, _sizes_help(key, defaults)) if t)

    p = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False,
                                formatter_class=_HelpFormatter)
    p.add_argument("--steps", type=int, help=sized("steps", "training steps per run"))
    p.add_argument("--seq-len", type=int, help=sized("seq_len", "tokens per sequence"))
    p.add_argument("--batch-size", type=int, help=sized("batch_size"))
    p.add_argument("--hidden-size", type=int, help=sized("hidden_size"))
    p.add_argument("--num-heads", type=int, help=sized("num_heads", "query heads"))
    p.add_argument("--gqa-groups", type=int,
                   help=sized("gqa_groups", "key/value heads (GQA); equal to --num-heads for MHA"))
    p.add_argument("--layers", type=int, help=sized("layers"))
    for flag, kwargs in shape_options:
        p.add_argument(flag, **kwargs)
    p.add_argument("--window", type=int, default=-1, help="sliding-window left size (-1: plain causal)")
    p.add_argument("--dtype", choices=("auto",) + DTYPES, default="auto",
                   help="auto: " + _sizes_help("dtype", defaults)[len("default: "):])
    p.add_argument("--device", default="auto", help=device_help)
    p.add_argument("--seed", type=int, default=1234, help="model and data seed")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--nondeterministic", action="store_true", help=nondeterministic_help)
    for flag, kwargs in determinism_options:
        p.add_argument(flag, **kwargs)
    p.add_argument("--no-reference", action="store_true", help="skip the run with the unfused backend forced")
    p.add_argument("--expect-backend", choices=tuple(expect_backends),
                   help="exit 3 unless every attention call used this backend")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-' for stdout)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    return p


def apply_defaults(args: argparse.Namespace, defaults: Mapping[str, object]) -> None:
    """Fill the options left unset (and ``--dtype auto``) from ``defaults``; sizes must be >= 1."""
    for key, value in defaults.items():
        if getattr(args, key, None) is None or (key == "dtype" and args.dtype == "auto"):
            setattr(args, key, value)
    for key in _SIZES:
        if getattr(args, key) < 1:
            raise ValueError(f"`--{key.replace('_', '-')}` must be >= 1, got {getattr(args, key)}")


def check_environment() -> None:
    """Every declared ``NVTE_*`` variable that is set must parse: the check sets some of them for its runs
    (``NVTE_ALLOW_NONDETERMINISTIC_ALGO``, ``NVTE_FUSED_ATTN_BACKEND`` for the reference), and a malformed
    value must be refused by name, as the library refuses it, not replaced unseen. Raises ``ValueError``."""
    for name in settings.declared_names():
        settings.get(name)


def main(parser: argparse.ArgumentParser, run_check: Callable[[argparse.Namespace], CheckResult],
         argv: Optional[Sequence[str]] = None,
         rerun: Optional[Callable[[argparse.Namespace], Optional[int]]] = None) -> int:
    """Parse ``argv`` once, run the check, print the report (and the JSON): the exit status.
    ``rerun``: a frontend's hook, given the parsed options after :func:`check_environment`; when it
    returns a status the check ran elsewhere (a child process) and that status is returned.
    A ``ValueError`` or :class:`NoBackendError` is reported in one line, status 2."""
    args = parser.parse_args(argv)
    try:
        check_environment()
        if rerun is not None:
            status = rerun(args)
            if status is not None:
                return status
        result = run_check(args)
    except (ValueError, NoBackendError) as error:
        sys.stderr.write(f"determinism_check: error: {error}\n")
        return EXIT_BAD_ARGUMENTS
    sys.stdout.write(format_report(result))
    sys.stdout.flush()
    if args.json:
        write_json(result, args.json)
    return result.exit_status


def what_is_checked(backends, on_cpu: bool, interpret: bool, math: str) -> str:
    """One line that says which attention code a check's runs exercised (``math``: what the unfused backend
    computes with, e.g. "PyTorch math"); empty when the backends say it already."""
    if list(backends) == [BACKEND_NAMES["unfused"]] and on_cpu:
        return (f"NOTE: on CPU every attention call ran UnfusedDotProductAttention ({math}), so this checked "
                "the training loop's reproducibility, not the fused Triton kernels. Add --fused-interpreter to run "
                "those on CPU under Triton's interpreter, or run on a GPU.")
    if BACKEND_NAMES["fused"] in backends and interpret:
        return ("NOTE: the fused Triton kernels ran under Triton's interpreter on CPU: same kernels and launch "
                "order as on a GPU, executed in Python; times are not GPU times.")
    return ""
