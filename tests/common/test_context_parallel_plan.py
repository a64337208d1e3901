"""The common context-parallel plan (``transformer_engine.common.attention.context_parallel``): its
invariants, and that PyTorch's and JAX's CP code build and run the same plan.

Invariants: over the ranks every (query chunk, key chunk) block of each pass is computed exactly once
(causal: only the blocks on or below the diagonal), the chunks tile the sequence, every kernel call
starts at a tile boundary, the plans are deterministic data, and the dual-chunk order balances causal
work. Equality: the plan objects each framework's CP code builds (PyTorch's ``rank_plan`` of its
``SeqSplit``, JAX's ``_Plan.rank_plan``), the load-balanced token orders, the tile alignments and the
support reasons agree over a grid of cp sizes, masks, formats, comm types and sequence lengths.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

import pytest

from transformer_engine.common.attention import AttnConfig, AttnMaskType, QKVFormat
from transformer_engine.common.attention import context_parallel as cpp
from transformer_engine.common.attention.enums import AttnBiasType, AttnSoftmaxType, QKVLayout
from transformer_engine.common.attention.plan import backward_plan, forward_plan

CPS = (1, 2, 4, 8)
ROW_SPLIT = ("p2p", "all_gather")
BALANCES = (cpp.LoadBalance.DUAL_CHUNK, cpp.LoadBalance.CONTIGUOUS)
# Chunk lengths (per chunk of 2 cp): tile multiples and awkward ones (odd, prime, just past a tile).
CHUNK_LENGTHS = (1, 7, 64, 100, 128, 129, 384)
# (balance, rounds): the plan's orders, STRIPED with one to three stripes per rank.
ORDERS = tuple((b, 1) for b in BALANCES) + tuple((cpp.LoadBalance.STRIPED, r) for r in (1, 2, 3))


def _expected_blocks(n: int, causal: bool):
    return {(q, kv) for q in range(n) for kv in range(n) if kv <= q or not causal}


# -- invariants of the common plan ------------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no_mask"])
@pytest.mark.parametrize("balance,rounds", ORDERS, ids=lambda x: getattr(x, "value", str(x)))
@pytest.mark.parametrize("comm", ROW_SPLIT)
@pytest.mark.parametrize("cp", CPS)
def test_every_block_is_computed_once_over_the_ranks(cp, comm, balance, rounds, causal):
    n = cpp.num_chunks(cp, balance, rounds)
    plans = [cpp.rank_plan(comm, cp, r, 16 * n, causal, balance, rounds=rounds) for r in range(cp)]
    for pass_ in cpp.Pass:
        counts = collections.Counter(b for p in plans for b in p.blocks(pass_))
        assert set(counts) == _expected_blocks(n, causal), pass_
        assert set(counts.values()) == {1}, (pass_, counts)
        # A rank's forward and dQ blocks are its query chunks' rows; its dK/dV blocks its key chunks' columns.
        for p in plans:
            own = {r.chunk for r in p.ranges}
            axis = 1 if pass_ == cpp.Pass.DKDV else 0
            assert {b[axis] for b in p.blocks(pass_)} <= own
    for p in plans:  # the rank's chunks in its local order, where the input order puts them
        assert tuple(r.chunk for r in p.ranges) == cpp.rank_chunks(cp, p.rank, balance, rounds)
        assert [r.local_start for r in p.ranges] == [i * 16 for i in range(len(p.ranges))]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no_mask"])
@pytest.mark.parametrize("cp", CPS)
def test_a2a_computes_every_block_once_per_head_group(cp, causal):
    n = cpp.num_chunks(cp, cpp.LoadBalance.DUAL_CHUNK)
    plans = [cpp.rank_plan("a2a", cp, r, 16 * n, causal, cpp.LoadBalance.DUAL_CHUNK) for r in range(cp)]
    assert sorted(p.heads for p in plans) == [(r, cp) for r in range(cp)]
    for p, pass_ in itertools.product(plans, cpp.Pass):
        blocks = p.blocks(pass_)
        assert len(blocks) == len(set(blocks)) and set(blocks) == _expected_blocks(n, causal)
    assert all(p.ranges == (cpp.ChunkRange(0, 0, 16 * n, 0, 0),) for p in plans)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no_mask"])
@pytest.mark.parametrize("sizes", [(2, 2), (2, 4), (4, 2)], ids=lambda s: f"a2a{s[0]}xp2p{s[1]}")
def test_a2a_p2p_computes_every_block_once_per_head_group(sizes, causal):
    """Hierarchical: heads over the a2a group, the row split over the p2p group."""
    size_a, size_p = sizes
    n = cpp.num_chunks(size_p, cpp.LoadBalance.DUAL_CHUNK)
    counts = collections.Counter()
    for rank_a, rank_p in itertools.product(range(size_a), range(size_p)):
        plan = cpp.rank_plan("a2a+p2p", size_p, rank_p, 8 * n, causal, cpp.LoadBalance.DUAL_CHUNK,
                             heads=(rank_a, size_a))
        assert plan.heads == (rank_a, size_a)
        counts.update((plan.heads, p, b) for p in cpp.Pass for b in plan.blocks(p))
    assert set(counts.values()) == {1}
    assert len(counts) == size_a * len(cpp.Pass) * len(_expected_blocks(n, causal))


@pytest.mark.parametrize("align", [1, 16, 64, 128])
@pytest.mark.parametrize("balance", BALANCES, ids=lambda b: b.value)
@pytest.mark.parametrize("cp", CPS)
def test_chunks_tile_the_sequence_and_calls_start_on_tiles(cp, balance, align):
    n = cpp.num_chunks(cp, balance)
    for length in CHUNK_LENGTHS:
        s = n * length
        covered = []
        for rank in range(cp):
            ranges = cpp.chunk_ranges(s, cp, rank, balance, align)
            assert [r.chunk for r in ranges] == list(cpp.rank_chunks(cp, rank, balance))
            for slot, r in enumerate(ranges):
                assert (r.start, r.end, r.local_start) == (r.chunk * length, (r.chunk + 1) * length, slot * length)
                assert r.aligned_start % align == 0 and 0 <= r.lead < align and r.aligned_start <= r.start
                covered.extend(range(r.start, r.end))
        assert sorted(covered) == list(range(s))


def test_plans_are_deterministic_frozen_data_in_the_documented_order():
    a = cpp.rank_plan("p2p", 4, 1, 800, True, cpp.LoadBalance.DUAL_CHUNK, 128)
    b = cpp.rank_plan("p2p", 4, 1, 800, True, cpp.LoadBalance.DUAL_CHUNK, 128)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.rank = 2
    # Forward per own chunk in local order, then per own chunk: dK/dV, dQ.
    assert [(p, c) for p, c, _ in a.work] == [(cpp.Pass.FORWARD, 1), (cpp.Pass.FORWARD, 6), (cpp.Pass.DKDV, 1),
                                              (cpp.Pass.DQ, 1), (cpp.Pass.DKDV, 6), (cpp.Pass.DQ, 6)]
    assert a.ranges == (cpp.ChunkRange(1, 100, 200, 0, 0), cpp.ChunkRange(6, 600, 700, 512, 100))
    # Each pass's blocks run in the single-device kernel's order (keys, resp. queries, ascending).
    assert a.work[1][2] == tuple((6, kv) for kv in range(7))
    assert a.work[2][2] == tuple((q, 1) for q in range(1, 8))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_dual_chunk_balances_causal_work(cp):
    """Causal blocks per rank: equal with the dual-chunk order, growing with the rank without it."""
    def work(balance):
        n = cpp.num_chunks(cp, balance)
        return [len(cpp.rank_plan("p2p", cp, r, 2 * n, True, balance).blocks(cpp.Pass.FORWARD)) for r in range(cp)]
    assert len(set(work(cpp.LoadBalance.DUAL_CHUNK))) == 1
    contiguous = work(cpp.LoadBalance.CONTIGUOUS)
    assert contiguous == sorted(contiguous) and contiguous[0] < contiguous[-1]


def test_malformed_plan_arguments_name_the_argument():
    with pytest.raises(ValueError, match="`seqlen` must be a multiple of the 8 chunks"):
        cpp.chunk_ranges(100, 4, 0, cpp.LoadBalance.DUAL_CHUNK)
    with pytest.raises(ValueError, match="`cp_comm_type` must be one of"):
        cpp.rank_plan("ring", 2, 0, 64, True, cpp.LoadBalance.DUAL_CHUNK)
    with pytest.raises(ValueError, match="`align` must be a positive int"):
        cpp.chunk_ranges(64, 2, 0, cpp.LoadBalance.DUAL_CHUNK, 0)


def test_tile_alignment_is_the_largest_block_of_the_plans():
    base = AttnConfig.of(batch_size=1, num_heads_q=8, num_heads_kv=8, head_dim_qk=128, head_dim_v=128, max_seqlen_q=0,
                      max_seqlen_kv=0, dtype="bfloat16", deterministic=True, device_type="cuda",
                      compute_capability=(9, 0))
    configs = [base.replace(attn_mask_type=m) for m in (AttnMaskType.CAUSAL_MASK, AttnMaskType.NO_MASK)]
    align = cpp.tile_alignment(configs)
    blocks = [t.block_m for c in configs for p in (forward_plan(c), backward_plan(c))
              for t in ((p.tiles, p.warp_specialized) if hasattr(p, "tiles") else
                        (p.dkdv, p.dq, p.dkdv_warp_specialized, p.dq_warp_specialized)) if t is not None]
    assert align >= max(blocks) and align > 1
    assert cpp.tile_alignment([]) == 1


_SUPPORTED = dict(mask=AttnMaskType.CAUSAL_MASK, bias_type=AttnBiasType.NO_BIAS, dropout=0.0,
                  softmax_type=AttnSoftmaxType.VANILLA_SOFTMAX, window=(-1, 0))
_REFUSED = [  # (override, argument named)
    (dict(bias_type=AttnBiasType.POST_SCALE_BIAS), "core_attention_bias_type"),
    (dict(dropout=0.1), "attention_dropout"),
    (dict(softmax_type=AttnSoftmaxType.OFF_BY_ONE_SOFTMAX), "softmax_type"),
    (dict(window=(16, 0)), "window_size"),
    (dict(mask=AttnMaskType.NO_MASK, window=(-1, 0)), "window_size"),
    (dict(mask=AttnMaskType.ARBITRARY_MASK, window=(-1, -1)), "attn_mask_type"),
    (dict(mask=AttnMaskType.PADDING_CAUSAL_MASK), "attn_mask_type"),
    (dict(return_max_logit=True), "return_max_logit"),
]


@pytest.mark.parametrize("override, arg", _REFUSED, ids=[a for _, a in _REFUSED])
def test_unsupported_reasons_name_the_argument(override, arg):
    assert cpp.unsupported_reasons(comm_type="p2p", qkv_format=QKVFormat.BSHD, **_SUPPORTED) == []
    reasons = cpp.unsupported_reasons(comm_type="p2p", qkv_format=QKVFormat.BSHD, **{**_SUPPORTED, **override})
    assert len(reasons) == 1, reasons
    assert reasons[0].startswith(f"`{arg}` must") and "not supported with context parallelism" in reasons[0]


def test_unsupported_reasons_of_thd():
    pad = dict(_SUPPORTED, mask=AttnMaskType.PADDING_CAUSAL_MASK)
    assert cpp.unsupported_reasons(comm_type="a2a", qkv_format=QKVFormat.THD, **pad) == []
    windowed = dict(pad, window=(16, 0))
    assert cpp.unsupported_reasons(comm_type="p2p", qkv_format=QKVFormat.THD, **windowed)
    # Replicated THD (every rank computes the whole rows) takes windows, not dropout.
    assert cpp.unsupported_reasons(comm_type="p2p", qkv_format=QKVFormat.THD, replicated_thd=True, **windowed) == []
    assert cpp.unsupported_reasons(comm_type="p2p", qkv_format=QKVFormat.THD, replicated_thd=True,
                                   **dict(windowed, dropout=0.1))


# -- PyTorch and JAX run the same plan ------------------------------------------------------------

def _frameworks():
    torch = pytest.importorskip("torch")
    pytest.importorskip("jax")
    from transformer_engine.jax import context_parallel as jcp
    from transformer_engine.jax.enums import CPStrategy
    from transformer_engine.jax.primitives.attention import FusedAttnStatic
    from transformer_engine.pytorch.attention import context_parallel as tcp
    return torch, tcp, jcp, CPStrategy, FusedAttnStatic


def _jax_static(FusedAttnStatic, mask, window=None):
    window = window if window is not None else ((-1, 0) if mask.is_causal() else (-1, -1))
    return FusedAttnStatic(attn_mask_type=mask, attn_bias_type=AttnBiasType.NO_BIAS, qkv_format=QKVFormat.BSHD,
                           window_size=window, scaling_factor=0.125, dropout_probability=0.0, is_training=True,
                           deterministic=True)


@pytest.mark.parametrize("align", [1, 64, 128])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no_mask"])
@pytest.mark.parametrize("comm", ROW_SPLIT)
@pytest.mark.parametrize("cp", CPS)
def test_pytorch_and_jax_build_equal_plans(cp, comm, causal, align):
    """BSHD: the plan PyTorch's CP code runs for a SeqSplit equals the one JAX's _Plan runs (dual-chunk
    order, which PyTorch always uses), for tile multiples and awkward lengths, down to the chunk ranges
    each slices and the rows each carries before a chunk to start its calls on a tile."""
    torch, tcp, jcp, CPStrategy, FusedAttnStatic = _frameworks()
    mask = AttnMaskType.CAUSAL_MASK if causal else AttnMaskType.NO_MASK
    strategy = CPStrategy.RING if comm == "p2p" else CPStrategy.ALL_GATHER
    jplan = jcp.make_plan(_jax_static(FusedAttnStatic, mask), jcp.ContextParallel("cp", cp, strategy, True), align)
    spec = tcp.FusedSpec(0.125, causal, True, align)
    for length in CHUNK_LENGTHS:
        s = 2 * cp * length
        for rank in range(cp):
            split = tcp.SeqSplit(QKVFormat.BSHD, cp, rank, seqlen=s)
            tplan = tcp.rank_plan(split, spec, comm)
            assert tplan == jplan.rank_plan(rank, s), (s, rank)
            # What each framework slices: PyTorch's chunk ranges and JAX's (local start, length, global start).
            # JAX's forward launches (the unmasked calls merged): (local start, rows, global start).
            launched = [(calls[0].chunk.local_start, sum(c.chunk.end - c.chunk.start for c in calls),
                         int(at.start)) for calls, at in jplan.launches(s // cp, rank, cpp.Pass.FORWARD)]
            assert launched == ([(r.local_start, r.end - r.start, r.start) for r in tplan.ranges] if causal
                                else [(0, s // cp, tplan.ranges[0].start)])
            assert split.token_index().tolist() == [t for r in tplan.ranges for t in range(r.start, r.end)]
        # JAX starts each causal chunk call at the plan's aligned start: its zero-row lead is the plan's (the
        # unmasked calls need none: every row sees every key).
        leads = [c.lead for rank in range(cp) for c in tcp.rank_plan(
            tcp.SeqSplit(QKVFormat.BSHD, cp, rank, seqlen=s), spec, comm).calls]
        assert jplan.lead_rows(s // cp) == (max(leads) if causal else 0)


@pytest.mark.parametrize("cp", CPS)
def test_pytorch_thd_sequences_follow_the_plan(cp):
    """THD: PyTorch splits each sequence (its padded length) by the plan; the token order is the plan's."""
    _, tcp, _, _, _ = _frameworks()
    padded = tuple(2 * cp * n for n in (1, 3, 64, 129))
    starts = tuple(sum(padded[:i]) for i in range(len(padded)))
    lengths = tuple(p - 1 for p in padded)
    spec = tcp.FusedSpec(0.125, True, True, 64)
    for rank in range(cp):
        split = tcp.SeqSplit(QKVFormat.THD, cp, rank, starts=starts, padded=padded, lengths=lengths)
        expected = []
        for n, start in enumerate(starts):
            plan = tcp.rank_plan(split, spec, "p2p", n)
            assert plan == cpp.rank_plan("p2p", cp, rank, padded[n], True, cpp.LoadBalance.DUAL_CHUNK, 64)
            # Each thd launch of the pass joins call i of every sequence's plan: this sequence's is that call.
            for pass_ in cpp.Pass:
                assert [calls[n] for calls in tcp._thd_launches(split, spec, pass_)] == [
                    c for c in plan.calls if c.pass_ == pass_]
            expected += [start + t for r in plan.ranges for t in range(r.start, r.end)]
        assert split.token_index().tolist() == expected


