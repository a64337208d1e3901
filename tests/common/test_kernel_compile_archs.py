"""Every planned launch compiles for every target architecture, fits its shared memory (LDS on AMD) and
does not spill, on the CPU: CDNA2/3/4 (gfx90a, gfx942, gfx950) and NVIDIA sm_80, sm_90, sm_100.

Triton's wheel compiles for both vendors without a GPU (ptxas for NVIDIA, the LLVM AMDGPU backend for
AMD). Each case is planned as a launch on that GPU would plan it (plan.forward_plan/backward_plan with the
GPU's device facts) and compiled as the frontends launch it (common.attention.launch_description):
forward, preprocess, dK/dV, dQ and, with a bias, dBias; with a learnable sink, the sink-gradient kernel. The
cases cover the head-dim buckets (32, 64, 128, 256 and d_qk != d_v), masks and windows (none, causal,
sliding bottom-right over packed sequences), the three dtypes, post-scale bias, ALiBi, dropout and GQA, each at its heaviest where it counts (bias with dropout
at every bucket). Launches that come out identical are compiled once, in a pool of one process per core;
Triton's on-disk cache makes a second run fast. Spills: the private scratch of the hsaco must be 0 on AMD;
the stack of the cubin (cuobjdump) must be 0 or at most what data/known_spills.json records on NVIDIA.
"""

import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
from typing import Dict, List, Tuple

import pytest
from case_grid import WIDE

pytest.importorskip("triton")

from transformer_engine.common.attention import AttnBiasType, AttnConfig, AttnMaskType, AttnSoftmaxType  # noqa: E402
from transformer_engine.common.attention.kernels.resources import (  # noqa: E402
    DEVICE_FACTS, compile_report, contiguous_call, job, planned_launches,
)
from transformer_engine.common.attention.plan import ARCHS, padded_head_dim  # noqa: E402

TARGETS = ("gfx90a", "gfx942", "gfx950", "sm80", "sm90", "sm100")


@dataclasses.dataclass(frozen=True)
class Case:
    dims: Tuple[int, int]
    dtype: str
    mask: AttnMaskType
    window: Tuple[int, int] = (-1, -1)
    bias: AttnBiasType = AttnBiasType.NO_BIAS
    dropout: bool = False
    gqa: int = 1
    thd: bool = False
    sink: bool = False  # learnable sink softmax: HAS_SINK forward and the sink-gradient kernel
    seqlen_q: int = 1024  # 1: the kernels' length-generic twins (a length of 1 is not specialized)
    segments: int = 1  # packed sequences in rows of this many: the segment-row grid (JAX's packed rows)
    seqlen_kv: int = 1024  # above the plan's kv_chunk: the chunked sum (and split-KV where the grid is small)
    page_size: int = 0  # K/V read through a page table (a paged KV cache's forward; no backward)

    @property
    def name(self) -> str:
        mods = [m for m, on in (("bias", self.bias == AttnBiasType.POST_SCALE_BIAS),
                                ("alibi", self.bias == AttnBiasType.ALIBI), ("dropout", self.dropout),
                                (f"gqa{self.gqa}", self.gqa > 1), ("thd", self.thd), ("sink", self.sink),
                                (f"rows{self.segments}", self.segments > 1),
                                (f"paged{self.page_size}", self.page_size > 0)) if on]
        window = f"-window{self.window}" if self.window != (-1, -1) else ""
        short = f"-sq{self.seqlen_q}" if self.seqlen_q != 1024 else ""
        short += f"-skv{self.seqlen_kv}" if self.seqlen_kv != 1024 else ""
        return (f"d{self.dims[0]}x{self.dims[1]}-{self.dtype}-{self.mask.value}{window}{short}-"
                + "-".join(mods or ["plain"]))


