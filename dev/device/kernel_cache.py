"""Triton's kernel cache for the GPU machine, built on this CPU machine, and the compile share of a GPU call.

A GPU call spends most of its time compiling kernel variants on the GPU machine's CPU unless Triton's cache
already holds them. Triton keys a cache entry by its own build (version, sources and libtriton), the kernel's
source, the specialisation, the options and the target, never by the machine: the same Triton wheel compiling
the same records on a CPU writes entries that the GPU machine's JIT and the JAX lowering then load. Records
come from dev/device/record/sitecustomize.py (TE_KERNEL_RECORD) on the GPU machine; ``sm90_kernels.jsonl.gz``
beside this file keeps the union of what the acceptance run compiled.

  python dev/device/kernel_cache.py merge RECORD_DIR...        # add a run's records to sm90_kernels.jsonl.gz
  python dev/device/kernel_cache.py build --cache DIR -j 2     # compile every record into DIR (run with the
                                                               # GPU machine's Triton wheel: same release, same
                                                               # Python, see triton_key)
  python dev/device/kernel_cache.py share RECORD_DIR --t0 T --t1 T   # compile share of a call
  python dev/device/kernel_cache.py prune --cache DIR           # keep each entry's metadata and cubin
  python dev/device/kernel_cache.py pack --cache DIR --out F    # DIR as one xz tar (absolute paths kept): the
                                                               # whole cache in one carry (acceptance.sh unpacks it)
  python dev/device/kernel_cache.py triton_key                 # the hash of this Triton build (must equal the
                                                               # GPU machine's for its cache to hit)

The cache must sit at the same absolute path on both machines (Triton's group files name their members by
absolute path); build prunes each entry to its metadata and cubin, which is all a launch loads.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import glob
import gzip
import hashlib
import importlib
import json
import os
import pickle
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RECORDS = os.path.join(HERE, "sm90_kernels.jsonl.gz")
KEEP_SUFFIXES = (".json", ".cubin")


def _lines(paths):
    for p in paths:
        files = sorted(glob.glob(os.path.join(p, "*.jsonl"))) if os.path.isdir(p) else [p]
        for f in files:
            opener = gzip.open if f.endswith(".gz") else open
            with opener(f, "rt") as fh:
                for line in fh:
                    line = line.strip()
                    if line:
                        yield json.loads(line)


def triton_key_hash() -> str:
    from triton.runtime.cache import triton_key

    return hashlib.sha256(triton_key().encode()).hexdigest()


def merge(dirs):
    """Add the compile records of ``dirs`` to RECORDS (one line per cache key; the newest wins)."""
    known = {r["hash"]: r for r in _lines([RECORDS])} if os.path.exists(RECORDS) else {}
    before = len(known)
    for r in _lines(dirs):
        if "module" in r and r.get("hash"):
            r = {k: v for k, v in r.items() if k not in ("hit", "us", "start", "pid")}
            known[r["hash"]] = r
    with gzip.open(RECORDS, "wt") as fh:
        for h in sorted(known):
            fh.write(json.dumps(known[h], sort_keys=True) + "\n")
    print(f"{RECORDS}: {len(known)} kernels ({len(known) - before} new)")


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def _compile_one(record):
    """Compile one record into Triton's cache; (recorded hash, built hash or None, message)."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend

        fn = getattr(importlib.import_module(record["module"]), record["name"])
        if record.get("gluon"):
            from transformer_engine.common.attention.kernels.triton_compat import gluon_ast_source

            source_cls = gluon_ast_source()
        else:
            source_cls = ASTSource
        signature = {k: _tuples(v) for k, v in record["signature"].items()}
        constants = pickle.loads(base64.b64decode(record["constants"]))
        attrs = {tuple(k): v for k, v in record["attrs"]}
        target = GPUTarget(*record["target"])
        backend = make_backend(target)
        fields = set(backend.parse_options({}).__dict__)
        # The libdevice path is the recording machine's; its content (what the key hashes) is the same here.
        options = {k: _tuples(v) for k, v in record["options"].items() if k in fields and k != "extern_libs"}
        kernel = triton.compile(source_cls(fn, signature, constants, attrs), target=target, options=options,
                                _env_vars=record.get("env") or {})
        return record["hash"], kernel.hash, ""
    except Exception as e:  # report and go on: one bad record must not stop the rest
        return record.get("hash"), None, f"{record.get('module')}.{record.get('name')}: {e!r}"[:300]