@pytest.mark.parametrize("cp", CPS)
def test_jax_dual_chunk_swap_is_the_plans_order(cp):
    """reorder_causal_load_balancing(DualChunkSwap) puts rank r's plan chunks at its slice."""
    _frameworks()
    import jax.numpy as jnp
    from transformer_engine.jax.enums import ReorderStrategy
    from transformer_engine.jax.load_balancing import reorder_causal_load_balancing

    if cp > 1 and cp % 2:
        pytest.skip("DualChunkSwap takes cp 1 or even")
    s = 2 * cp * 3
    order = reorder_causal_load_balancing(jnp.arange(s), ReorderStrategy.DualChunkSwap, cp, 0).tolist()
    expected = [t for r in range(cp) for c in cpp.chunk_ranges(s, cp, r, cpp.LoadBalance.DUAL_CHUNK)
                for t in range(c.start, c.end)]
    assert order == expected


_GRID_MASKS = [  # (mask, window): causal, no mask, sliding windows, padding
    (AttnMaskType.CAUSAL_MASK, (-1, 0)), (AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, (-1, 0)),
    (AttnMaskType.NO_MASK, (-1, -1)), (AttnMaskType.CAUSAL_MASK, (32, 0)), (AttnMaskType.NO_MASK, (32, 32)),
    (AttnMaskType.PADDING_CAUSAL_MASK, (-1, 0)), (AttnMaskType.PADDING_MASK, (-1, -1)),
]
_GRID_MODS = [dict(), dict(bias_type=AttnBiasType.POST_SCALE_BIAS), dict(dropout=0.1),
              dict(softmax_type=AttnSoftmaxType.LEARNABLE_SOFTMAX)]