BIAS = AttnBiasType.POST_SCALE_BIAS
CASES = [
    # Bias with dropout and GQA at every head-dim bucket: the most registers and shared memory.
    Case((64, 64), "bfloat16", AttnMaskType.CAUSAL_MASK, bias=BIAS, dropout=True, gqa=4),
    Case((128, 128), "bfloat16", AttnMaskType.CAUSAL_MASK, bias=BIAS, dropout=True, gqa=4),
    Case((256, 256), "bfloat16", AttnMaskType.CAUSAL_MASK, bias=BIAS, dropout=True, gqa=4),
    # The tables' other key (masks without a diagonal bound) at every bucket: ALiBi with dropout (fp16,
    # d_qk != d_v at 256), a bias with dropout over padded sequences.
    Case((64, 64), "float16", AttnMaskType.NO_MASK, bias=AttnBiasType.ALIBI, dropout=True, gqa=2),
    Case((128, 128), "bfloat16", AttnMaskType.PADDING_MASK, bias=BIAS, dropout=True),
    Case((192, 128), "float16", AttnMaskType.NO_MASK, bias=AttnBiasType.ALIBI, dropout=True),
    # Hopper's narrow-V tiles (d_qk 256, d_v 128 padded; no bias or dropout), diagonal-bounded, at their
    # heaviest: packed sequences, GQA, sink softmax.
    Case((192, 128), "bfloat16", AttnMaskType.PADDING_CAUSAL_MASK, gqa=4, thd=True, sink=True),
    # A sliding bottom-right window over packed sequences (THD) with GQA at the smallest bucket.
    Case((32, 32), "bfloat16", AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK, window=(64, 0), gqa=2, thd=True),
    # fp32 (its own tiles) at the largest head dim, with bias and dropout.
    Case((256, 256), "float32", AttnMaskType.CAUSAL_MASK, bias=BIAS, dropout=True),
    # Learnable sink softmax with dropout over packed sequences (never the Gluon kernels).
    Case((128, 128), "bfloat16", AttnMaskType.PADDING_CAUSAL_MASK, dropout=True, gqa=2, thd=True, sink=True),
    # Packed sequences two to a row (JAX's max_segments_per_seq): the segment-row grid, on Hopper in the Gluon
    # kernels (their packed dK/dV keeps 40 bytes of stack, 56 on the (block, sequence) grid).
    Case((128, 128), "bfloat16", AttnMaskType.PADDING_CAUSAL_MASK, thd=True, segments=2),
    # One query against 1024 keys (decoding-style): the length-generic twins, at their heaviest.
    Case((256, 256), "bfloat16", AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, bias=BIAS, dropout=True, gqa=4, seqlen_q=1),
    # Keys over two chunks (kv_chunk 4096): the chunked sum in one program (a large grid), and split-KV with its
    # combine (one query: a small grid), at their heaviest.
    Case((128, 128), "bfloat16", AttnMaskType.CAUSAL_MASK, bias=BIAS, dropout=True, gqa=4, seqlen_q=8192,
         seqlen_kv=8192),
    Case((128, 128), "bfloat16", AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, bias=BIAS, dropout=True, gqa=4, seqlen_q=1,
         seqlen_kv=8192),
    # A paged KV cache's forward (K/V rows through the page table): decode over two chunks (split-KV; on Hopper at
    # d=128 the Gluon forward, its loader reading pages of 16 keys), at d=128 and d=256 (a sink: the Triton forward
    # everywhere), and a prefill chunk with a sliding window and a page size that is no power of two.
    Case((128, 128), "bfloat16", AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK, gqa=4, thd=True, seqlen_q=1,
         seqlen_kv=8192, page_size=16),
    Case((256, 256), "bfloat16", AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK, gqa=2, thd=True, seqlen_q=1,
         seqlen_kv=8192, page_size=64, sink=True),
    Case((64, 64), "float16", AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK, window=(512, 0), thd=True,
         seqlen_kv=8192, page_size=24),
    # The smallest bucket's paged prefill over packed sequences (Triton 3.6's ptxas crashed on its three-stage
    # pipeline: the plan keeps two).
    Case((32, 32), "float16", AttnMaskType.PADDING_CAUSAL_MASK, thd=True, page_size=16),
]