def _prune(cache):
    removed = 0
    for dirpath, _, files in os.walk(cache):
        for f in files:
            if not f.endswith(KEEP_SUFFIXES):
                os.remove(os.path.join(dirpath, f))
                removed += 1
    return removed


def build(cache, jobs, records=None, limit=0):
    os.environ["TRITON_CACHE_DIR"] = cache
    os.makedirs(cache, exist_ok=True)
    sys.path.insert(0, ROOT)
    recs = list({r["hash"]: r for r in _lines([records or RECORDS]) if "module" in r}.values())
    if limit:  # a sample, every n-th record: checks the keys without compiling everything
        recs = recs[::max(1, len(recs) // limit)][:limit]
    t0 = time.time()
    ok = mismatch = failed = 0
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        for want, got, msg in pool.map(_compile_one, recs, chunksize=1):
            if got is None:
                failed += 1
                print("FAILED", msg)
            elif got != want:
                mismatch += 1
                print(f"KEY MISMATCH {want} -> {got}")
            else:
                ok += 1
    removed = _prune(cache)
    print(f"triton_key {triton_key_hash()[:16]}: {ok} of {len(recs)} kernels built with the recorded key, "
          f"{mismatch} with another key, {failed} failed, in {time.time() - t0:.0f} s ({removed} IR files pruned)")
    return 0 if failed == 0 and mismatch == 0 else 1


def pack(cache, out):
    """The pruned cache as one xz tar whose members keep their absolute path (``tar -C /`` layout)."""
    import tarfile

    _prune(cache)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with tarfile.open(out, "w:xz", preset=6) as tar:
        tar.add(os.path.abspath(cache), arcname=os.path.abspath(cache).lstrip("/"))
    cubins = sum(f.endswith(".cubin") for _, _, fs in os.walk(cache) for f in fs)
    print(f"{out}: {cubins} cubins, {os.path.getsize(out) / 2**20:.1f} MiB")


def share(dirs, t0, t1):
    """The compile share of a call: the wall time during which at least one process compiled (not a cache hit),
    over the call's wall time [t0, t1]; and the CPU seconds of compiles and of cache loads."""
    recs = [r for r in _lines(dirs) if "us" in r]
    misses = sorted((r["start"], r["start"] + r["us"] / 1e6) for r in recs if not r["hit"])
    union, end = 0.0, None
    for a, b in misses:
        a, b = max(a, t0), min(b, t1)
        if b <= a:
            continue
        if end is None or a > end:
            union += b - a
            end = b
        elif b > end:
            union += b - end
            end = b
    wall = max(t1 - t0, 1e-9)
    hits = [r for r in recs if r["hit"]]
    out = {"wall_s": round(wall, 1), "compile_wall_s": round(union, 1), "compile_share": round(union / wall, 3),
           "compiles": len(misses), "compile_cpu_s": round(sum(b - a for a, b in misses), 1),
           "cache_hits": len(hits), "cache_load_cpu_s": round(sum(r["us"] for r in hits) / 1e6, 1),
           "errors": sum(1 for r in _lines(dirs) if "error" in r)}
    print(json.dumps(out))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge")
    m.add_argument("dirs", nargs="+")
    b = sub.add_parser("build")
    b.add_argument("--cache", required=True)
    b.add_argument("-j", "--jobs", type=int, default=os.cpu_count())
    b.add_argument("--records", default=None)
    b.add_argument("--limit", type=int, default=0)
    s = sub.add_parser("share")
    s.add_argument("dirs", nargs="+")
    s.add_argument("--t0", type=float, required=True)
    s.add_argument("--t1", type=float, required=True)
    pk = sub.add_parser("pack")
    pk.add_argument("--cache", required=True)
    pk.add_argument("--out", required=True)
    sub.add_parser("triton_key")
    pr = sub.add_parser("prune")
    pr.add_argument("--cache", required=True)
    a = p.parse_args(argv)
    if a.cmd == "merge":
        merge(a.dirs)
    elif a.cmd == "build":
        return build(a.cache, a.jobs, a.records, a.limit)
    elif a.cmd == "prune":
        print(f"{_prune(a.cache)} IR files pruned")
    elif a.cmd == "pack":
        pack(a.cache, a.out)
    elif a.cmd == "share":
        share(a.dirs, a.t0, a.t1)
    else:
        print(triton_key_hash())
    return 0


if __name__ == "__main__":
    sys.exit(main())
