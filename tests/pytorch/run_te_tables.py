"""Run TransformerEngine's attention test tables through our DotProductAttention, each case isolated.

Cases (te_configs.py) go to worker processes (te_case.py --worker), a few at a time in parallel. A
case that kills its process (a CUDA illegal address poisons every later call of that process) or
runs past its time limit is recorded as crashed and the worker is replaced, so one fault cannot
hide the cases after it. Writes ``results.jsonl`` (one line per case) and ``summary.md`` (counts per
table: pass / fail / refused with a reason / error / crashed; the refused, failed and crashed cases
listed) to ``--out``; cases that ran out of GPU memory next to the other workers' run again alone.
Exits non-zero when any case failed, errored or crashed.

    python tests/pytorch/run_te_tables.py --out /tmp/te_tables [--tables base,mask] [--workers 6]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import te_configs  # noqa: E402
from te_case import RESULT_PREFIX  # noqa: E402

STATUSES = ("pass", "fail", "refused", "error", "crashed")


class Worker:
    """One te_case.py --worker process, replaced whenever it dies."""

    def __init__(self, index: int, out_dir: str, scale_down: bool) -> None:
        self.index, self.out_dir, self.scale_down = index, out_dir, scale_down
        self.proc: Optional[subprocess.Popen] = None
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self.log_path = os.path.join(out_dir, f"worker{index}.log")

    def _start(self) -> None:
        cmd = [sys.executable, os.path.join(HERE, "te_case.py"), "--worker"]
        if self.scale_down:
            cmd.append("--scale-down")
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                     bufsize=1)
        self.lines = queue.Queue()
        proc, lines = self.proc, self.lines

        def pump():
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def _log_tail(self) -> str:
        try:
            with open(self.log_path) as f:
                return " ".join(f.read()[-600:].split())
        except OSError:
            return ""

    def run(self, name: str, timeout: float) -> Dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                self.proc.kill()
                self.proc.wait()
                return dict(case=name, status="crashed", backend=None, detail=f"no result within {timeout:.0f} s")
            if line is None:  # the process died without a result line
                code = self.proc.wait()
                return dict(case=name, status="crashed", backend=None,
                            detail=f"worker exited with {code}: {self._log_tail()}")
            if line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX):])
                if result["status"] == "crashed":
                    self.proc.wait()
                return result

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def run_all(names: List[str], out_dir: str, workers: int, timeout: float, scale_down: bool,
            log_name: str = "results.jsonl") -> List[Dict]:
    todo: "queue.Queue[str]" = queue.Queue()
    for name in names:
        todo.put(name)
    results: List[Dict] = []
    lock = threading.Lock()
    sink = open(os.path.join(out_dir, log_name), "w")

    def serve(index: int) -> None:
        worker = Worker(index, out_dir, scale_down)
        while True:
            try:
                name = todo.get_nowait()
            except queue.Empty:
                break
            start = time.monotonic()
            result = worker.run(name, timeout)
            result["seconds"] = round(time.monotonic() - start, 1)
            with lock:
                results.append(result)
                sink.write(json.dumps(result) + "\n")
                sink.flush()
                print(f"[{len(results)}/{len(names)}] {result['status']:8s} {name} ({result.get('backend')})",
                      flush=True)
        worker.close()

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(max(1, workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sink.close()
    return results


def summarize(results: List[Dict], header: str) -> str:
    by_table: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    backends: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in results:
        table = r["case"].split("/")[0]
        by_table[table][r["status"]] += 1
        if r["status"] == "pass":
            backends[table][r.get("backend") or "?"] += 1
    lines = [header, "", "| table | " + " | ".join(STATUSES) + " | backends of passing cases |",
             "|---|" + "---|" * (len(STATUSES) + 1)]
    total = collections.Counter()
    for table in sorted(by_table):
        total.update(by_table[table])
        ran = ", ".join(f"{b} {n}" for b, n in sorted(backends[table].items()))
        lines.append(f"| {table} | " + " | ".join(str(by_table[table][s]) for s in STATUSES) + f" | {ran} |")
    lines.append("| **all** | " + " | ".join(f"**{total[s]}**" for s in STATUSES) + " | |")
    for status in ("crashed", "fail", "error", "refused"):
        listed = sorted((r for r in results if r["status"] == status), key=lambda r: r["case"])
        if listed:
            lines += ["", f"## {status} ({len(listed)})", ""]
            lines += [f"- `{r['case']}`: {r['detail']}" for r in listed]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for results.jsonl, summary.md and worker logs")
    ap.add_argument("--tables", help="comma-separated table names (default: all)")
    ap.add_argument("--cases", help="comma-separated case names (default: every case of the tables)")
    ap.add_argument("--workers", type=int, default=int(os.environ.get("TE_TABLES_WORKERS", "6")))
    ap.add_argument("--timeout", type=float, default=float(os.environ.get("TE_TABLES_CASE_TIMEOUT", "300")),
                    help="seconds one case may take before its worker is killed")
    ap.add_argument("--scale-down", action="store_true", help="tiny shapes (CPU, Triton's interpreter)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    tables = args.tables.split(",") if args.tables else None
    names = [c.name for c in te_configs.cases(tables)]
    if args.cases:
        wanted = args.cases.split(",")
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            ap.error(f"unknown cases: {unknown}")
        names = wanted
    start = time.time()
    results = run_all(names, args.out, args.workers, args.timeout, args.scale_down)
    # Cases that ran out of memory next to the other workers' cases run again, one at a time.
    retry = [r["case"] for r in results if r["status"] == "oom"]
    if retry:
        print(f"{len(retry)} cases ran out of memory beside others: again, one at a time", flush=True)
        again = {r["case"]: r for r in run_all(retry, args.out, 1, args.timeout, args.scale_down, "results_retry.jsonl")}
        results = [again.get(r["case"], r) for r in results]
        for r in results:
            if r["status"] == "oom":
                r["status"] = "crashed"
    counts = collections.Counter(r["status"] for r in results)
    header = (f"# TransformerEngine attention tables through DotProductAttention\n\n"
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {len(results)} cases, "
              f"{time.time() - start:.0f} s, commit {os.environ.get('GIT_COMMIT', 'unknown')}, "
              f"command `python tests/pytorch/run_te_tables.py {' '.join(argv if argv is not None else sys.argv[1:])}`")
    text = summarize(results, header)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "results.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in results)
    print(text)
    bad = counts["fail"] + counts["error"] + counts["crashed"]
    print("te_tables: " + ", ".join(f"{counts[s]} {s}" for s in STATUSES))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