# CI (the L0 levels) compiles every case for sm90 (the GPU the kernels are verified on) and each case for one other
# target in turn, so that every target and every case compile in CI; the other (target, case) pairs are `wide`
# (qa/L1_cpu_wide): the whole matrix, cold, takes CI's two cores about 25 minutes.
_ROTATION = [t for t in TARGETS if t != "sm90"]


def in_ci(target: str, case: Case) -> bool:
    return target == "sm90" or _ROTATION[CASES.index(case) % len(_ROTATION)] == target


def _pairs():
    return [pytest.param(t, c, id=f"{t}-{c.name}", marks=() if in_ci(t, c) else WIDE) for t in TARGETS for c in CASES]


_SHORT = {"attn_fwd_kernel": "fwd", "attn_fwd_combine_kernel": "combine", "attn_bwd_preprocess_kernel": "preprocess",
          "attn_bwd_dkdv_kernel": "dkdv",
          "attn_bwd_dq_kernel": "dq", "attn_bwd_dbias_kernel": "dbias", "attn_bwd_dsink_kernel": "dsink",
          "attn_fwd_ws_kernel": "fwd_ws", "attn_bwd_dkdv_ws_kernel": "dkdv_ws", "attn_bwd_dq_ws_kernel": "dq_ws"}


def launches(target: str, case: Case) -> List[Tuple[str, tuple]]:
    """(kernel name, compile_report job) of each launch the frontends make for ``case`` on ``target``
    (a bias case twice: [1, h, s, s] and a [1, 1, 1, s] bias, whose dBias sums the query rows)."""
    dqk, dv = case.dims
    cfg = AttnConfig.of(batch_size=2, num_heads_q=8, num_heads_kv=8 // case.gqa, head_dim_qk=dqk, head_dim_v=dv,
                     max_seqlen_q=case.seqlen_q, max_seqlen_kv=case.seqlen_kv, dtype=case.dtype,
                     attn_mask_type=case.mask,
                     window_size=case.window, attn_bias_type=case.bias,
                     bias_shape="1hss" if case.bias == BIAS else None, dropout_probability=0.1 if case.dropout else 0.0,
                     softmax_type=(AttnSoftmaxType.LEARNABLE_SOFTMAX if case.sink else AttnSoftmaxType.VANILLA_SOFTMAX),
                     deterministic=True, device_type="cuda", **DEVICE_FACTS[target])
    shape = dict(seqlen=case.seqlen_q, seqlen_kv=case.seqlen_kv, thd=case.thd, segments_per_row=case.segments,
                 page_size=case.page_size)
    calls = [contiguous_call(cfg, **shape)]
    if case.bias == BIAS:
        calls.append(contiguous_call(cfg, **shape, bias_shape=(1, 1, 1, case.seqlen_kv)))
    out = []
    for call in calls:
        for launch in planned_launches(call):
            entry = (_SHORT[launch.name], job(launch, case.dtype, target))
            if entry not in out:
                out.append(entry)
    return out


def _key(job) -> str:
    return repr(job)


# Spills that are known and accepted on NVIDIA, per Triton release: {"3.6": {"target case-name kernel": the
# most stack bytes of its launches}} (data/known_spills.json, each release's entries measured by compiling this
# matrix with it: `python tests/common/test_kernel_compile_archs.py --record`). The NVIDIA tables were tuned for
# speed on the GPU with Triton 3.6, where some variants (bias with dropout, fp32 at d=256, the sm_100 compiles of
# Hopper's tiles, Hopper's narrow-V dK/dV at 192/128) measured fastest with a little stack; another release's
# compiler may spill more in the same tiles, which costs speed, not correctness, so it is recorded for that
# release and the 3.6 record stays as tight as it was. A launch that spills more than its release records, or
# one not recorded that spills, fails. AMD targets must not spill at all, on any release.
SPILLS_FILE = os.path.join(os.path.dirname(__file__), "data", "known_spills.json")
with open(SPILLS_FILE) as _f:
    ALL_KNOWN_SPILLS: Dict[str, Dict[str, int]] = json.load(_f)


def _release() -> str:
    from transformer_engine.common.attention.kernels.triton_compat import triton_version

    return "%d.%d" % triton_version()


