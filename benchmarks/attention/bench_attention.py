"""Attention benchmark: our attention and every peer, side by side, in one run.

One command runs it all on the GPU machine (bf16, the standard grid of ``cases.py``)::

    python benchmarks/attention/bench_attention.py                 # all cases, all implementations
    python benchmarks/attention/bench_attention.py --part torch-std --out /tmp/out/attention_torch-std
    python benchmarks/attention/bench_attention.py --merge a.json b.json --out benchmarks/results/attention
    python benchmarks/attention/bench_attention.py --dry-run       # CPU smoke test, tiny shapes

For every (case, implementation): forward and forward+backward TFLOP/s (FlashAttention counting,
causal halved), peak memory, and whether gradients are bitwise equal over repeated runs. A
missing peer is skipped with its reason; a peer that fails (OOM, unsupported shape) is recorded
in its row. PyTorch implementations run in this process (``peers.py``); JAX ones in one
subprocess per XLA-flag setting (``jax_peers.py``). Writes ``<out>.json`` and ``<out>.md``
after every row (a killed run keeps what finished), evaluates the targets (``targets.py``) and
draws ``<out>.png`` (``plot.py``) at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

from cases import (ALL_IMPLS, DRY_GRID, GRID, JAX_IMPLS, KERNEL_TIME_IMPLS, OPTIONAL_IMPLS, PARTS, Case,  # noqa: E402
                   select_cases)
import targets as targets_mod  # noqa: E402
from common import run_metadata  # noqa: E402

DEFAULT_OUT = "benchmarks/results/attention"
DRY_OUT = os.path.join(tempfile.gettempdir(), "attention_dryrun", "attention")
JAX_DET = {"jax_te_det", "jax_cudnn_det"}


# ------------------------------------------------------------------------------------------------
# metadata and output
# ------------------------------------------------------------------------------------------------

def _fmt(x, digits=1):
    if x is None:
        return ""
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.{digits}f}" if abs(x) >= 0.1 or x == 0 else f"{x:.3g}"
    return str(x)


def render_markdown(title: str, metas: list, cases: list, rows: list, target_results: list) -> str:
    meta = metas[0]
    lines = [f"# {title}", ""]
    if any(m.get("dry_run") for m in metas):
        lines += ["**Dry run (CPU, tiny shapes): a smoke test of the harness, not a measurement.**", ""]
    for m in metas:
        lines.append(f"- {m.get('part', 'run')}: {m['date']}, commit {m['commit']}, device {m['device']}, "
                     f"{m.get('dtype', '')}; command `{m['command']}`")
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), "",
              "TFLOP/s count FlashAttention's way (forward 2*b*h*s^2*(d_qk+d_v), halved when causal; "
              "fwd+bwd 3.5x forward). Peak memory: PyTorch, bytes allocated above the inputs during one "
              "fwd+bwd; JAX, XLA's temp + output buffers of the compiled fwd+bwd. Bitwise: gradients equal "
              "over repeated runs.", "",
              "## Targets", ""]
    lines += targets_mod.markdown(target_results, cases)
    lines += ["", "## Results", ""]
    by_case = {}
    for r in rows:
        by_case.setdefault(r["case"], []).append(r)
    for c in cases:
        if c["name"] not in by_case:
            continue
        lines += [f"### {c['label']}", "",
                  "| implementation | fwd TFLOP/s | fwd+bwd TFLOP/s | peak GB | bitwise | ran | notes |",
                  "|---|---|---|---|---|---|---|"]
        for r in by_case[c["name"]]:
            if r["status"] == "ok":
                notes = "; ".join(r.get("notes", []))
                lines.append(f"| {r['label']} (`{r['impl']}`) | {_fmt(r.get('fwd_tflops'))} | "
                             f"{_fmt(r.get('fwd_bwd_tflops'))} | {_fmt(r.get('peak_gb'), 2)} | "
                             f"{_fmt(r.get('bitwise'))} | {r.get('backend') or ''} | {notes} |")
            else:
                lines.append(f"| {r['label']} (`{r['impl']}`) | | | | | {r['status']} | {r.get('reason', '')} |")
        lines.append("")
    return "\n".join(lines) + "\n"


class Results:
    """Rows so far; rewrites <stem>.json and <stem>.md after each row."""

    def __init__(self, stem: str, metas: list, cases: list, title: str):
        self.stem, self.metas, self.cases, self.title = stem, metas, cases, title
        self.rows = []
        os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)

    def add(self, row: dict):
        row.setdefault("run", self.metas[0]["date"])
        self.rows.append(row)
        self.write()

    def write(self):
        results = targets_mod.evaluate(self.rows, self.cases)
        doc = {"meta": self.metas[0] if len(self.metas) == 1 else {"parts": self.metas}, "parts": self.metas,
               "cases": self.cases, "rows": self.rows, "targets": results}
        with open(self.stem + ".json.tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(self.stem + ".json.tmp", self.stem + ".json")
        with open(self.stem + ".md", "w") as f:
            f.write(render_markdown(self.title, self.metas, self.cases, self.rows, results))
        return results

    def finish(self, plot: bool):
        results = self.write()
        print("\n".join(targets_mod.markdown(results, self.cases)), flush=True)
        if plot:
            try:
                import plot as plot_mod
                msg = plot_mod.plot(self.rows, self.cases, self.stem + ".png", title=self.title)
            except Exception as err:  # the plot is a convenience; the tables are the result
                msg = f"plot failed: {type(err).__name__}: {err}"
            print(msg, flush=True)
        print(f"wrote {self.stem}.json, {self.stem}.md", flush=True)


def done_pairs(paths) -> set:
    """(case, impl) pairs already measured in earlier result files: ok or failed. Skipped ones
    (time budget, a peer missing on that machine) are tried again: a skip costs nothing."""
    done = set()
    for p in paths or []:
        with open(p) as f:
            for r in json.load(f)["rows"]:
                if r.get("status") in ("ok", "error"):
                    done.add((r["case"], r["impl"]))
    return done


# ------------------------------------------------------------------------------------------------
# PyTorch measurements
# ------------------------------------------------------------------------------------------------

def _bits_equal(a, b) -> bool:
    import torch
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _sig(x: float, digits: int = 4) -> float:
    """Rounded to significant digits (CPU dry-run numbers are tiny, GPU ones are not)."""
    return float(f"{x:.{digits}g}")


def _cpu_ms(fn, reps: int = 1) -> float:
    """Dry run: wall-clock ms of already-compiled calls (the interpreter makes each call slow)."""
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _error_text(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
    name = type(err).__name__
    if name == "OutOfMemoryError" or "out of memory" in str(err).lower():
        return f"OOM: {name}: {text}"
    return f"{name}: {text}"


def _torch_row(impl: str, case: Case, status: str) -> dict:
    from peers import TORCH_PEERS

    spec = TORCH_PEERS[impl]
    return {"case": case.name, "group": case.group, "impl": impl, "label": spec.label, "role": spec.role,
            "framework": "torch", "deterministic": spec.deterministic, "status": status}


def measure_torch(impl: str, case: Case, inp, args, cuda: bool) -> dict:
    import torch
    from common import bench_ms, peak_memory_gb
    from peers import TORCH_PEERS, PeerFailure

    spec = TORCH_PEERS[impl]
    row = _torch_row(impl, case, "ok")
    started = time.perf_counter()
    runner = None
    try:
        runner = spec.factory(case, inp)
        if isinstance(runner, str):
            row.update(status="skipped", reason=runner)
            return row
        with runner.context():
            leaves = list(runner.leaves)

            def clear():
                for t in leaves:
                    t.grad = None

            def step():
                runner.fwd().backward(runner.grad_out)

            clear()
            step()  # compiles, and fails early for an unsupported shape
            if cuda:
                torch.cuda.synchronize()
                with torch.no_grad():
                    t_fwd = bench_ms(runner.fwd, warmup=args.warmup_ms, rep=args.rep_ms)
                t_all = bench_ms(step, grad_to_none=leaves, warmup=args.warmup_ms, rep=args.rep_ms)
                clear()
                row["peak_gb"] = round(peak_memory_gb(step), 3)
            else:
                with torch.no_grad():
                    t_fwd = _cpu_ms(runner.fwd)
                t_all = _cpu_ms(lambda: (clear(), step()))
            row.update(fwd_ms=_sig(t_fwd), fwd_bwd_ms=_sig(t_all), fwd_tflops=_sig(case.flops("fwd") / t_fwd / 1e9),
                       fwd_bwd_tflops=_sig(case.flops("fwd_bwd") / t_all / 1e9))

            def grads():
                clear()
                step()
                return [None if t.grad is None else t.grad.detach().clone() for t in leaves]

            first = grads()
            same = True
            for _ in range(args.repeats - 1):
                again = grads()
                same = same and all(_bits_equal(a, b) for a, b in zip(first, again))
            row["bitwise"] = bool(same)
            clear()
        if runner.backend is not None:
            row["backend"] = runner.backend()
        if runner.notes:
            row["notes"] = list(runner.notes)
    except PeerFailure as err:
        row.update(status="error", reason=str(err))
    except Exception as err:  # a peer that cannot run this case is recorded, not fatal
        row.update(status="error", reason=_error_text(err))
        traceback.print_exc(limit=3)
    finally:
        row["time_s"] = round(time.perf_counter() - started, 1)
        runner = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return row


def run_torch(cases, impls, args, results: Results, deadline: float, device: str, done=frozenset()):
    import torch
    from peers import make_inputs

    cuda = device == "cuda"
    dtype = getattr(torch, args.dtype)
    torch.use_deterministic_algorithms(False)
    for case in cases:
        inp = None
        for impl in impls:
            if (case.name, impl) in done:
                continue
            if time.time() > deadline:
                row = _skipped(case, impl, "time budget of this run spent (run this case again)")
            else:
                if inp is None:
                    inp = make_inputs(case, torch.device(device), dtype)
                with _pending(args.pending, case, impl):
                    row = measure_torch(impl, case, inp, args, cuda)
            _log(row)
            results.add(row)
        inp = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


@contextlib.contextmanager
def _pending(path: str, case: Case, impl: str):
    """Marks the row being measured in <out>.pending while it runs. A fault in a peer's kernel (a
    CUDA illegal address) poisons this process; the next run with the same --out finds the mark,
    records that row as an error and measures the rest in a fresh process."""
    with open(path, "w") as f:
        json.dump({"case": case.name, "impl": impl}, f)
    yield
    os.remove(path)


def _died_in(path: str, cases, results, done: set) -> None:
    """The row a previous run died in (its <out>.pending mark): recorded as an error, not run again."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        pair = json.load(f)
    os.remove(path)
    case = next((c for c in cases if c.name == pair["case"]), None)
    if case is None:
        return
    row = _torch_row(pair["impl"], case, "error")  # only run_torch marks rows
    row["reason"] = ("the process died during this row (a fault in this implementation poisons the process: "
                     "see the run's log); the rows after it ran in a fresh process")
    _log(row)
    results.add(row)
    done.add((case.name, pair["impl"]))