def _as_pytorch_names(reason: str) -> str:
    for key, name in cpp.JAX_ARGS.items():
        reason = reason.replace(f"`{name}`", f"`{cpp.PYTORCH_ARGS[key]}`")
    return reason.replace("qkv_layout=", "qkv_format=")


@pytest.mark.parametrize("comm", ROW_SPLIT)
@pytest.mark.parametrize("fmt", [QKVFormat.BSHD, QKVFormat.THD], ids=lambda f: f.value)
def test_pytorch_and_jax_support_the_same_calls(fmt, comm):
    """Each framework's reasons over masks, windows and modifiers: the same reasons (argument names
    mapped) for BSHD. THD: JAX runs every rank on the whole gathered rows (any mask and window), PyTorch
    the per-sequence plan (no sliding window): the modifier reasons agree, the window ones differ."""
    torch, tcp, jcp, CPStrategy, FusedAttnStatic = _frameworks()
    strategy = CPStrategy.RING if comm == "p2p" else CPStrategy.ALL_GATHER
    jcp_ctx = jcp.ContextParallel("cp", 4, strategy, True)
    layout = QKVLayout.THD_THD_THD if fmt == QKVFormat.THD else QKVLayout.BSHD_BSHD_BSHD
    checked = 0
    for (mask, window), mods in itertools.product(_GRID_MASKS, _GRID_MODS):
        args = {**dict(bias_type=AttnBiasType.NO_BIAS, dropout=0.0, softmax_type=AttnSoftmaxType.VANILLA_SOFTMAX),
                **mods}
        t = tcp.unsupported_reasons(comm, fmt, mask, window, args["bias_type"], args["dropout"],
                                    args["softmax_type"])
        j = jcp.unsupported_reasons(jcp_ctx, layout=layout, mask=mask, window=window, is_training=True,
                                    max_segments=1, local=False, **args)
        j = [_as_pytorch_names(r) for r in j]
        if fmt == QKVFormat.BSHD:
            assert t == j, (mask, window, mods)
        else:
            window_reason = [r for r in t if r.startswith("`window_size`")]
            assert [r for r in t if r not in window_reason] == j, (mask, window, mods)
            assert bool(window_reason) == (window not in ((-1, -1), (-1, 0))), (mask, window)
        checked += 1
    assert checked == len(_GRID_MASKS) * len(_GRID_MODS)