KNOWN_SPILLS: Dict[str, int] = ALL_KNOWN_SPILLS.get(_release(), {})


def all_jobs(targets=TARGETS) -> Dict[str, tuple]:
    jobs = {}
    for target in targets:
        for case in CASES:
            for _, job in launches(target, case):
                jobs.setdefault(_key(job), job)
    return jobs


def compile_all(jobs: Dict[str, tuple]) -> Dict[str, dict]:
    """compile_report of every job, in a pool of one worker process per core."""
    workers = max(1, min(len(os.sched_getaffinity(0)), 8))
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        # The slow AMD compiles first, so that the pool ends together.
        order = sorted(jobs, key=lambda k: not jobs[k][0].startswith("gfx"))
        return dict(zip(order, pool.map(compile_report, [jobs[k] for k in order])))


def measured_spills(results: Dict[str, dict], targets=TARGETS, cases=CASES) -> Dict[str, int]:
    """{"target case-name kernel": most stack bytes} of the NVIDIA launches of ``targets`` that spill."""
    out: Dict[str, int] = {}
    for target in targets:
        if ARCHS[target].vendor != "nvidia":
            continue
        for case in cases:
            for kernel, job in launches(target, case):
                stack = results[_key(job)].get("stack", 0)
                if stack > 0:
                    key = f"{target} {case.name} {kernel}"
                    out[key] = max(out.get(key, 0), stack)
    return out


class _Compiled(dict):
    """Compile results by job key. The first test to ask compiles, in one pool, the launches of every (target,
    case) pair the session selected: a selection such as ``-k sm90`` compiles only those."""

    def __init__(self, session):
        super().__init__()
        self.session = session
        self.done = set()

    def selected(self, target=None):
        pairs = {(item.callspec.params["target"], item.callspec.params["case"]) for item in self.session.items
                 if getattr(item, "originalname", None) == "test_planned_launches_compile_fit_and_do_not_spill"}
        return {p for p in pairs if target is None or p[0] == target}

    def need(self, pairs) -> "_Compiled":
        todo = set(pairs) - self.done
        if todo:
            jobs = {}
            for target, case in sorted(todo, key=lambda p: (p[0], CASES.index(p[1]))):
                for _, j in launches(target, case):
                    jobs.setdefault(_key(j), j)
            self.update(compile_all({k: j for k, j in jobs.items() if k not in self}))
            self.done.update(todo)
        return self


@pytest.fixture(scope="module")
def compiled(request) -> _Compiled:
    """Every distinct launch of the selected (target, case) pairs, compiled once (one worker process per core)."""
    return _Compiled(request.session)


def test_known_spills_record_this_triton_release():
    """The installed Triton's spills are recorded (data/known_spills.json), so the spill checks below hold it
    to its own measured budget; a new release is recorded with --record, after its kernels run on the GPU."""
    assert _release() in ALL_KNOWN_SPILLS, (
        f"triton {_release()} has no spill record in {SPILLS_FILE}: python tests/common/test_kernel_compile_archs.py "
        "--record")


@pytest.mark.parametrize("target", [t for t in TARGETS if ARCHS[t].vendor == "nvidia"])
def test_known_spills_are_exact_for_this_release(compiled, target):
    """The installed release's record is what its compiler gives now: a spill that went away (or shrank) is
    taken out, so that the budget cannot grow loose over time (over the cases this run compiles for ``target``:
    those the session selected, else CI's)."""
    pairs = compiled.selected(target) or {(target, c) for c in CASES if in_ci(target, c)}
    cases = [c for t, c in pairs]
    measured = measured_spills(compiled.need(pairs), [target], cases)
    names = {c.name for c in cases}
    stale = {k: (v, measured.get(k, 0)) for k, v in KNOWN_SPILLS.items()
             if k.split()[0] == target and k.split()[1] in names and measured.get(k, 0) < v}
    assert not stale, f"recorded > measured (bytes) for triton {_release()}: {stale}; re-record with --record"