def _skipped(case: Case, impl: str, reason: str) -> dict:
    return {"case": case.name, "group": case.group, "impl": impl, "label": impl, "role": "",
            "framework": "jax" if impl.startswith("jax_") else "torch", "status": "skipped", "reason": reason}


def _log(row):
    keep = {k: v for k, v in row.items() if k not in ("case", "impl", "label", "group", "framework", "role")}
    print(f"[{row['case']}] {row['impl']}: {json.dumps(keep)}", flush=True)


# ------------------------------------------------------------------------------------------------
# JAX subprocesses
# ------------------------------------------------------------------------------------------------

def _xla_env(det: bool) -> dict:
    """This process's environment for a JAX subprocess: XLA's determinism flag set or cleared."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_gpu_deterministic_ops" not in f]
    if det:
        flags.append("--xla_gpu_deterministic_ops=true")
    env["XLA_FLAGS"] = " ".join(flags)
    env.pop("NVTE_ALLOW_NONDETERMINISTIC_ALGO", None)  # determinism comes from the XLA flag alone
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with this process
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _subprocess_rows(script: str, extra: list, det: bool, deadline: float, label: str):
    """({(case, impl): row} measured by ``script`` (jax_peers.py, kernel_time.py) with ``--json-out``, and why
    a missing row is missing)."""
    remaining = deadline - time.time()
    if remaining < 20:
        return {}, f"time budget of this run spent before the {label} subprocess"
    fd, out = tempfile.mkstemp(suffix=".json", prefix=label.replace(" ", "_") + "_")
    os.close(fd)
    os.remove(out)
    env = _xla_env(det)
    cmd = [sys.executable, str(HERE / script), *extra, "--json-out", out]
    print(f"[{label}] XLA_FLAGS={env['XLA_FLAGS']!r}: {' '.join(cmd)}", flush=True)
    try:
        rc = subprocess.run(cmd, env=env, timeout=remaining).returncode
        reason = f"{label} subprocess exited with {rc} before this row"
    except subprocess.TimeoutExpired:
        reason = f"time budget spent: the {label} subprocess was stopped before this row"
    measured = {}
    if os.path.exists(out):
        with open(out) as f:
            for r in json.load(f)["rows"]:
                measured[(r["case"], r["impl"])] = r
        os.remove(out)
    return measured, reason


def _add_measured(todo, group, measured, reason, labels, results: Results, done):
    for case in todo:
        for impl in group:
            if (case.name, impl) in done:
                continue
            row = measured.get((case.name, impl))
            if row is None:
                row = _skipped(case, impl, reason)
                row["label"] = labels.get(impl, impl)
                row["status"] = "error" if "exited" in reason else "skipped"
            results.add(row)


def run_jax(cases, impls, args, results: Results, deadline: float, done=frozenset()):
    labels = {}
    try:
        from jax_peers import JAX_SPECS
        labels = {k: v[0] for k, v in JAX_SPECS.items()}
    except Exception:
        pass
    for det in (False, True):
        group = [i for i in impls if (i in JAX_DET) == det]
        todo = [c for c in cases if any((c.name, i) not in done for i in group)]
        group = [i for i in group if any((c.name, i) not in done for c in todo)]
        if not group or not todo:
            continue
        extra = ["--impls", ",".join(group), "--cases", ",".join(c.name for c in todo), "--dtype", args.dtype,
                 "--rep-ms", str(args.rep_ms), "--repeats", str(args.repeats)]
        if args.dry_run:
            extra[extra.index("--dtype") + 1] = "float32"  # XLA:CPU has no fp16/bf16 dot with f32 accumulation
            extra.append("--dry-run")
        measured, reason = _subprocess_rows("jax_peers.py", extra, det, deadline, "jax")
        _add_measured(todo, group, measured, reason, labels, results, done)


def run_kernel_time(cases, impls, args, results: Results, deadline: float, done=frozenset()):
    """The kernel-time pair (kernel_time.py): both rows of a case come from one subprocess, so a case
    is measured again unless both are done."""
    todo = [c for c in cases if any((c.name, i) not in done for i in impls)]
    if not todo:
        return
    extra = ["--cases", ",".join(c.name for c in todo)] + (["--dry-run"] if args.dry_run else [])
    measured, reason = _subprocess_rows("kernel_time.py", extra, True, deadline, "kernel time")
    from kernel_time import LABELS
    _add_measured(todo, impls, measured, reason, LABELS, results, frozenset())


# ------------------------------------------------------------------------------------------------
# merge
# ------------------------------------------------------------------------------------------------

def merge(paths, stem, plot, command):
    metas, rows, cases = [], [], {}
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        parts = doc.get("parts") or [doc["meta"]]
        metas.extend(m for m in parts if m.get("part") != "merge")  # earlier merges: their parts are here
        for c in doc.get("cases", []):
            cases.setdefault(c["name"], c)
        rows.extend(doc["rows"])  # later files replace earlier rows of the same (case, impl)
    dry = any(m.get("dry_run") for m in metas)
    grid = DRY_GRID if dry else GRID
    order = [c.name for c in grid]
    case_list = sorted(cases.values(), key=lambda c: order.index(c["name"]) if c["name"] in order else 99)
    latest = {}
    for r in rows:
        latest[(r["case"], r["impl"])] = r
    impl_order = list(ALL_IMPLS) + list(OPTIONAL_IMPLS)
    merged = sorted(latest.values(), key=lambda r: (order.index(r["case"]) if r["case"] in order else 99,
                                                    impl_order.index(r["impl"]) if r["impl"] in impl_order else 99))
    metas = metas + [{"part": "merge", **run_metadata(command, "-", metas[0].get("dtype", ""), dry)}]
    res = Results(stem, metas, case_list, "Attention benchmark" + (" (dry run)" if dry else ""))
    res.rows = merged
    res.finish(plot)


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Attention benchmark: ours and every peer, one run.")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU smoke test: tiny shapes, Triton interpreter, GPU-only peers skipped with reasons")
    ap.add_argument("--part", default="all", choices=sorted(PARTS),
                    help="named subset, for a run in parts: " + "; ".join(
                        f"{k} = groups {','.join(v[0])}" for k, v in PARTS.items()))
    ap.add_argument("--cases", default="", help="case names or groups (comma list); overrides --part's cases")
    ap.add_argument("--impls", default="", help="implementations (comma list); overrides --part's. Known: "
                    + ",".join(ALL_IMPLS + OPTIONAL_IMPLS))
    ap.add_argument("--out", default=None, help=f"output stem (default {DEFAULT_OUT}; dry run {DRY_OUT})")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="combine result files (later ones win) and stop")
    ap.add_argument("--skip-done", nargs="*", default=[], metavar="JSON",
                    help="result files of earlier calls: (case, impl) pairs they measured (ok or failed) are "
                         "not run again")
    ap.add_argument("--time-budget", type=float, default=0,
                    help="seconds; rows not started by then are recorded as skipped (0: no limit)")
    ap.add_argument("--warmup-ms", type=float, default=25)
    ap.add_argument("--rep-ms", type=float, default=100)
    ap.add_argument("--repeats", type=int, default=3, help="fwd+bwd runs compared bitwise")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default) or float16 (dry-run default)")
    ap.add_argument("--no-plot", action="store_true")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    command = "python benchmarks/attention/bench_attention.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.merge:
        merge(args.merge, args.out or DEFAULT_OUT, not args.no_plot, command)
        return 0
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is defined
        args.dtype = args.dtype or "float16"  # the interpreter's bf16 tl.dot is wrong; speed is not measured
        args.repeats = min(args.repeats, 2)
    args.dtype = args.dtype or "bfloat16"
    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    device = "cuda" if cuda else "cpu"
    if not cuda and not args.dry_run:
        print("no CUDA GPU: use --dry-run for the CPU smoke test", file=sys.stderr)
        return 2
    grid = DRY_GRID if args.dry_run else GRID
    groups, impls = PARTS[args.part]
    cases = select_cases(grid, args.cases.split(",") if args.cases else list(groups))
    impls = [i for i in (args.impls.split(",") if args.impls else impls) if i]
    unknown = [i for i in impls if i not in ALL_IMPLS + OPTIONAL_IMPLS]
    if unknown:
        print(f"unknown implementations {unknown}", file=sys.stderr)
        return 2
    stem = args.out or (DRY_OUT if args.dry_run else DEFAULT_OUT)
    dev_name = torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()})"
    meta = run_metadata(command, dev_name, args.dtype, args.dry_run)
    meta["part"] = args.part if not (args.cases or args.impls) else "custom"
    case_dicts = [dict(c.to_dict(), label=c.label, shape=c.shape, mask=c.mask) for c in cases]
    results = Results(stem, [meta], case_dicts, "Attention benchmark" + (" (dry run)" if args.dry_run else ""))
    deadline = time.time() + args.time_budget if args.time_budget > 0 else float("inf")
    torch_impls = [i for i in impls if i not in JAX_IMPLS and i not in KERNEL_TIME_IMPLS]
    jax_impls = [i for i in impls if i in JAX_IMPLS]
    kt_impls = [i for i in impls if i in KERNEL_TIME_IMPLS]
    print(f"{len(cases)} cases x {len(impls)} implementations on {dev_name}, {args.dtype}", flush=True)
    done = done_pairs(args.skip_done)
    if done:
        print(f"{len(done)} (case, implementation) pairs already measured in {args.skip_done}: not run again")
    args.pending = stem + ".pending"
    _died_in(args.pending, cases, results, done)
    if torch_impls:
        run_torch(cases, torch_impls, args, results, deadline, device, done)
    if jax_impls:
        if cuda:
            torch.cuda.empty_cache()
        run_jax(cases, jax_impls, args, results, deadline, done)
    if kt_impls:
        if cuda:
            torch.cuda.empty_cache()
        run_kernel_time(cases, kt_impls, args, results, deadline, done)
    results.finish(plot=not args.no_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