@pytest.mark.parametrize("arch", [(8, 0), (9, 0), (10, 0)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no_mask"])
@pytest.mark.parametrize("dims", [(64, 64), (128, 128)])
def test_pytorch_and_jax_tile_alignment_agree(arch, causal, dims, monkeypatch):
    """The tile both frameworks align chunk calls to, for the same call on the same GPU architecture."""
    torch, tcp, jcp, CPStrategy, FusedAttnStatic = _frameworks()
    import jax.numpy as jnp
    from transformer_engine.pytorch.attention import kernel_runner

    monkeypatch.setattr(kernel_runner, "_device", lambda device: dict(device_type="cuda", compute_capability=arch))
    mask = AttnMaskType.CAUSAL_MASK if causal else AttnMaskType.NO_MASK
    q = torch.zeros(1, 256, 8, dims[0], dtype=torch.bfloat16)
    k = torch.zeros(1, 256, 2, dims[0], dtype=torch.bfloat16)
    v = torch.zeros(1, 256, 2, dims[1], dtype=torch.bfloat16)
    t_align = tcp.tile_alignment(q, k, v, QKVFormat.BSHD, causal, True)
    jq, jk, jv = (jnp.zeros(tuple(x.shape), jnp.bfloat16) for x in (q, k, v))
    jplan = jcp.make_plan(_jax_static(FusedAttnStatic, mask), jcp.ContextParallel("cp", 2, CPStrategy.ALL_GATHER,
                                                                                   True))
    j_align = jcp.tile_alignment(jplan, jq, jk, jv, capability=arch)
    assert t_align == j_align and t_align > 1


# -- load-balanced orders and chunk calls ---------------------------------------------------------------

@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_striped_order_deals_stripes_round_robin(cp):
    """Striped: rank r holds stripes r, r + cp, ...; JAX's reorder(Striped) is the common chunk order."""
    rounds = 3
    assert cpp.num_chunks(cp, cpp.LoadBalance.STRIPED, rounds) == cp * rounds
    order = cpp.chunk_order(cp, cpp.LoadBalance.STRIPED, rounds)
    assert sorted(order) == list(range(cp * rounds))
    assert [c % cp for c in order] == [r for r in range(cp) for _ in range(rounds)]
    _frameworks()
    import jax.numpy as jnp
    from transformer_engine.jax.enums import ReorderStrategy
    from transformer_engine.jax.load_balancing import reorder_causal_load_balancing

    stripe = 2
    tokens = reorder_causal_load_balancing(jnp.arange(cp * rounds * stripe), ReorderStrategy.Striped, cp, 0,
                                           stripe).tolist()
    assert tokens == [c * stripe + t for c in order for t in range(stripe)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no_mask"])
@pytest.mark.parametrize("balance,rounds", ORDERS, ids=lambda x: getattr(x, "value", str(x)))
@pytest.mark.parametrize("cp", CPS)
def test_chunk_calls_cover_each_pass_once_with_the_global_mask(cp, balance, rounds, causal):
    """Each pass's calls keep every row exactly once over the ranks; a call's (rows, span, mask) make
    each kept row see exactly its global keys (queries for dK/dV); the first backward call preprocesses
    rows covering the rank's later calls."""
    align, length = 16, 24
    n = cpp.num_chunks(cp, balance, rounds)
    s = n * length

    def visible(q, kv):
        return kv <= q or not causal

    kept = collections.Counter()
    for rank in range(cp):
        plan = cpp.rank_plan("p2p", cp, rank, s, causal, balance, align, rounds=rounds)
        calls = plan.calls
        assert [(c.pass_, c.chunk.chunk) for c in calls] == [(p, ch) for p, ch, _ in plan.work]
        for call in calls:
            lo, hi = call.rows
            assert lo % align == 0 and hi == call.chunk.end and call.lead == call.chunk.start - lo
            for x in range(call.chunk.start, call.chunk.end):
                kept[(call.pass_, x)] += 1
                seen = set()
                for y in range(*call.span):
                    i, j = (y, x) if call.pass_ == cpp.Pass.DKDV else (x, y)
                    li, lj = (i - call.span[0], j - lo) if call.pass_ == cpp.Pass.DKDV else (i - lo, j)
                    n_q = (call.span[1] - call.span[0]) if call.pass_ == cpp.Pass.DKDV else call.length
                    n_k = call.length if call.pass_ == cpp.Pass.DKDV else call.span[1] - call.span[0]
                    if call.mask == AttnMaskType.NO_MASK or (
                            call.mask == AttnMaskType.CAUSAL_MASK and lj <= li) or (
                            call.mask == AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK and lj <= li + n_k - n_q):
                        seen.add(y)
                assert seen == {y for y in range(s) if (visible(y, x) if call.pass_ == cpp.Pass.DKDV
                                                         else visible(x, y))}, call
        backward = [c for c in calls if c.pass_ != cpp.Pass.FORWARD]
        assert [c.preprocess for c in backward] == [True] + [False] * (len(backward) - 1)
        first = backward[0]
        assert all(first.span[0] <= (c.span[0] if c.pass_ == cpp.Pass.DKDV else c.rows[0]) for c in backward)
    assert set(kept.values()) == {1} and len(kept) == 3 * s


# -- the gather order, written once for both frameworks' collectives ------------------------------------

@pytest.mark.parametrize("cp", CPS)
def test_ring_gathers_every_block_in_its_step_order(cp):
    """Simulated ring: each step every rank receives from ``ring_prev`` the block that rank received last
    (``ring_next`` of the sender is the receiver); after step t rank r holds ``ring_source(cp, r, t)``'s
    block, and ``ring_step`` puts the steps back in rank order."""
    held = {r: [r] for r in range(cp)}
    for _ in range(1, cp):
        last = {r: blocks[-1] for r, blocks in held.items()}
        for r in range(cp):
            assert cpp.ring_next(cp, cpp.ring_prev(cp, r)) == r
            held[r].append(last[cpp.ring_prev(cp, r)])
    for r in range(cp):
        assert held[r] == [cpp.ring_source(cp, r, t) for t in range(cp)]
        assert sorted(held[r]) == list(range(cp))
        assert [held[r][cpp.ring_step(cp, r, j)] for j in range(cp)] == list(range(cp))


@pytest.mark.parametrize("rounds", [1, 3])
@pytest.mark.parametrize("balance", list(cpp.LoadBalance))
@pytest.mark.parametrize("cp", CPS)
def test_chunk_places_put_gathered_blocks_in_global_order(cp, balance, rounds):
    """Chunk c of the sequence sits in block ``rank`` at ``slot``: the inverse of ``chunk_order``."""
    order = cpp.chunk_order(cp, balance, rounds)
    per = len(order) // cp
    places = cpp.chunk_places(cp, balance, rounds)
    assert len(places) == cpp.num_chunks(cp, balance, rounds)
    assert [order[r * per + slot] for r, slot in places] == list(range(len(order)))


@pytest.mark.parametrize("cp", (2, 4, 8))
def test_packed_rows_run_their_input_order_while_calls_stay_few(cp):
    """thd: contiguous input runs contiguous; Striped input runs its own STRIPED order with one or two stripes
    per rank (the kept rows are the rank's own), the dual-chunk order with more (two calls per pass)."""
    s = 2 * cp * 8
    assert cpp.packed_balance(cp, s, False, 4) == (cpp.LoadBalance.CONTIGUOUS, 1)
    assert cpp.packed_balance(cp, s, True, s // cp) == (cpp.LoadBalance.STRIPED, 1)
    assert cpp.packed_balance(cp, s, True, s // (2 * cp)) == (cpp.LoadBalance.STRIPED, 2)
    assert cpp.packed_balance(cp, s, True, 1) == (cpp.LoadBalance.DUAL_CHUNK, 1)
    assert cpp.packed_balance(cp, 3 * cp, True, 1) == (cpp.LoadBalance.CONTIGUOUS, 1)  # no dual chunks of 3 cp