@pytest.mark.parametrize("target,case", _pairs())
def test_planned_launches_compile_fit_and_do_not_spill(compiled, target, case):
    budget = ARCHS[target].shared_memory
    problems = []
    compiled.need(compiled.selected() | {(target, case)})
    for kernel, job in launches(target, case):
        res = compiled[_key(job)]
        if "error" in res:
            problems.append(f"{kernel}: does not compile: {res['error']}")
            continue
        if res["smem"] > budget:
            problems.append(f"{kernel}: {res['smem']} bytes of shared memory > {budget} on {target}")
        allowed = 0 if ARCHS[target].vendor == "amd" else KNOWN_SPILLS.get(f"{target} {case.name} {kernel}", 0)
        if res["stack"] > allowed:
            problems.append(f"{kernel}: {res['stack']} bytes of stack/scratch (at most {allowed} recorded in "
                            f"data/known_spills.json), {res['regs']} registers")
    assert not problems, f"{target} {case.name}:\n  " + "\n  ".join(problems)


def test_known_spills_name_planned_launches():
    """Every recorded spill, of every release, is of a target, case and kernel this matrix compiles (no stale
    entries), on NVIDIA."""
    planned = {f"{target} {case.name} {kernel}" for target in TARGETS for case in CASES
               for kernel, _ in launches(target, case)}
    for release, spills in ALL_KNOWN_SPILLS.items():
        assert set(spills) <= planned, (release, sorted(set(spills) - planned))
        assert all(ARCHS[key.split()[0]].vendor == "nvidia" for key in spills), release


def test_cases_cover_every_bucket_kernel_and_modifier():
    """The matrix spans what the brief of this file says, so that a new plan key cannot slip past it."""
    assert {padded_head_dim(max(c.dims)) for c in CASES} == {32, 64, 128, 256}
    # Every (bucket, diagonal-bounded) key of the tables, in 16-bit.
    keys = {(min(max(padded_head_dim(max(c.dims)), 64), 256), c.mask.is_causal() or c.window != (-1, -1))
            for c in CASES if c.dtype != "float32"}
    assert keys == {(d, w) for d in (64, 128, 256) for w in (False, True)}
    assert {c.dtype for c in CASES} == {"float16", "bfloat16", "float32"}
    assert any(c.seqlen_q == 1 for c in CASES)  # the length-generic twins
    assert {c.bias for c in CASES} == set(AttnBiasType) - {AttnBiasType.PRE_SCALE_BIAS}
    assert any(c.dropout for c in CASES) and any(c.gqa > 1 for c in CASES) and any(c.thd for c in CASES)
    assert any(c.dims[0] != c.dims[1] for c in CASES) and any(c.window != (-1, -1) for c in CASES)
    kernels = {k for t in TARGETS for c in CASES for k, _ in launches(t, c)}
    assert kernels == {"fwd", "combine", "preprocess", "dkdv", "dq", "dbias", "dsink", "fwd_ws", "dkdv_ws", "dq_ws"}
    assert any(c.seqlen_kv > 4096 and c.seqlen_q == 1 for c in CASES)  # split-KV and its combine
    # Paged KV: decode over two chunks, and a page size that is not a power of two.
    assert any(c.page_size and c.seqlen_q == 1 and c.seqlen_kv > 4096 for c in CASES)
    assert any(c.page_size & (c.page_size - 1) for c in CASES)


if __name__ == "__main__":
    # --record: compile the matrix with the installed Triton and write its release's spills into
    # data/known_spills.json (the other releases' entries are kept).
    import sys

    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/common/test_kernel_compile_archs.py --record")
    results = compile_all(all_jobs())
    errors = {k: r["error"] for k, r in results.items() if "error" in r}
    if errors:
        sys.exit(f"{len(errors)} launches do not compile: {next(iter(errors.values()))}")
    with open(SPILLS_FILE) as f:  # read again: another release may have been recorded meanwhile
        records = json.load(f)
    records[_release()] = measured_spills(results)
    with open(SPILLS_FILE, "w") as f:
        json.dump(records, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"triton {_release()}: {len(records[_release()])} spilling launches recorded in {SPILLS_FILE}")
