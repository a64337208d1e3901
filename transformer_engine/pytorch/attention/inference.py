"""KV cache for inference: TransformerEngine's ``InferenceParams`` API on the project's attention backends.

A step of generation (prefill, chunked prefill, decode, or a batch mixing them) appends each sequence's new
keys and values to a per-layer cache and attends the step's queries to everything cached for their
sequence. Usage (``DotProductAttention(..., layer_number=n)`` for each layer)::

    params = InferenceParams(max_batch_size, max_sequence_length, num_heads_kv, head_dim_k, dtype)
    for n in layer_numbers:
        params.allocate_memory(n)
    for step in ...:
        params.pre_step(OrderedDict([(seq_id, num_new_tokens), ...]))  # batch order of the step
        out = dpa(q, k, v, inference_params=params)  # q, k, v: the new tokens only

Sequences that were cached but are not in a step's ``step_dict`` are finished: their slot or pages are freed.

How a step attends, and why its rows are the training forward's bits
---------------------------------------------------------------------
The step runs as one packed (thd) call of the module's own backend: the step's queries packed in rows,
each sequence's cached keys read in place from position 0 (``cu_seqlens_kv_padded`` gives where each
sequence starts in the cache), with bottom-right causal alignment (query ``i`` of ``n`` new tokens is
position ``cached + i`` of its sequence). A query row's arithmetic then matches the training forward's
row for the same position (causal over the whole sequence): the fused kernel computes each row from its
own sequence's keys in fixed key blocks from position 0 (the same tiles: they depend only on head dims,
dtype, mask kind and GPU), and the blocks a row visits in one call but not the other are entirely hidden
from it, which leaves the online-softmax state unchanged bit for bit (the maximum stays, the rescale is
exp2(0) = 1, and the added probabilities are zeros). The unfused backend keeps its fixed block products and
trailing-zero-invariant sums (``common/attention/reduction.py``). So a row's bits do not depend on the step
size (token by token, chunks, the whole prompt), on the other sequences of the step or on where the cache
keeps the tokens (slots, pages in any order).

Non-paged cache: ``[max_batch_size, max_sequence_length, h_kv, d]`` per layer; a sequence keeps one slot,
read in place (no copy). A decode step's call lists the sequences in step order, each with its slot's first
row; another step's lists them in increasing cache order (DotProductAttention's checks want increasing
``cu_seqlens_kv_padded``), its queries permuted into that order and the output back (the step's rows only).

Paged cache: ``[total_num_pages, page_size, h_kv, d]`` with a page table. Where the fused backend runs the
step and its paged plan is the gathered call's (``plan.pages_keep_bits``: the Triton forward with any page size,
Hopper's Gluon forward with the page sizes its loader follows), the forward reads
each key and value through the step's page table in place (``PagedKVCacheManager``'s
``step_page_table``: the step's sequences' pages in step order), with no copy and no permutation; a row's bits
are those of the same call on the pages gathered into contiguous rows. The other backends, and a step that
needs gradients (the fused backward reads no page table), get the gathered rows (a copy of every cached token
of the step's sequences per layer and step, padded to one of a few sizes per doubling), as does a custom cache
manager that is not a ``PagedKVCacheManager``.

No gradient flows into the cache: new keys and values are copied in without autograd history.

Host work of a step
-------------------
``pre_step`` builds the step's metadata on the host from ``step_dict`` (lengths, cu_seqlens, the new tokens'
cache rows, the kernel call's sequences, the page table's changed entries) and sends it to the device in one
non-blocking copy (``buffers.to_device``); every layer's call reuses it, and no step reads a tensor value
back (no sync; the value checks of its sequence tensors are skipped, ``config.sequences_checked_on_host``).
DotProductAttention sees the cache's capacity as ``max_seqlen_kv``, so its signature cache decides once for
all the steps of a batch; the backend then gets the step's own bound (:class:`_StepRun`), which the fused
backend rounds up within its key chunk (``kernel_runner.max_seqlen_kv_bound``: the same launches), so the
kernel runner's prepared launches serve every step until the longest sequence enters a new chunk. Tokens that
are a step tensor's first rows (a decode step's, a thd step's) are read and written in place, without an
index.

A decode step (every sequence one new token) reads its metadata from static buffers (:class:`_StepBuffers`)
that pre_step rewrites in place with one copy: every decode step of a batch size then makes the same calls on
the same tensors, so it can be traced (torch.compile, once per batch size) or captured in a CUDA graph and
replayed. Traced or captured, its call passes the cache's capacity as ``max_seqlen_kv`` and a paged cache's
whole step table (the kernels read each sequence's length from ``cu_seqlens_kv``); the bits are the same.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import math
import operator
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from transformer_engine.common.attention import AttnBiasType, AttnMaskType, FusedAttention, QKVFormat
from transformer_engine.common.attention.plan import pages_keep_bits
from transformer_engine.pytorch.attention import kernel_runner
from transformer_engine.pytorch.attention.buffers import host_values, to_device, unfilled
from transformer_engine.pytorch.attention.config import can_sync, sequences_checked_on_host

__all__ = ["InferenceParams", "KVCacheManager", "NonPagedKVCacheManager", "PagedKVCacheManager", "StepLayout",
           "active_step_runner", "step_runner"]

# The runner of the innermost step_runner block (a KV-cache step's call on its way to the backend), or None.
_STEP_RUNNER: contextvars.ContextVar = contextvars.ContextVar("transformer_engine_kv_cache_step_runner",
                                                              default=None)


@contextlib.contextmanager
def step_runner(runner):
    """Run the DotProductAttention calls made inside as a KV-cache step's: each call checks its arguments and
    selects its backend as any call does, then runs it as ``runner.run(backend, q, k, v, call)`` instead of
    ``backend.run(q, k, v, call)`` (``call``: the ``AttnCall`` it built).

    :func:`cached_attention` runs a step's packed call through ``DotProductAttention.forward`` in such a block:
    the call takes a plain call's path (checks, signature cache, selection) while the backend gets the step's
    own key bound and page table (:class:`_StepRun`). A call reads the runner in its forward, so a checkpointed
    call's recomputation in the backward runs with the same one; a call traced by torch.compile reads none.

    ``runner``: any object with that ``run`` method; it returns what ``backend.run`` would."""
    token = _STEP_RUNNER.set(runner)
    try:
        yield runner
    finally:
        _STEP_RUNNER.reset(token)


def active_step_runner():
    """The runner of the innermost :func:`step_runner` block, or None outside one."""
    return _STEP_RUNNER.get()


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _resolve_device(device: Optional[Union[str, torch.device]]) -> torch.device:
    """``device`` with its index: ``"cuda"`` means the current CUDA device, as tensors created on it report
    (``cuda:N``), so the cache's device compares equal to its inputs'. None (the default) is CUDA when
    available, else the CPU, as for the modules; an explicit CUDA device without CUDA is refused."""
    if device is None:
        return _default_device()
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"`device` must be an available device, got {device} but CUDA is not available "
                         "(pass device='cpu')")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _positive_int(name: str, value, allow_none: bool = False) -> Optional[int]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    return value


def _format_arg(value, name: str = "qkv_format") -> QKVFormat:
    try:
        return QKVFormat(value)
    except ValueError:
        raise ValueError(f"`{name}` must be one of 'bshd', 'sbhd', 'thd', got {value!r}") from None


@dataclass(frozen=True)
class StepLayout:
    """One step's sequences in the step's batch order (the order of ``step_dict``): their ids, how many new
    tokens each brings and how many it had cached before the step."""

    seq_ids: Tuple
    step_lens: Tuple[int, ...]
    cached_lens: Tuple[int, ...]

    # Computed once, at construction (every layer's call reads them). Plain attributes, not
    # functools.cached_property: its lock is a context manager that torch.compile cannot trace.
    batch_size: int = field(init=False, compare=False, repr=False)
    total_lens: Tuple[int, ...] = field(init=False, compare=False, repr=False)
    num_tokens: int = field(init=False, compare=False, repr=False)
    max_step_len: int = field(init=False, compare=False, repr=False)
    max_total_len: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        total = tuple(map(operator.add, self.cached_lens, self.step_lens))
        for name, value in (("batch_size", len(self.seq_ids)), ("total_lens", total),
                            ("num_tokens", sum(self.step_lens)), ("max_step_len", max(self.step_lens, default=0)),
                            ("max_total_len", max(total, default=0))):
            object.__setattr__(self, name, value)

    @classmethod
    def _decode(cls, seq_ids: Tuple, ones: Tuple[int, ...], totals: np.ndarray, max_total: int) -> "StepLayout":
        """The layout of a decode step (``ones``: a 1 per sequence; ``totals``: int64 token counts after the step,
        step order, the largest ``max_total``), its per-sequence tuples made when first read (:meth:`__getattr__`):
        a step whose calls run kept decode plans reads none."""
        layout = object.__new__(cls)
        for name, value in (("seq_ids", seq_ids), ("step_lens", ones), ("batch_size", len(seq_ids)),
                            ("num_tokens", len(seq_ids)), ("max_step_len", 1), ("max_total_len", max_total),
                            ("_totals", totals)):
            object.__setattr__(layout, name, value)
        return layout

    def __getattr__(self, name: str):
        # Only for what the instance lacks: a decode layout's cached_lens and total_lens, from its numpy totals.
        totals = self.__dict__.get("_totals")
        if totals is None or name not in ("cached_lens", "total_lens"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        value = tuple((totals if name == "total_lens" else totals - 1).tolist())
        object.__setattr__(self, name, value)
        return value

    def token_positions(self) -> Tuple[np.ndarray, np.ndarray]:
        """(each new token's sequence index in the step, its position in its sequence), int64, packed step order,
        in numpy passes (a prefill step has thousands of tokens)."""
        lens = np.fromiter(self.step_lens, np.int64, self.batch_size)
        first = np.fromiter(self.cached_lens, np.int64, self.batch_size) - (np.cumsum(lens) - lens)
        seq = np.repeat(np.arange(self.batch_size), lens)
        return seq, first[seq] + np.arange(lens.sum())


def _cumulative(lengths: Sequence[int]) -> List[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


class KVCacheManager:
    """Where a KV cache keeps each sequence's tokens. :class:`InferenceParams` keeps the steps' bookkeeping
    (checks, lengths, order) and calls these; a custom manager (``custom_cache_manager``) subclasses this and
    implements :meth:`allocate_memory`, :meth:`token_rows`, :meth:`keys_values` and, when it holds per-sequence
    state, :meth:`_check_room`, :meth:`_release` and :meth:`_reserve`.

    ``cache[layer_number]`` is the layer's ``(k_cache, v_cache)``; ``sequences`` maps each cached sequence id
    to its token count (after the current step's tokens)."""

    def __init__(self, max_batch_size: int, max_seqlen: int, num_heads: int, head_dim_k: int, dtype: torch.dtype,
                 head_dim_v: Optional[int] = None, device: Optional[torch.device] = None) -> None:
        self.max_batch_size = max_batch_size
        self.max_seqlen = max_seqlen
        self.num_heads = num_heads
        self.head_dim_k = head_dim_k
        self.head_dim_v = head_dim_v if head_dim_v is not None else head_dim_k
        self.dtype = dtype
        self.device = _resolve_device(device)
        self.cache: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.sequences: "OrderedDict[object, int]" = OrderedDict()

    # A decode step of the same sequences as the last (_next_decode_rows) grows each by one token: counted here
    # and added to ``sequences`` when it is read, so that such a step does no work per sequence on the host.
    @property
    def sequences(self) -> "OrderedDict[object, int]":
        if self._decode_steps:
            steps, self._decode_steps = self._decode_steps, 0
            for seq, n in self._sequences.items():
                self._sequences[seq] = n + steps
        return self._sequences

    @sequences.setter
    def sequences(self, value: "OrderedDict[object, int]") -> None:
        self._sequences, self._decode_steps = value, 0

    def reset(self) -> None:
        """Forget every sequence (the memory stays allocated)."""
        for seq in list(self.sequences):
            self._release(seq)
        self.sequences = OrderedDict()

    def allocate_memory(self, layer_number: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement allocate_memory")

    def pre_step(self, step_dict: Mapping) -> "OrderedDict[object, int]":
        """Free the sequences not in ``step_dict`` (finished), then grow the others and add the new ones by
        their counts. Raises (changing nothing) when the cache cannot hold the step."""
        keys = step_dict.keys()
        finished = [] if self.sequences.keys() <= keys else [seq for seq in self.sequences if seq not in keys]
        totals = OrderedDict(zip(keys, map(operator.add, map(self.sequences.get, keys, itertools.repeat(0)),
                                           step_dict.values())))
        self._check_room(finished, totals)
        for seq in finished:
            self._release(seq)
            del self.sequences[seq]
        self._reserve_all(totals)
        self.sequences.update(totals)  # cached sequences keep their place, new ones follow in step order
        return self.sequences

    def _reserve_all(self, totals: Mapping) -> None:
        """:meth:`_reserve` for every sequence of ``totals`` (in order)."""
        for seq, total in totals.items():
            self._reserve(seq, total)

    def _check_room(self, finished: List, totals: Mapping) -> None:
        """Raise ValueError when the cache cannot hold ``totals`` tokens per sequence once ``finished`` are freed."""

    def _release(self, seq) -> None:
        """Free what ``seq`` holds."""

    def _reserve(self, seq, total: int) -> None:
        """Make room for ``total`` tokens of ``seq``."""

    def token_rows(self, layout: StepLayout) -> torch.Tensor:
        """int64 ``[layout.num_tokens]``: the row of each new token (packed step order) in the layer caches
        viewed as ``[rows, h, d]``."""
        raise NotImplementedError(f"{type(self).__name__} must implement token_rows")

    def keys_values(self, layer_number: int, layout: StepLayout) -> Tuple[torch.Tensor, torch.Tensor, List[int]]:
        """``(k_rows [T, h, d_k], v_rows [T, h, d_v], starts)``: rows holding each step sequence's cached tokens
        contiguously from position 0, sequence ``i`` (step order) at rows ``starts[i]`` onwards."""
        raise NotImplementedError(f"{type(self).__name__} must implement keys_values")

    def step(self, layer_number: int, new_k: torch.Tensor, new_v: torch.Tensor, rows: torch.Tensor) -> None:
        """Copy the step's new tokens (``[num_tokens, h, d]``, packed step order) to ``rows`` of the layer's cache."""
        k_cache, v_cache = self.cache[layer_number]
        with torch.no_grad():  # no autograd history in the cache
            k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, rows, new_k)
            v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, rows, new_v)

    def _new_cache(self, rows: int, width: int) -> Tuple[torch.Tensor, torch.Tensor]:
        shape = (rows, width, self.num_heads)
        return (torch.zeros(shape + (self.head_dim_k,), dtype=self.dtype, device=self.device),
                torch.zeros(shape + (self.head_dim_v,), dtype=self.dtype, device=self.device))

    # What the built-in managers know on the host at pre_step, so that InferenceParams sends a step's metadata
    # to the device in one copy (no sync) and builds it once for every layer. A custom manager leaves these
    # alone: InferenceParams then calls token_rows and keys_values.

    def _host_token_rows(self, layout: StepLayout) -> Optional[List[int]]:
        """:meth:`token_rows` as a list, or None where only the tensor is known."""
        return None

    def _host_starts(self, layout: StepLayout) -> Optional[List[int]]:
        """The starts :meth:`keys_values` gives this step (every layer alike), or None where only it knows."""
        return None

    def _step_arrays(self, layout: StepLayout) -> Dict[str, Tuple[List[int], torch.dtype]]:
        """Host arrays the manager's own step work needs on the device (sent with the step's metadata)."""
        return {}

    def _take_step_arrays(self, layout: StepLayout, tensors: Mapping[str, torch.Tensor]) -> None:
        """:meth:`_step_arrays`' arrays on the device, by name."""

    def _decode_rows(self, layout: StepLayout, cached: np.ndarray) -> Optional[Dict[str, np.ndarray]]:
        """A decode step's metadata on the host (``cached``: each sequence's cached length, step order), by
        :class:`_StepBuffers` name: ``rows`` (each new token's cache row) and ``starts`` (non-paged) or
        ``table_rows`` (paged); None where only :meth:`token_rows` knows (a custom manager)."""
        return None

    def _take_decode(self, layout: StepLayout, views: "_DecodeViews", changes: torch.Tensor) -> None:
        """After :meth:`_decode_rows`' arrays reached the step buffers (``changes``: their (position, value)
        pairs): the manager's own device work."""

    def _next_decode_rows(self, seq_ids: Tuple, cached: np.ndarray) -> Optional[Dict[str, np.ndarray]]:
        """:meth:`_decode_rows` of a decode step of the sequences ``seq_ids`` (the last step's, in its order,
        each with one token more cached: ``cached``), with the bookkeeping of :meth:`pre_step` done (every
        sequence one token longer), from what the last step kept; None, changing nothing, where it cannot be
        done so (another manager, a step that needs pages the cache lacks): the caller takes the full path."""
        return None


class NonPagedKVCacheManager(KVCacheManager):
    """One slot of ``max_seqlen`` tokens per sequence: ``[max_batch_size, max_seqlen, h, d]`` per layer. A new
    sequence takes the lowest free slot and keeps it until it finishes; attention reads the slots in place."""

    def __init__(self, max_batch_size: int, max_seqlen: int, num_heads: int, head_dim_k: int, dtype: torch.dtype,
                 head_dim_v: Optional[int] = None, device: Optional[torch.device] = None) -> None:
        super().__init__(max_batch_size, max_seqlen, num_heads, head_dim_k, dtype, head_dim_v, device)
        self.slots: Dict[object, int] = {}
        self._starts = None  # (layout, starts) of the current step
        self._last_decode = None  # (seq_ids, starts, starts with the cache's end) of the last decode step

    def allocate_memory(self, layer_number: int) -> None:
        self.cache[layer_number] = self._new_cache(self.max_batch_size, self.max_seqlen)

    def _release(self, seq) -> None:
        self.slots.pop(seq, None)

    def reset(self) -> None:
        super().reset()
        self._last_decode = None

    def _reserve(self, seq, total: int) -> None:
        if seq not in self.slots:
            taken = set(self.slots.values())
            self.slots[seq] = next(s for s in range(self.max_batch_size) if s not in taken)

    def _reserve_all(self, totals: Mapping) -> None:
        if not totals.keys() <= self.slots.keys():  # new sequences take slots, in step order
            super()._reserve_all(totals)

    def _host_token_rows(self, layout: StepLayout) -> List[int]:
        seq, position = layout.token_positions()
        slots = np.fromiter(map(self.slots.__getitem__, layout.seq_ids), np.int64, layout.batch_size)
        return (slots[seq] * self.max_seqlen + position).tolist()

    def token_rows(self, layout: StepLayout) -> torch.Tensor:
        return torch.tensor(self._host_token_rows(layout), dtype=torch.int64, device=self.device)

    def _decode_rows(self, layout: StepLayout, cached: np.ndarray) -> Dict[str, np.ndarray]:
        starts = np.fromiter(map(self.slots.__getitem__, layout.seq_ids), np.int64, layout.batch_size)
        starts *= self.max_seqlen
        # starts[b]: the end of the cache (the kernels read a sequence's start and length only)
        ends = np.append(starts, self.max_batch_size * self.max_seqlen)
        self._last_decode = (layout.seq_ids, starts, ends)
        return dict(rows=starts + cached, starts=ends)

    def _next_decode_rows(self, seq_ids: Tuple, cached: np.ndarray) -> Optional[Dict[str, np.ndarray]]:
        last = self._last_decode
        if last is None or last[0] is not seq_ids:
            return None
        self._decode_steps += 1  # every sequence keeps its slot
        return dict(rows=last[1] + cached, starts=last[2])

    def _host_starts(self, layout: StepLayout) -> List[int]:
        if self._starts is None or self._starts[0] is not layout:
            self._starts = (layout, [self.slots[seq] * self.max_seqlen for seq in layout.seq_ids])
        return self._starts[1]

    def keys_values(self, layer_number: int, layout: StepLayout):
        k_cache, v_cache = self.cache[layer_number]
        return (k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:]),
                list(self._host_starts(layout)))


def _gather_size(pages: int) -> int:
    """Pages to gather for ``pages`` pages of a step's sequences: rounded up to one of 8 sizes per doubling (at
    most 1/8 more), so that a decoding batch's gathered rows keep their shape, and its calls their signature,
    over many steps."""
    granule = 1 << max(pages.bit_length() - 4, 0)
    return -(-pages // granule) * granule


class PagedKVCacheManager(KVCacheManager):
    """Pages of ``page_size`` tokens: ``[total_num_pages, page_size, h, d]`` per layer. A sequence takes pages
    from the front of ``free_pages`` as it grows and returns them when it finishes; ``page_table`` (int32
    ``[max_batch_size, max_seqlen // page_size]``, rows in ``sequences`` order, zeros where unused) lists each
    sequence's pages. Attention reads the pages in place through the step's page table, or gathers them into
    rows (:meth:`keys_values`: a copy).

    ``page_table`` changes on the device by the entries a step changes (new pages, rows that list another
    sequence), sent with the step's other metadata; the step's table is its rows, in step order."""

    def __init__(self, total_num_pages: int, page_size: int, num_heads: int, head_dim_k: int, dtype: torch.dtype,
                 max_batch_size: int, max_seqlen: int, head_dim_v: Optional[int] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__(max_batch_size, max_seqlen, num_heads, head_dim_k, dtype, head_dim_v, device)
        self.total_num_pages = total_num_pages
        self.page_size = page_size
        self.max_pages_per_seq = -(-max_seqlen // page_size)
        self.free_pages = list(range(total_num_pages))
        self.allocated_pages: Dict[object, List[int]] = {}
        self.page_table = torch.zeros(max_batch_size, self.max_pages_per_seq, dtype=torch.int32, device=self.device)
        # What page_table lists (its host copy): each row's sequence and how many of its pages.
        self._table_rows: List[object] = []
        self._table_counts = np.zeros(0, np.int64)
        self._host_table = np.zeros((max_batch_size, self.max_pages_per_seq), np.int64)  # page_table's values
        self._gather = None  # (layout, page index, starts) of the current step
        self._gather_positions = None  # (layout, offsets, counts): what the page index is made of, on the device
        self._step_table = None  # (layout, int32 page table of the step's sequences in step order)
        self._last_decode = None  # (seq_ids, each one's page-table row, each new token's row) of the last decode step
        self._step_table_kept = False  # the step buffers' table holds this decode step's table already

    def allocate_memory(self, layer_number: int) -> None:
        self.cache[layer_number] = self._new_cache(self.total_num_pages, self.page_size)

    # ``free_pages`` reads and assigns as a list whose front is taken first. Inside, taking pages moves a head
    # index (_free_head) instead of deleting the list's front, which would move every free page at every take.
    @property
    def free_pages(self) -> List[int]:
        if self._free_head:
            del self._free[:self._free_head]
            self._free_head = 0
        return self._free

    @free_pages.setter
    def free_pages(self, pages: List[int]) -> None:
        self._free, self._free_head = pages, 0

    def _free_count(self) -> int:
        return len(self._free) - self._free_head

    def _take_free(self, count: int) -> List[int]:
        """The first ``count`` free pages (there are that many), taken."""
        head = self._free_head
        pages = self._free[head:head + count]
        head += count
        if 2 * head > len(self._free):  # drop the taken front once it is half the list (amortized: O(1) a page)
            del self._free[:head]
            head = 0
        self._free_head = head
        return pages

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _page_counts(self, totals: Mapping) -> Tuple[np.ndarray, np.ndarray]:
        """(pages each sequence of ``totals`` holds, pages it needs for its total)."""
        n = len(totals)
        held = np.fromiter(map(len, map(self.allocated_pages.get, totals, itertools.repeat(()))), np.int64, n)
        want = -(-np.fromiter(totals.values(), np.int64, n) // self.page_size)
        return held, want

    def _check_room(self, finished: List, totals: Mapping) -> None:
        held, want = self._page_counts(totals)
        need = int(np.maximum(want - held, 0).sum())
        free = self._free_count() + sum(len(self.allocated_pages.get(seq, ())) for seq in finished)
        if need > free:
            raise ValueError(
                f"`step_dict` needs {need} more pages of {self.page_size} tokens than the sequences hold, but "
                f"{free} of `total_num_pages`={self.total_num_pages} are free: finish sequences (leave them out of "
                "step_dict) or allocate more pages")

    def _release(self, seq) -> None:
        self._free.extend(self.allocated_pages.pop(seq, []))

    def _reserve(self, seq, total: int) -> None:
        pages = self.allocated_pages.setdefault(seq, [])
        need = self.pages_for(total) - len(pages)
        if need > 0:
            pages.extend(self._take_free(need))

    def _reserve_all(self, totals: Mapping) -> None:
        held, want = self._page_counts(totals)
        grow = np.flatnonzero(want > held)
        if grow.size:  # only the sequences that enter a new page (in order)
            seqs, counts = list(totals), list(totals.values())
            for i in grow.tolist():
                self._reserve(seqs[i], counts[i])

    def reset(self) -> None:
        super().reset()
        self.page_table.zero_()
        self._table_rows, self._table_counts = [], np.zeros(0, np.int64)
        self._host_table[:] = 0
        self._gather = self._gather_positions = None
        self._step_table = None
        self._last_decode = None

    def get_page_list(self, seq) -> List[int]:
        return list(self.allocated_pages.get(seq, []))

    def _host_token_rows(self, layout: StepLayout) -> List[int]:
        seq, position = layout.token_positions()
        held = [self.allocated_pages[s] for s in layout.seq_ids]
        pages = np.fromiter(itertools.chain.from_iterable(held), np.int64)  # the step's sequences' pages, packed
        first_page = np.cumsum([0] + [len(p) for p in held[:-1]])
        page = pages[first_page[seq] + position // self.page_size]
        return (page * self.page_size + position % self.page_size).tolist()

    def token_rows(self, layout: StepLayout) -> torch.Tensor:
        return torch.tensor(self._host_token_rows(layout), dtype=torch.int64, device=self.device)

    def _table_changes(self) -> Tuple[List[int], List[int]]:
        """(flat positions, values) of the page table's entries that differ from what it lists (its host copy,
        updated): a row that lists the same sequence gets its new pages, another row is rewritten (zeros past
        its pages)."""
        width, index, values = self.max_pages_per_seq, [], []
        rows = list(self.sequences)
        counts = [len(self.allocated_pages[seq]) for seq in rows]
        listed_counts = self._table_counts.tolist()
        if rows == self._table_rows:  # a step of the same sequences: only their new pages
            for i, (seq, listed, count) in enumerate(zip(rows, listed_counts, counts)):
                if count != listed:
                    index.extend(range(i * width + listed, i * width + count))
                    values.extend(self.allocated_pages[seq][listed:])
        else:
            for i in range(max(len(rows), len(self._table_rows))):
                pages = self.allocated_pages[rows[i]] if i < len(rows) else ()
                listed = listed_counts[i] if i < len(self._table_rows) else 0
                first = listed if i < min(len(rows), len(self._table_rows)) and self._table_rows[i] == rows[i] else 0
                index.extend(range(i * width + first, i * width + len(pages)))
                values.extend(pages[first:])
                if listed > len(pages):
                    index.extend(range(i * width + len(pages), i * width + listed))
                    values.extend([0] * (listed - len(pages)))
        self._table_rows, self._table_counts = rows, np.array(counts, np.int64)
        if index:
            self._host_table.reshape(-1)[index] = values
        return index, values

    def _decode_rows(self, layout: StepLayout, cached: np.ndarray) -> Dict[str, np.ndarray]:
        index, values = self._table_changes()
        position = dict(zip(self._table_rows, range(len(self._table_rows))))
        table_rows = np.fromiter(map(position.__getitem__, layout.seq_ids), np.int64, layout.batch_size)
        pages = self._host_table[table_rows, cached // self.page_size]
        arrays = dict(rows=pages * self.page_size + cached % self.page_size, table_rows=table_rows)
        self._last_decode = (layout.seq_ids, table_rows, arrays["rows"])
        self._step_table_kept = False
        self._decode_changes = len(index)
        if len(index) > 2 * self.max_batch_size:  # more than the step buffers hold: a copy of their own
            self._decode_changes = to_device([(index, torch.int64), (values, torch.int64)], self.device)
        elif index:
            arrays["changes"] = np.stack([np.asarray(index, np.int64), np.asarray(values, np.int64)], axis=1)
        return arrays

    def _next_decode_rows(self, seq_ids: Tuple, cached: np.ndarray) -> Optional[Dict[str, np.ndarray]]:
        last = self._last_decode
        if last is None or last[0] is not seq_ids:
            return None
        table_rows, size = last[1], self.page_size
        # Each new token's row follows the last one's in its page, but where the cached tokens fill their pages:
        # such a sequence takes the next free page, in step order (as pre_step's _reserve_all gives them), and
        # its page-table row lists it next.
        rows = last[2] + 1
        grow = np.flatnonzero(cached % size == 0)
        arrays = {}
        if grow.size:
            if grow.size > self._free_count():
                return None
            new = self._take_free(grow.size)
            for i, page in zip(grow.tolist(), new):
                self.allocated_pages[seq_ids[i]].append(page)
            table_grown, columns, new = table_rows[grow], cached[grow] // size, np.asarray(new, np.int64)
            self._host_table[table_grown, columns] = new
            self._table_counts[table_grown] += 1  # rows are distinct
            arrays["changes"] = np.stack([table_grown * self.max_pages_per_seq + columns, new], axis=1)
            rows[grow] = new * size
        self._decode_changes = int(grow.size)
        # The last decode step (these sequences, this batch size) wrote the step table; no page taken, no change.
        self._step_table_kept = not grow.size
        self._decode_steps += 1
        self._last_decode = (seq_ids, table_rows, rows)
        arrays.update(rows=rows, table_rows=table_rows)
        return arrays

    def _take_decode(self, layout: StepLayout, views: "_DecodeViews", changes: torch.Tensor) -> None:
        if not isinstance(self._decode_changes, int):
            index, values = self._decode_changes
        elif self._decode_changes:
            index, values = changes[:self._decode_changes].unbind(1)
        if self._decode_changes:
            self.page_table.view(-1).index_copy_(0, index, values.to(torch.int32))
        if not self._step_table_kept:
            torch.index_select(self.page_table, 0, views.table_rows, out=views.table)
        self._step_table = (layout, views.table)
        self._gather = self._gather_positions = None

    def _step_arrays(self, layout: StepLayout) -> Dict[str, Tuple[List[int], torch.dtype]]:
        index, values = self._table_changes()
        arrays = {}
        if index:
            arrays.update(table_index=(index, torch.int64), table_values=(values, torch.int32))
        position = {seq: i for i, seq in enumerate(self._table_rows)}
        rows = [position[seq] for seq in layout.seq_ids]
        if rows != list(range(len(rows))):
            arrays["step_rows"] = (rows, torch.int32)
        arrays.update(zip(("gather_offsets", "gather_counts"), self._gather_arrays(layout)))
        return arrays

    def _take_step_arrays(self, layout: StepLayout, tensors: Mapping[str, torch.Tensor]) -> None:
        if "table_index" in tensors:
            self.page_table.view(-1).index_copy_(0, tensors["table_index"], tensors["table_values"])
        rows = tensors.get("step_rows")
        table = self.page_table[:layout.batch_size] if rows is None else self.page_table.index_select(0, rows)
        self._step_table = (layout, table)
        self._gather_positions = (layout, tensors["gather_offsets"], tensors["gather_counts"])
        self._gather = None

    def step_page_table(self, layout: StepLayout) -> torch.Tensor:
        """int32 ``[batch, max_pages_per_seq]``: the pages of each step sequence (step order), zeros past them;
        what the fused forward reads K/V through (``page_table``'s rows, made at pre_step)."""
        if self._step_table is None or self._step_table[0] is not layout:
            table = torch.zeros(layout.batch_size, self.max_pages_per_seq, dtype=torch.int32)
            for i, (seq, total) in enumerate(zip(layout.seq_ids, layout.total_lens)):
                pages = self.allocated_pages[seq][:self.pages_for(total)]
                table[i, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
            self._step_table = (layout, table.to(self.device))
        return self._step_table[1]

    def _gather_arrays(self, layout: StepLayout) -> Tuple[Tuple[List[int], torch.dtype], ...]:
        """What :meth:`gather_index` reads on the device: each step sequence's offset from its packed pages to
        its row of the step's page table (``i * width - first page``) and its page count."""
        counts = [self.pages_for(total) for total in layout.total_lens]
        firsts = _cumulative(counts)
        offsets = [i * self.max_pages_per_seq - first for i, first in enumerate(firsts[:-1])]
        return (offsets, torch.int64), (counts, torch.int64)

    def _host_starts(self, layout: StepLayout) -> List[int]:
        firsts = _cumulative([self.pages_for(total) for total in layout.total_lens])
        return [first * self.page_size for first in firsts[:-1]]

    def gather_index(self, layout: StepLayout) -> Tuple[torch.Tensor, List[int]]:
        """(the pages to gather: the step sequences' pages packed in step order, then page 0 up to
        :func:`_gather_size`; the first row of each sequence in the gathered rows), made on the device from the
        step's page table at the step's first gathering layer (no host work per page) and reused by the
        others."""
        if self._gather is None or self._gather[0] is not layout:
            if self._gather_positions is None or self._gather_positions[0] is not layout:
                self._gather_positions = (layout, *to_device(self._gather_arrays(layout), self.device))
            _, offsets, counts = self._gather_positions
            pages = sum(self.pages_for(total) for total in layout.total_lens)
            # Packed page j of sequence i is entry j + offsets[i] of the flattened step table.
            position = torch.arange(pages, device=self.device) + torch.repeat_interleave(offsets, counts,
                                                                                        output_size=pages)
            index = self.step_page_table(layout).reshape(-1).index_select(0, position)
            index = torch.nn.functional.pad(index, (0, _gather_size(pages) - pages))
            self._gather = (layout, index, self._host_starts(layout))
        return self._gather[1], list(self._gather[2])

    def cache_rows(self, layer_number: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_number``'s caches as rows ``[total_num_pages * page_size, h, d]`` (page p's row r at
        p * page_size + r): what the fused forward reads through the page table."""
        k_cache, v_cache = self.cache[layer_number]
        return k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])

    def keys_values(self, layer_number: int, layout: StepLayout):
        """The step sequences' pages gathered in step order (:meth:`gather_index`: the rows past the last
        sequence's pages are page 0's, never read)."""
        k_cache, v_cache = self.cache[layer_number]
        index, starts = self.gather_index(layout)
        k_rows = k_cache.index_select(0, index).view(-1, *k_cache.shape[2:])
        v_rows = v_cache.index_select(0, index).view(-1, *v_cache.shape[2:])
        return k_rows, v_rows, starts


@dataclass
class _Step:
    """What a step computes once and every layer reuses."""

    layout: StepLayout
    rows: torch.Tensor  # cache row of each new token (token_rows)
    cu_seqlens_q: torch.Tensor  # int32 [b + 1], step order
    cu_seqlens_kv: torch.Tensor
    stepped: set = field(default_factory=set)  # layers that took their step
    # Where the new tokens are in a step tensor, by (format, input shape, sequence order): None where they are its
    # first rows in that order, else an int64 index.
    token_index: Dict[tuple, Optional[torch.Tensor]] = field(default_factory=dict)
    calls: Dict[object, dict] = field(default_factory=dict)  # the kernel call's sequences, by cache starts
    backend_params: Dict[tuple, tuple] = field(default_factory=dict)  # _StepRun's, by (backend, params)
    orders: Dict[tuple, torch.Tensor] = field(default_factory=dict)  # a sequence order as an int64 index
    decode: Optional[_DecodeViews] = None  # a decode step's metadata in the step buffers
    last_run: Optional[tuple] = None  # the last _StepRun's (backend, max_seqlen_kv bound, key chunk, in place)


@dataclass(frozen=True)
class _DecodeViews:
    """A decode step's metadata for batch size ``b``: views of :class:`_StepBuffers`, the same tensors (same
    addresses) at every step of that batch size."""

    cu_seqlens_q: torch.Tensor  # int32 [b + 1]
    cu_seqlens_kv: torch.Tensor  # int32 [b + 1]
    starts: torch.Tensor  # int32 [b + 1]: each sequence's first cached row (non-paged)
    rows: torch.Tensor  # int64 [b]: each new token's cache row
    table_rows: torch.Tensor  # int64 [b]: each sequence's row of the page table (paged)
    table: Optional[torch.Tensor]  # int32 [b, max pages]: the step's page table, step order (paged)
    gather_starts: Optional[torch.Tensor]  # int32 [b + 1]: i * max_sequence_length (paged, gathered)
    lens_kv: torch.Tensor  # int32 [b]: each sequence's keys after the step
    ones: torch.Tensor  # int32 [b]: ones (each sequence's new tokens)


class _StepBuffers:
    """The step metadata the calls read, in one static device buffer that ``pre_step`` rewrites in place with
    one copy: TransformerEngine's ``cu_seqlens_q``, ``cu_seqlens_kv`` (``[max_batch_size + 1]``, the last value
    repeated past the step's sequences) and ``pre_step_seqlens``, and a decode step's (every sequence one new
    token) cache rows, starts, page-table rows and the kernels' per-sequence lengths (:class:`_DecodeViews`);
    a paged cache's step page table beside it. A decode step's calls then read the same tensors at every step of a batch size: traced or
    captured once, replayed at any step (lengths are read on the device)."""

    def __init__(self, max_batch_size: int, device: torch.device, table_width: int = 0, seqlen: int = 0) -> None:
        n = self.n = max_batch_size
        self.width = width = -(-(n + 1) // 4) * 4  # int32 entries per array: each at a 16-byte boundary
        # Six int32 arrays: cu_q, cu_kv, cached, starts, each sequence's keys (the kernels' lengths) and ones (a
        # decode step's query lengths, never rewritten). Then a paged cache's page-table changes, (flat
        # position, page) pairs: a decode step's new pages fit.
        self.changes_at, self.max_changes = 2 * n + 3 * width, 2 * n if table_width else 0
        self.raw = torch.zeros(self.changes_at + 2 * self.max_changes, dtype=torch.int64, device=device)
        self.changes = self.raw[self.changes_at:].view(-1, 2)
        self.host = np.zeros(self.raw.shape[0], np.int64)
        self.host32 = self.host[2 * n:].view(np.int32)
        self.host32[5 * width:5 * width + n] = 1
        i32 = self.raw[2 * n:].view(torch.int32)
        self.cu_q, self.cu_kv, self.cached, self.starts, self.lens_kv, self.ones = (
            i32[j * width:j * width + n + 1] for j in range(6))
        self.cached, self.lens_kv, self.ones = self.cached[:n], self.lens_kv[:n], self.ones[:n]
        self.rows, self.table_rows = self.raw[:n], self.raw[n:2 * n]
        self.table = torch.zeros(n, table_width, dtype=torch.int32, device=device) if table_width else None
        self.gather_starts = (torch.arange(n + 1, dtype=torch.int32, device=device) * seqlen) if table_width else None
        self.views: Dict[int, _DecodeViews] = {}

    def decode_views(self, b: int) -> _DecodeViews:
        if b not in self.views:
            self.views[b] = _DecodeViews(self.cu_q[:b + 1], self.cu_kv[:b + 1], self.starts[:b + 1], self.rows[:b],
                                         self.table_rows[:b], None if self.table is None else self.table[:b],
                                         None if self.table is None else self.gather_starts[:b + 1],
                                         self.lens_kv[:b], self.ones[:b])
        return self.views[b]

    def write(self, step_lens: np.ndarray, cached: np.ndarray, decode: Optional[Dict[str, np.ndarray]]) -> None:
        """Rewrite the buffer: the TransformerEngine tensors from the step's new and cached lengths (step order),
        and a decode step's arrays by name (``rows``, ``starts``, ``table_rows``, ``changes``: at most
        ``max_changes`` pairs)."""
        n, width, b = self.n, self.width, step_lens.shape[0]
        h32 = self.host32
        for j, lens in enumerate((step_lens, step_lens + cached)):
            cu = h32[j * width:j * width + n + 1]
            np.cumsum(lens, out=cu[1:b + 1])
            cu[b + 1:] = cu[b]
        cached_view = h32[2 * width:2 * width + n]
        cached_view[:b] = cached
        cached_view[b:] = 0
        lens_view = h32[4 * width:4 * width + n]
        np.add(step_lens, cached, out=lens_view[:b], casting="unsafe")
        lens_view[b:] = 0
        if decode is not None:
            self.host[:b] = decode["rows"]
            if "starts" in decode:
                h32[3 * width:3 * width + b + 1] = decode["starts"]
            if "table_rows" in decode:
                self.host[n:n + b] = decode["table_rows"]
        self._upload(decode.get("changes") if decode is not None else None)

    def write_continued(self, cached: np.ndarray, totals: np.ndarray, decode: Dict[str, np.ndarray]) -> None:
        """:meth:`write` of a decode step that continues the last write's (the same sequences, one token each;
        ``totals``: ``cached + 1``): what changes only. The query offsets, the starts or page-table rows and the
        zeros past the batch hold the last write's values, which are this step's."""
        n, width, b = self.n, self.width, cached.shape[0]
        h32 = self.host32
        cu_kv = h32[width:width + n + 1]
        np.cumsum(totals, out=cu_kv[1:b + 1])
        cu_kv[b + 1:] = cu_kv[b]
        h32[2 * width:2 * width + b] = cached
        h32[4 * width:4 * width + b] = totals
        self.host[:b] = decode["rows"]
        self._upload(decode.get("changes"))

    def _upload(self, changes: Optional[np.ndarray]) -> None:
        """Send the buffer (and ``changes``, (position, value) pairs) to the device."""
        end = self.changes_at
        if changes is not None:
            end += changes.size
            self.host[self.changes_at:end] = changes.reshape(-1)
        _upload(self.raw[:end], torch.from_numpy(self.host[:end]))


class _DecodeChain:
    """A decode step's sequence ids and arrays, which the next pre_step continues from when it gets a step of the
    same sequences in the same order, one token each (:meth:`InferenceParams._continue_decode`)."""

    __slots__ = ("seq_ids", "ones", "totals", "max_total")

    def __init__(self, seq_ids: Tuple, ones: Tuple[int, ...], totals: np.ndarray, max_total: int) -> None:
        self.seq_ids, self.ones, self.totals, self.max_total = seq_ids, ones, totals, max_total

    def continued_by(self, step_dict: Mapping) -> bool:
        """Whether ``step_dict`` (a dict or OrderedDict) lists this step's sequences in its order, each with the int
        1 (C-level passes, no Python per sequence)."""
        if type(step_dict) not in (dict, OrderedDict) or len(step_dict) != len(self.seq_ids):
            return False
        # Keys in order, and every count the int 1 itself (== would take True and 1.0, which the full path refuses).
        # The counts are read in the dict's storage order (dict.values): an OrderedDict's own values() looks up
        # every key, and whether all are 1 does not depend on the order.
        return tuple(step_dict) == self.seq_ids and all(map(operator.is_, dict.values(step_dict), self.ones))


def _upload(device_buffer: torch.Tensor, host: torch.Tensor) -> None:
    """``device_buffer.copy_(host)``: from pinned memory on CUDA, so that the copy does not wait for the device."""
    if device_buffer.device.type == "cuda":
        device_buffer.copy_(host.pin_memory(), non_blocking=True)
    else:
        device_buffer.copy_(host)


class InferenceParams:
    """KV caching for inference, TransformerEngine's API (module docstring: how a step attends).

    Arguments:

    ``max_batch_size``
        Most sequences in the cache (and in one step).
    ``max_sequence_length``
        Most tokens of one sequence (prompt and generated).
    ``num_heads_kv``, ``head_dim_k``, ``head_dim_v`` (default ``head_dim_k``)
        Key/value heads (per tensor-parallel rank) and the key and value head sizes.
    ``dtype``
        The cache's dtype; the step's keys and values must have it.
    ``is_paged`` (default False), ``page_size``, ``total_num_pages``
        A paged cache (pages of ``page_size`` tokens, which must divide ``max_sequence_length``, and a
        page table) instead of one slot per sequence; ``total_num_pages`` defaults to
        ``max_batch_size * max_sequence_length / page_size``.
    ``max_ctx_len`` (default None)
        Most new tokens of one sequence in one step, when given (checked by :meth:`pre_step`).
    ``qkv_format`` (default "bshd")
        The format of the step's new q/k/v tensors ("bshd", "sbhd", "thd"); the module's forward
        ``qkv_format`` decides per call.
    ``custom_cache_manager`` (default None)
        A :class:`KVCacheManager` subclass, built with the non-paged or paged manager's arguments instead.
    ``device`` (default the current CUDA device, else CPU)
        Where the cache lives (not a TransformerEngine argument).
    """

    def __init__(
        self,
        max_batch_size: int,
        max_sequence_length: int,
        num_heads_kv: Optional[int] = None,
        head_dim_k: Optional[int] = None,
        dtype: Optional[torch.dtype] = None,
        head_dim_v: Optional[int] = None,
        is_paged: bool = False,
        total_num_pages: Optional[int] = None,
        page_size: Optional[int] = None,
        max_ctx_len: Optional[int] = None,
        qkv_format: str = "bshd",
        custom_cache_manager: Optional[type] = None,
        device: Optional[torch.device] = None,
    ) -> None:
        self.max_batch_size = _positive_int("max_batch_size", max_batch_size)
        self.max_sequence_length = _positive_int("max_sequence_length", max_sequence_length)
        self.num_heads_kv = _positive_int("num_heads_kv", num_heads_kv)
        self.head_dim_k = _positive_int("head_dim_k", head_dim_k)
        self.head_dim_v = _positive_int("head_dim_v", head_dim_v if head_dim_v is not None else head_dim_k)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"`dtype` must be a floating-point torch.dtype, got {dtype!r}")
        self.dtype = dtype
        self.is_paged = bool(is_paged)
        self.max_ctx_len = _positive_int("max_ctx_len", max_ctx_len, allow_none=True)
        if self.max_ctx_len is not None and self.max_ctx_len > self.max_sequence_length:
            raise ValueError(f"`max_ctx_len` must be at most max_sequence_length={self.max_sequence_length}, "
                             f"got {max_ctx_len}")
        self.input_qkv_format = _format_arg(qkv_format).value
        self.cache_qkv_format = "bshd"
        self.device = _resolve_device(device)
        if custom_cache_manager is not None and not (isinstance(custom_cache_manager, type)
                                                     and issubclass(custom_cache_manager, KVCacheManager)):
            raise ValueError(f"`custom_cache_manager` must be a KVCacheManager subclass, got {custom_cache_manager!r}")
        heads = dict(num_heads=self.num_heads_kv, head_dim_k=self.head_dim_k, dtype=dtype, head_dim_v=self.head_dim_v,
                     device=self.device)
        if self.is_paged:
            self.page_size = _positive_int("page_size", page_size)
            if self.max_sequence_length % self.page_size:
                raise ValueError(f"`page_size` must divide max_sequence_length={self.max_sequence_length}, "
                                 f"got {page_size}")
            if total_num_pages is None:
                total_num_pages = self.max_batch_size * (self.max_sequence_length // self.page_size)
            self.total_num_pages = _positive_int("total_num_pages", total_num_pages)
            manager = custom_cache_manager or PagedKVCacheManager
            self.cache_manager = manager(total_num_pages=self.total_num_pages, page_size=self.page_size,
                                         max_batch_size=self.max_batch_size, max_seqlen=self.max_sequence_length,
                                         **heads)
        else:
            self.page_size = page_size
            self.total_num_pages = total_num_pages
            manager = custom_cache_manager or NonPagedKVCacheManager
            self.cache_manager = manager(max_batch_size=self.max_batch_size, max_seqlen=self.max_sequence_length,
                                         **heads)
        # TransformerEngine's step tensors and a decode step's metadata: views of one static buffer.
        paged = isinstance(self.cache_manager, PagedKVCacheManager)
        self._buffers = _StepBuffers(self.max_batch_size, self.device,
                                     self.cache_manager.max_pages_per_seq if paged else 0, self.max_sequence_length)
        self.cu_seqlens_q = self._buffers.cu_q
        self.cu_seqlens_kv = self._buffers.cu_kv
        self.pre_step_seqlens = self._buffers.cached
        self._step: Optional[_Step] = None
        self._backend_choices: Dict[tuple, Tuple[bool, int]] = {}  # _StepRun's, for every step
        self._chain: Optional[_DecodeChain] = None  # the last decode step's, while the next may continue it
        self._decode_plans: Dict[tuple, _DecodePlan] = {}  # by (module's call signature, layer, batch size)

    @property
    def batch_size(self) -> int:
        return self._step.layout.batch_size if self._step is not None else 0

    @property
    def sequences(self) -> "OrderedDict[object, int]":
        """The step's sequences (step order) -> their token counts after the step (a new mapping per read)."""
        layout = self._step.layout if self._step is not None else StepLayout((), (), ())
        return OrderedDict(zip(layout.seq_ids, layout.total_lens))

    @property
    def sequences_pre_step(self) -> "OrderedDict[object, int]":
        """The step's sequences (step order) -> their token counts before the step (a new mapping per read)."""
        layout = self._step.layout if self._step is not None else StepLayout((), (), ())
        return OrderedDict(zip(layout.seq_ids, layout.cached_lens))

    @property
    def output_qkv_format(self) -> str:
        fmt = self.input_qkv_format
        return fmt if fmt == self.cache_qkv_format else f"{fmt}_2{self.cache_qkv_format}"

    def __repr__(self) -> str:
        where = (f"is_paged=True, total_pages={self.total_num_pages}, page_size={self.page_size}" if self.is_paged
                 else f"is_paged=False, max_batch_size={self.max_batch_size}")
        return (f"InferenceParams(dtype={self.dtype}, {where}, max_seqlen={self.max_sequence_length}, "
                f"num_heads={self.num_heads_kv}, head_dim_k={self.head_dim_k}, head_dim_v={self.head_dim_v})")

    def reset(self) -> None:
        """Forget every sequence (the caches stay allocated)."""
        self.cache_manager.reset()
        self._step = None
        self._chain = None

    def allocate_memory(self, layer_number: int) -> None:
        """Allocate layer ``layer_number``'s caches: ``[max_batch_size, max_sequence_length, h_kv, d]``
        (non-paged) or ``[total_num_pages, page_size, h_kv, d]`` (paged), for keys and for values."""
        if isinstance(layer_number, bool) or not isinstance(layer_number, int):
            raise ValueError(f"`layer_number` must be an int, got {layer_number!r}")
        self.cache_manager.allocate_memory(layer_number)

    # -- steps -----------------------------------------------------------------------------------

    def pre_step(self, step_dict: Mapping) -> None:
        """Start a step: ``step_dict`` maps each sequence id of the step, in the step's batch order, to its
        number of new tokens (>= 1). Cached sequences left out are finished and freed; ids not cached yet
        start new sequences. Raises ValueError, changing nothing, when the step does not fit.

        The step's metadata (lengths, cache rows, page table changes) is built on the host from ``step_dict``
        and sent to the device in one non-blocking copy: no sync; the layers' calls reuse it."""
        if not isinstance(step_dict, Mapping) or not step_dict:
            raise ValueError(f"`step_dict` must be a non-empty mapping of sequence id -> new token count, "
                             f"got {step_dict!r}")
        if len(step_dict) > self.max_batch_size:
            raise ValueError(f"`step_dict` must hold at most max_batch_size={self.max_batch_size} sequences, "
                             f"got {len(step_dict)}")
        chain = self._chain
        if chain is not None and chain.continued_by(step_dict) and self._continue_decode(chain):
            return
        self._chain = None
        cached = self.cache_manager.sequences
        seq_ids, counts = tuple(step_dict), tuple(step_dict.values())
        b = len(seq_ids)
        before = np.fromiter(map(cached.get, seq_ids, itertools.repeat(0, b)), np.int64, b)
        lens = np.array(counts, np.int64) if set(map(type, counts)) == {int} else None
        if (lens is None or lens.min() < 1 or (self.max_ctx_len is not None and lens.max() > self.max_ctx_len)
                or (lens + before).max() > self.max_sequence_length):
            self._check_step_dict(step_dict, cached)
        layout = StepLayout(seq_ids, counts, tuple(before.tolist()))
        manager = self.cache_manager
        manager.pre_step(step_dict)
        decode = manager._decode_rows(layout, before) if lens.max() == 1 else None
        self._buffers.write(lens, before, decode)
        if decode is not None:  # the step buffers' views: the same tensors at every decode step of this size
            self._take_decode(layout)
            self._chain = _DecodeChain(seq_ids, counts, before + lens, layout.max_total_len)
            return
        arrays = {"cu_q": (_cumulative(layout.step_lens), torch.int32),
                  "cu_kv": (_cumulative(layout.total_lens), torch.int32)}
        rows = manager._host_token_rows(layout)
        if rows is not None:
            arrays["rows"] = (rows, torch.int64)
        starts = manager._host_starts(layout)
        if starts is not None:  # the kernel call of every layer (_kernel_call), sent now
            order, call_arrays = _cache_order(layout, starts)
            arrays.update(call_arrays)
        arrays.update({("manager", name): array for name, array in manager._step_arrays(layout).items()})
        tensors = dict(zip(arrays, to_device(list(arrays.values()), self.device)))
        self._step = step = _Step(layout, tensors["rows"] if rows is not None else manager.token_rows(layout),
                                  tensors["cu_q"], tensors["cu_kv"])
        if starts is not None:
            step.calls[tuple(starts)] = _sequence_call(step, order, tensors)
        manager._take_step_arrays(layout, {name[1]: t for name, t in tensors.items() if isinstance(name, tuple)})

    def _take_decode(self, layout: StepLayout) -> None:
        views = self._buffers.decode_views(layout.batch_size)
        self._step = _Step(layout, views.rows, views.cu_seqlens_q, views.cu_seqlens_kv, decode=views)
        self.cache_manager._take_decode(layout, views, self._buffers.changes)

    def _continue_decode(self, chain: "_DecodeChain") -> bool:
        """pre_step of a decode step of the last decode step's sequences in its order (``chain``): what the full
        path computes per sequence, from the last step's arrays (the same values); False, changing nothing,
        where the full path must decide (a sequence at max_sequence_length, pages the cache lacks)."""
        before = chain.totals
        if chain.max_total >= self.max_sequence_length:
            return False
        decode = self.cache_manager._next_decode_rows(chain.seq_ids, before)
        if decode is None:
            return False
        totals = before + 1
        self._buffers.write_continued(before, totals, decode)
        layout = StepLayout._decode(chain.seq_ids, chain.ones, totals, chain.max_total + 1)
        self._take_decode(layout)
        chain.totals, chain.max_total = totals, layout.max_total_len
        return True

    def _keep_decode_plan(self, key: tuple, module, fmt: QKVFormat, q: torch.Tensor, q_rows: torch.Tensor,
                          call: dict, recorded: List[tuple]) -> None:
        """Keep the decode step's kernel call just made (``recorded``: kernel_runner's (entry, buffers)) as the
        :class:`_DecodePlan` of its module call signature ``key``, layer and batch size, where it launched on
        the step buffers' tensors alone (besides q, out and their scratch)."""
        step = self._step
        if len(recorded) != 1 or step.last_run is None:
            return
        entry, buffers = recorded[0]
        if (buffers["q"] is not q_rows or buffers["k"] is not call["k"] or buffers["v"] is not call["v"]
                or not buffers.keys() <= _PLAN_BUFFERS):
            return  # q scaled, gathered keys, a score modifier's tensor: the full path each step
        backend, bound, chunk, in_place = step.last_run
        views = step.decode
        b = step.layout.batch_size
        # What kernel_runner.sequences gives this call, as the step buffers' views that pre_step rewrites: the
        # packed starts of q (cu_seqlens_q) and of the keys (each sequence's slot; in place in a paged cache,
        # cu_seqlens_kv), and the lengths.
        starts_k = views.cu_seqlens_kv if in_place else call["cu_seqlens_kv_padded"]
        fixed = {name: t for name, t in buffers.items() if name not in _PLAN_PER_CALL}
        fixed.update(seq_start_q=views.cu_seqlens_q[:b], seq_start_k=starts_k[:b], seq_len_q=views.ones,
                     seq_len_k=views.lens_kv)
        if len(self._decode_plans) >= 64:  # bounded: one plan per layer and batch size in use
            self._decode_plans.clear()
        self._decode_plans[(key, module.layer_number, b)] = _DecodePlan(
            self.cache_manager.cache[module.layer_number], fmt.value, backend.NAME, bound, chunk, entry.launches,
            entry.workspace, fixed, tuple(buffers["out"].shape), tuple(buffers["lse"].shape), q.shape[-2] * call["v"].shape[-1])

    def decode_from_plan(self, module, signature: tuple, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor) -> Optional[torch.Tensor]:
        """A decode step's attention output for ``module`` (a DotProductAttention) from the kernel call kept at an
        earlier decode step of the same layer, batch size and call ``signature`` (the module's key of everything
        its checks and backend selection read; :class:`_DecodePlan`): appends ``k``, ``v`` to the layer's cache
        and launches that call on ``q``, deciding nothing again. None, changing nothing, where no plan serves
        the step (not a decode step, no plan kept, a new key bound, gradients, capture): the module then runs
        the step's full path, which keeps a plan for the next steps. The output is the full path's, bitwise."""
        step = self._step
        if step is None or step.decode is None:
            return None
        plan = self._decode_plans.get((signature, module.layer_number, step.layout.batch_size))
        return None if plan is None else plan.run(self, step, module, q, k, v)

    def _check_step_dict(self, step_dict: Mapping, cached: Mapping) -> None:
        """Raise the ValueError that names the first sequence of ``step_dict`` the cache cannot take."""
        for seq, n in step_dict.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"`step_dict` must map sequence ids to positive int token counts, got {n!r} "
                                 f"for sequence {seq!r}")
            if self.max_ctx_len is not None and n > self.max_ctx_len:
                raise ValueError(f"`step_dict` gives sequence {seq!r} {n} new tokens, more than "
                                 f"max_ctx_len={self.max_ctx_len}")
            total = cached.get(seq, 0) + n
            if total > self.max_sequence_length:
                raise ValueError(f"`step_dict` would grow sequence {seq!r} to {total} tokens, more than "
                                 f"max_sequence_length={self.max_sequence_length}")

    def get_seqlens_pre_step(self) -> torch.Tensor:
        """int32 ``[max_batch_size]``: each step sequence's cached length before the step (step order;
        e.g. for rotary position offsets)."""
        return self.pre_step_seqlens

    def _current(self) -> _Step:
        if self._step is None:
            raise ValueError("`inference_params` has no step: call pre_step(step_dict) before the forward")
        return self._step

    def _check_layer(self, layer_number) -> None:
        if layer_number not in self.cache_manager.cache:
            allocated = sorted(self.cache_manager.cache)
            raise ValueError(f"`layer_number` {layer_number!r} has no KV cache (allocated: {allocated}): call "
                             f"inference_params.allocate_memory({layer_number!r}) first")

    def token_index(self, fmt: QKVFormat, shape: Tuple[int, ...], name: str = "query_layer") -> torch.Tensor:
        """int64 ``[num_tokens]``: where each new token (packed step order) is among the rows of a step tensor
        of ``shape`` in ``fmt`` flattened to ``[rows, h, d]`` (``[b * s]`` bshd, ``[s * b]`` sbhd, ``[t]`` thd)."""
        index = self._token_index(fmt, shape, name)
        if index is None:
            return torch.arange(self._current().layout.num_tokens, dtype=torch.int64, device=self.device)
        return index

    def _token_index(self, fmt: QKVFormat, shape: Tuple[int, ...], name: str,
                     order: Optional[Tuple[int, ...]] = None) -> Optional[torch.Tensor]:
        """:meth:`token_index` with the step's sequences in ``order`` (None: step order), or None where the
        tokens are the tensor's first rows in that order (a decode step's tokens in any format, a thd step's):
        made once per step, format, shape and order (one host-to-device copy, no sync)."""
        step = self._current()
        key = (fmt, tuple(shape[:-2]), order)
        if key not in step.token_index:
            index = self._host_token_index(step.layout, fmt, shape, name)
            if order is not None:
                firsts, lens = _cumulative(step.layout.step_lens), step.layout.step_lens
                index = [x for i in order for x in index[firsts[i]:firsts[i] + lens[i]]]
            if index == list(range(len(index))):
                step.token_index[key] = None
            else:
                step.token_index[key] = to_device([(index, torch.int64)], self.device)[0]
        return step.token_index[key]

    @staticmethod
    def _host_token_index(layout: StepLayout, fmt: QKVFormat, shape: Tuple[int, ...], name: str) -> List[int]:
        if fmt == QKVFormat.THD:
            if shape[0] < layout.num_tokens:
                raise ValueError(f"`{name}` must hold the step's {layout.num_tokens} new tokens (step_dict), got "
                                 f"shape {tuple(shape)}")
            return list(range(layout.num_tokens))
        b, s = (shape[0], shape[1]) if fmt == QKVFormat.BSHD else (shape[1], shape[0])
        if b != layout.batch_size or s < layout.max_step_len:
            raise ValueError(
                f"`{name}` must be [b, s, h, d] ({fmt.value}) with b = {layout.batch_size} sequences and s >= "
                f"{layout.max_step_len} new tokens (step_dict), got shape {tuple(shape)}")
        if fmt == QKVFormat.BSHD:
            return [i * s + j for i, n in enumerate(layout.step_lens) for j in range(n)]
        return [j * b + i for i, n in enumerate(layout.step_lens) for j in range(n)]

    def _order_index(self, order: Tuple[int, ...]) -> torch.Tensor:
        """``order`` as an int64 index on the cache's device (once per step)."""
        step = self._current()
        if order not in step.orders:
            step.orders[order] = to_device([(list(order), torch.int64)], self.device)[0]
        return step.orders[order]

    def _check_new(self, name: str, t: torch.Tensor, fmt: QKVFormat, head_dim: int) -> None:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
        rank = 3 if fmt == QKVFormat.THD else 4
        if t.dim() != rank or t.shape[-2] != self.num_heads_kv or t.shape[-1] != head_dim:
            raise ValueError(f"`{name}` must be {rank}-D for qkv_format={fmt.value!r} with {self.num_heads_kv} heads "
                             f"of size {head_dim} (InferenceParams num_heads_kv, head_dim), got shape {tuple(t.shape)}")
        if t.dtype != self.dtype:
            raise ValueError(f"`{name}` must have the KV cache's dtype {self.dtype} (InferenceParams `dtype`), "
                             f"got {t.dtype}")
        if t.device != self.device:
            raise ValueError(f"`{name}` must be on the KV cache's device {self.device}, got {t.device}")

    def _append(self, layer_number: int, new_k: torch.Tensor, new_v: torch.Tensor, fmt: QKVFormat,
                names: Tuple[str, str]) -> None:
        step = self._current()
        self._check_layer(layer_number)
        if layer_number in step.stepped:
            raise ValueError(f"`layer_number` {layer_number!r} already appended this step's tokens (two modules "
                             "with one layer_number, or a second forward without pre_step)")
        self._check_new(names[0], new_k, fmt, self.head_dim_k)
        self._check_new(names[1], new_v, fmt, self.head_dim_v)
        rows, n = [], step.layout.num_tokens
        for name, t in zip(names, (new_k, new_v)):
            rows.append(_step_rows(t, self._token_index(fmt, tuple(t.shape), name), n))
        self.cache_manager.step(layer_number, rows[0], rows[1], step.rows)
        step.stepped.add(layer_number)

    def step(self, layer_number: int, new_k: torch.Tensor, new_v: torch.Tensor, qkv_format: str):
        """Copy the step's new keys and values (``qkv_format``: bshd ``[b, s, h, d]`` with each sequence's
        ``step_dict`` tokens first, sbhd, or thd ``[t, h, d]`` packed in step order) to layer
        ``layer_number``'s cache. Returns, as TransformerEngine's does, ``(k_cache, v_cache, cu_seqlens_q,
        cu_seqlens_kv, max_sequence_length, output_qkv_format)``."""
        fmt = _format_arg(qkv_format)
        self.input_qkv_format = fmt.value
        self._append(layer_number, new_k, new_v, fmt, ("new_k", "new_v"))
        k_cache, v_cache = self.cache_manager.cache[layer_number]
        return (k_cache, v_cache, self.cu_seqlens_q, self.cu_seqlens_kv, self.max_sequence_length,
                self.output_qkv_format)

    def convert_paged_to_nonpaged(self, layer_number: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_number``'s cached keys and values of the step's sequences as ``[b, s, h, d]`` (step
        order, ``s`` = the pages of the longest, zeros past each sequence's pages)."""
        step = self._current()
        self._check_layer(layer_number)
        layout = step.layout
        k_rows, v_rows, starts = self.cache_manager.keys_values(layer_number, layout)
        width = layout.max_total_len
        if self.is_paged:
            width = self.cache_manager.pages_for(width) * self.page_size
        out = []
        for rows in (k_rows, v_rows):
            dense = rows.new_zeros((layout.batch_size, width) + tuple(rows.shape[1:]))
            for i, (start, total) in enumerate(zip(starts, layout.total_lens)):
                dense[i, :total] = rows[start:start + total]
            out.append(dense)
        return out[0], out[1]

    def _kernel_call(self, layer_number: int) -> dict:
        """The packed call of the step: the cached rows and the sequences in increasing cache order (the
        sequence metadata is built once per step and cache layout, and reused by every layer; the built-in
        managers' at pre_step)."""
        step = self._current()
        k_rows, v_rows, starts = self.cache_manager.keys_values(layer_number, step.layout)
        key = tuple(starts)
        if key not in step.calls:
            order, arrays = _cache_order(step.layout, starts)
            step.calls[key] = _sequence_call(step, order, dict(zip(arrays, to_device(list(arrays.values()),
                                                                                     self.device))))
        return dict(step.calls[key], k=k_rows, v=v_rows)

    def _decode_call(self, layer_number: int, in_place: bool, static: bool) -> dict:
        """A decode step's packed call, from the step buffers' views (:class:`_DecodeViews`): sequences in step
        order, each read where the cache keeps it (non-paged: its slot, from ``starts``; paged: through the
        step's page table where ``in_place``, else gathered). ``static``: what the call holds is the same at
        every step of this batch size (traced or captured): ``max_seqlen_kv`` is the cache's capacity and a
        gather takes every page of the step table's rows; else ``max_seqlen_kv`` is the longest sequence and a
        gather takes the step's pages."""
        step = self._current()
        views = step.decode
        limit = self.max_sequence_length
        call = dict(order=None, cu_seqlens_q=views.cu_seqlens_q, cu_seqlens_kv=views.cu_seqlens_kv, max_seqlen_q=1,
                    max_seqlen_kv=limit if static else step.layout.max_total_len)
        k_cache, v_cache = self.cache_manager.cache[layer_number]
        k_rows, v_rows = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
        if views.table is None:
            return dict(call, k=k_rows, v=v_rows, cu_seqlens_kv_padded=views.starts)

        def gather():
            if not static:
                tight = self._kernel_call(layer_number)  # the step's pages only, in step order
                return tight["k"], tight["v"], tight["cu_seqlens_kv_padded"]
            index = views.table.reshape(-1)  # every page of the step's rows: a shape for every step
            return (k_cache.index_select(0, index).view(-1, *k_cache.shape[2:]),
                    v_cache.index_select(0, index).view(-1, *v_cache.shape[2:]), views.gather_starts)

        if in_place:
            return dict(call, k=k_rows, v=v_rows, cu_seqlens_kv_padded=views.cu_seqlens_kv, page_table=views.table,
                        page_size=self.page_size, gather=gather)
        k_rows, v_rows, starts = gather()
        return dict(call, k=k_rows, v=v_rows, cu_seqlens_kv_padded=starts)

    def _append_decode(self, layer_number: int, new_k: torch.Tensor, new_v: torch.Tensor, fmt: QKVFormat) -> None:
        """:meth:`_append` of a decode step whose keys and values are their tensors' first rows."""
        step = self._current()
        self._check_layer(layer_number)
        if layer_number in step.stepped:
            raise ValueError(f"`layer_number` {layer_number!r} already appended this step's tokens (two modules "
                             "with one layer_number, or a second forward without pre_step)")
        self._check_new("key_layer", new_k, fmt, self.head_dim_k)
        self._check_new("value_layer", new_v, fmt, self.head_dim_v)
        b = step.layout.batch_size
        self.cache_manager.step(layer_number, _step_rows(new_k, None, b), _step_rows(new_v, None, b), step.rows)
        step.stepped.add(layer_number)

    def _paged_call(self, layer_number: int) -> Optional[dict]:
        """The packed call of the step on a paged cache read in place: the cache's rows, the sequences in step
        order, the step's page table and how to gather instead; None where the cache manager is not a
        :class:`PagedKVCacheManager` (its rows are gathered)."""
        manager = self.cache_manager
        if not isinstance(manager, PagedKVCacheManager):
            return None
        step = self._current()
        layout = step.layout
        if "paged" not in step.calls:
            # cu_seqlens_kv_padded = cu_seqlens_kv: what DotProductAttention's checks see (each sequence's keys
            # fit the cache's rows); the fused call drops it for the page table, the gather replaces it.
            step.calls["paged"] = dict(order=None, cu_seqlens_q=step.cu_seqlens_q, cu_seqlens_kv=step.cu_seqlens_kv,
                                       cu_seqlens_kv_padded=step.cu_seqlens_kv, max_seqlen_q=layout.max_step_len,
                                       max_seqlen_kv=layout.max_total_len)
        k_rows, v_rows = manager.cache_rows(layer_number)

        def gather():
            call = self._kernel_call(layer_number)  # gathered in step order: cache order is step order there
            return call["k"], call["v"], call["cu_seqlens_kv_padded"]

        return dict(step.calls["paged"], k=k_rows, v=v_rows, page_table=manager.step_page_table(layout),
                    page_size=manager.page_size, gather=gather)


def _first_rows(fmt: QKVFormat, shape, b: int) -> bool:
    """Whether a decode step tensor of ``shape`` holds its ``b`` tokens in its first rows, in step order."""
    if fmt == QKVFormat.THD:
        return shape[0] >= b
    return tuple(shape[:2]) == ((b, 1) if fmt == QKVFormat.BSHD else (1, b))


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (a step's call then holds what every step holds)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _step_rows(t: torch.Tensor, index: Optional[torch.Tensor], n: int) -> torch.Tensor:
    """The ``n`` new tokens' rows ``[n, h, d]`` of a step tensor, at ``index`` (None: its first rows)."""
    flat = t if t.dim() == 3 else t.reshape(-1, *t.shape[-2:])
    if index is not None:
        return flat.index_select(0, index)
    return flat if flat.shape[0] == n else flat[:n]


def _cache_order(layout: StepLayout, starts: Sequence[int]) -> Tuple[Optional[Tuple[int, ...]], Dict[str, tuple]]:
    """The kernel call's sequences in increasing cache order (``starts``: each step sequence's first cached row):
    (that order, None where it is the step order; the host arrays that differ from the step's: cu_seqlens_q and
    cu_seqlens_kv in that order, cu_seqlens_kv_padded)."""
    b = layout.batch_size
    order = sorted(range(b), key=lambda i: starts[i])
    lens_kv = [layout.total_lens[i] for i in order]
    padded = [starts[i] for i in order]
    padded.append(padded[-1] + lens_kv[-1])
    arrays = {"padded": (padded, torch.int32)}
    if order == list(range(b)):
        return None, arrays
    arrays.update(order_cu_q=(_cumulative([layout.step_lens[i] for i in order]), torch.int32),
                  order_cu_kv=(_cumulative(lens_kv), torch.int32))
    return tuple(order), arrays


def _sequence_call(step: _Step, order: Optional[Tuple[int, ...]], tensors: Mapping[str, torch.Tensor]) -> dict:
    """The kernel call's sequence arguments (:func:`_cache_order`'s arrays on the device, by name)."""
    layout = step.layout
    return dict(order=order, cu_seqlens_q=tensors["order_cu_q"] if order is not None else step.cu_seqlens_q,
                cu_seqlens_kv=tensors["order_cu_kv"] if order is not None else step.cu_seqlens_kv,
                cu_seqlens_kv_padded=tensors["padded"], max_seqlen_q=layout.max_step_len,
                max_seqlen_kv=layout.max_total_len)


@dataclass(frozen=True)
class _StepRun:
    """A KV-cache step's call on its way to the backend that runs it (the runner of :func:`step_runner`).

    DotProductAttention decides on the step's call with ``max_seqlen_kv`` = the cache's capacity (``limit``:
    what its checks and backend selection read is then the same at every step, so its signature cache serves
    every step); the backend gets the step's own bound instead: the longest sequence's length, which the fused
    backend rounds up within its key chunk (``kernel_runner.max_seqlen_kv_bound``: the same launches, and a
    signature that changes once a chunk). On a paged cache (``page_table``) the fused backend gets the page
    table with the cache's rows where its forward follows one with the gathered call's bits
    (``plan.pages_keep_bits``); any other backend, and that one elsewhere, the gathered rows (``gather``).

    What this decides per backend and call parameters is kept in ``choices`` (the InferenceParams', for every
    step: (reads the page table, the key chunk)) and the step's parameters per step (every layer's)."""

    step: _Step
    choices: Dict[tuple, Tuple[bool, int]]
    max_seqlen_kv: int
    limit: int
    page_table: Optional[torch.Tensor] = None
    page_size: int = 0
    gather: Optional[Callable[[], Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = None

    def run(self, backend, q, k, v, call):
        key = (backend, call.params, self.page_table is not None, q.shape[-1], v.shape[-1], q.dtype, q.device,
               call.bias is None, call.alibi_slopes is None)
        known = self.step.backend_params.get(key)
        if known is None:
            choice = self.choices.get(key)
            if choice is None:
                if len(self.choices) >= 256:  # bounded: parameters that change at every step take no memory
                    self.choices.clear()
                choice = self.choices[key] = self._choose(backend, q, k, v, call)
            in_place, chunk = choice
            changes = dict(max_seqlen_kv=self.max_seqlen_kv)
            if issubclass(backend, FusedAttention):
                changes["max_seqlen_kv"] = kernel_runner.max_seqlen_kv_bound(self.max_seqlen_kv, chunk, self.limit)
            if in_place:
                changes["kv_page_size"] = self.page_size
            known = self.step.backend_params[key] = (dataclasses.replace(call.params, **changes), in_place, chunk)
        params, in_place, chunk = known
        self.step.last_run = (backend, params.max_seqlen_kv, chunk, in_place)
        if in_place:
            return backend.run(q, k, v, dataclasses.replace(call, params=params, page_table=self.page_table,
                                                            cu_seqlens_kv_padded=None))
        if self.page_table is not None:
            k, v, padded = self.gather()
            return backend.run(q, k, v, dataclasses.replace(call, params=params, cu_seqlens_kv_padded=padded))
        return backend.run(q, k, v, dataclasses.replace(call, params=params))

    def _choose(self, backend, q, k, v, call) -> Tuple[bool, int]:
        """(whether ``backend`` reads the page table in place, the fused forward's key chunk)."""
        if not issubclass(backend, FusedAttention):
            return False, 0
        in_place = self.page_table is not None and pages_keep_bits(kernel_runner.plan_key(q, k, v, call),
                                                                   self.page_size)
        # The fused backend's score modifier: ALiBi (its default slopes where none are given) or none (the step
        # refuses a bias).
        bias = AttnBiasType.ALIBI if call.params.attn_bias_type == AttnBiasType.ALIBI else AttnBiasType.NO_BIAS
        return in_place, kernel_runner.key_chunk(call.params, q, v, bias, self.page_size if in_place else 0)


# The kernel call's buffers a decode plan launches on: the step buffers' views, the cache and the page table, and
# what each step gives (q) or allocates (_PLAN_PER_CALL).
_PLAN_PER_CALL = frozenset(("q", "out", "lse", "part_o", "part_ml"))
_PLAN_BUFFERS = _PLAN_PER_CALL | {"k", "v", "seq_start_q", "seq_start_k", "seq_len_q", "seq_len_k", "page_table"}


class _DecodePlan:
    """A decode step's kernel call for one layer and batch size, kept from a step that ran the full path: the
    prepared launches and their buffers, which at every decode step of that size are the same tensors (the step
    buffers' views, rewritten by pre_step; the layer's cache; the step's page table). A later step with the
    same module call signature (DotProductAttention's: the module's settings, the tensors' shapes, strides,
    dtypes and alignment, the settings read) then appends its keys and values and launches on its q, with
    nothing decided again, while its key bound stays (kernel_runner.max_seqlen_kv_bound) and the layer keeps
    its cache: the launches and buffers of the full path, so the same bits."""

    __slots__ = ("cache", "fmt", "backend_name", "bound", "chunk", "launches", "workspace", "fixed", "out_shape",
                 "lse_shape", "width")

    def __init__(self, cache, fmt, backend_name, bound, chunk, launches, workspace, fixed, out_shape, lse_shape,
                 width):
        self.cache, self.fmt, self.backend_name, self.bound, self.chunk = cache, fmt, backend_name, bound, chunk
        self.launches, self.workspace, self.fixed = launches, workspace, fixed
        self.out_shape, self.lse_shape, self.width = out_shape, lse_shape, width

    def run(self, params: InferenceParams, step: _Step, module, q, k, v):
        layer = module.layer_number
        manager = params.cache_manager
        if (layer in step.stepped or manager.cache.get(layer) is not self.cache
                or (torch.is_grad_enabled() and q.requires_grad) or _capturing()
                or kernel_runner.max_seqlen_kv_bound(step.layout.max_total_len, self.chunk,
                                                     params.max_sequence_length) != self.bound):
            return None
        b = step.layout.batch_size
        manager.step(layer, _step_rows(k, None, b), _step_rows(v, None, b), step.rows)
        step.stepped.add(layer)
        params.input_qkv_format = self.fmt
        q_rows = _step_rows(q, None, b)
        out = torch.zeros(self.out_shape, dtype=q.dtype, device=q.device)  # thd: as kernel_runner.forward's
        buffers = dict(self.fixed, q=q_rows, out=out, lse=unfilled(self.lse_shape, torch.float32, q.device))
        if self.workspace is not None:
            buffers["part_o"], buffers["part_ml"] = kernel_runner._split_kv_workspace(self.workspace, q.device)
        kernel_runner._run(self.launches, buffers)
        if module.last_backend != self.backend_name:  # (Module.__setattr__ is slow)
            module.last_backend = self.backend_name
        return out.view(*q.shape[:-2], self.width)


# Masks of a step: every step's queries are the last of their sequences, so causal masks align bottom-right.
_STEP_MASK = {
    AttnMaskType.NO_MASK: AttnMaskType.PADDING_MASK,
    AttnMaskType.PADDING_MASK: AttnMaskType.PADDING_MASK,
    AttnMaskType.CAUSAL_MASK: AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
    AttnMaskType.PADDING_CAUSAL_MASK: AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
    AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK: AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
    AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK: AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
}


def cached_attention(module, params: InferenceParams, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     fmt: QKVFormat, mask: AttnMaskType, *, window_size, cu_seqlens_q, cu_seqlens_q_padded,
                     cu_seqlens_kv_padded, bias_type: AttnBiasType, core_attention_bias, alibi_slopes,
                     checkpoint_core_attention: bool, forward: Callable[..., torch.Tensor],
                     plan_key: Optional[tuple] = None):
    """DotProductAttention's forward with ``inference_params``: append the step's k, v to the module's layer
    cache and attend the step's queries to their sequences' cached keys (module docstring). Returns q's
    format with the heads flattened; rows past a sequence's new tokens (bshd/sbhd padding, thd tail) are 0.
    The step runs as one packed (thd) call of ``forward`` inside :func:`step_runner`: ``DotProductAttention.forward``
    bound to ``module``, the base class's whatever a subclass (Megatron's TEDotProductAttention) wraps it with.
    ``plan_key``: the module call's signature where DotProductAttention made one (a decode step then keeps
    its launches for the next steps of its batch size, :meth:`InferenceParams.decode_from_plan`)."""
    if not isinstance(params, InferenceParams):
        raise ValueError(f"`inference_params` must be an InferenceParams, got {type(params).__name__}")
    if module.layer_number is None:
        raise ValueError("`layer_number` must be set on DotProductAttention (each layer has its own KV cache) "
                         "to run with `inference_params`")
    if mask not in _STEP_MASK:
        raise NotImplementedError(f"attn_mask_type={mask.value!r} with `inference_params` is not supported "
                                  f"(supported: {', '.join(sorted(m.value for m in _STEP_MASK))})")
    if bias_type in (AttnBiasType.PRE_SCALE_BIAS, AttnBiasType.POST_SCALE_BIAS) or core_attention_bias is not None:
        raise NotImplementedError("`core_attention_bias` with `inference_params` is not supported (ALiBi is)")
    if cu_seqlens_q_padded is not None or cu_seqlens_kv_padded is not None:
        raise NotImplementedError("`cu_seqlens_q_padded`/`cu_seqlens_kv_padded` with `inference_params` are not "
                                  "supported: the step's tokens are packed (thd) or first in each row (bshd/sbhd)")
    cp = module._context_parallel
    if cp is not None and cp.size > 1:
        raise NotImplementedError("context parallelism with `inference_params` is not supported")
    if q.shape[-2] % params.num_heads_kv:
        raise ValueError(f"`query_layer` heads ({q.shape[-2]}) must be a multiple of the KV cache's num_heads_kv "
                         f"({params.num_heads_kv})")
    step = params._current()
    layout = step.layout
    if cu_seqlens_q is not None and can_sync():
        expect = _cumulative(layout.step_lens)
        got = host_values(cu_seqlens_q) if isinstance(cu_seqlens_q, torch.Tensor) else list(cu_seqlens_q)
        if list(got[:len(expect)]) != expect or any(x != expect[-1] for x in got[len(expect):]):
            raise ValueError(f"`cu_seqlens_q` must give the step's new token counts (step_dict) {expect}, got {got}")
    offset = getattr(module, "softmax_offset", None)  # a learnable sink's logits: a parameter
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or (offset is not None and offset.requires_grad))
    tracing = torch.compiler.is_compiling()
    # The fused backward reads no page table: gradients take the gather, as does a traced step (torch.compile:
    # it runs without a _StepRun).
    in_place = params.is_paged and not needs_grad and not tracing
    params.input_qkv_format = fmt.value
    if step.decode is not None and all(_first_rows(fmt, t.shape, layout.batch_size) for t in (q, k, v)):
        # A decode step: everything it reads is in the step buffers (traced or captured once per batch size).
        index = None
        params._append_decode(module.layer_number, k, v, fmt)
        call = params._decode_call(module.layer_number, in_place, tracing or _capturing())
    else:
        index = params._token_index(fmt, tuple(q.shape), "query_layer")  # checked before anything is appended
        params._append(module.layer_number, k, v, fmt, ("key_layer", "value_layer"))
        call = params._paged_call(module.layer_number) if in_place else None  # the cache read in place (fused)
        if call is None:
            call = params._kernel_call(module.layer_number)
    order = call["order"]
    if order is not None:  # the kernel's sequences in cache order: the step's rows permuted to it
        index = params._token_index(fmt, tuple(q.shape), "query_layer", order)
    n = layout.num_tokens
    q_rows = _step_rows(q, index, n)
    if alibi_slopes is not None and alibi_slopes.dim() == 2:
        if alibi_slopes.shape[0] != layout.batch_size:
            raise ValueError(f"`alibi_slopes` must have shape [{q.shape[-2]}] or [{layout.batch_size}, "
                             f"{q.shape[-2]}] (step_dict's sequences), got {tuple(alibi_slopes.shape)}")
        if order is not None:
            alibi_slopes = alibi_slopes.index_select(0, params._order_index(order).to(alibi_slopes.device))

    step_call = dict(qkv_format="thd", attn_mask_type=_STEP_MASK[mask].value, window_size=window_size,
                     bottom_right_diagonal=True, cu_seqlens_q=call["cu_seqlens_q"],
                     cu_seqlens_kv=call["cu_seqlens_kv"], cu_seqlens_kv_padded=call["cu_seqlens_kv_padded"],
                     max_seqlen_q=call["max_seqlen_q"], core_attention_bias_type=bias_type.value,
                     alibi_slopes=alibi_slopes, checkpoint_core_attention=checkpoint_core_attention)
    if tracing:  # the step's own bound, run as built
        result = forward(q_rows, call["k"], call["v"], max_seqlen_kv=call["max_seqlen_kv"], **step_call)
    else:
        limit = params.max_sequence_length
        runner = _StepRun(step, params._backend_choices, call["max_seqlen_kv"], limit, call.get("page_table"),
                          call.get("page_size", 0), call.get("gather"))
        # A decode step of the plain kind records its kernel call, to launch it again at the next steps.
        record = (plan_key is not None and step.decode is not None and index is None and not needs_grad
                  and not _capturing() and offset is None and not module.return_max_logit and alibi_slopes is None
                  and math.prod(q.shape[:-2]) == n)
        token = kernel_runner._RECORD.set([]) if record else None
        try:
            # The step's sequence tensors were built on the host from step_dict (pre_step): no read back.
            with sequences_checked_on_host(), step_runner(runner):
                result = forward(q_rows, call["k"], call["v"], max_seqlen_kv=limit, **step_call)
        finally:
            recorded = kernel_runner._RECORD.get() if token is not None else None
            if token is not None:
                kernel_runner._RECORD.reset(token)
        if record:
            params._keep_decode_plan(plan_key, module, fmt, q, q_rows, call, recorded)
    out_rows, max_logit = result if module.return_max_logit else (result, None)
    rows = math.prod(q.shape[:-2])
    if index is None:  # the step's tokens are the first rows
        out = out_rows if rows == n else torch.nn.functional.pad(out_rows, (0, 0, 0, rows - n))
    else:
        out = out_rows.new_zeros((rows, out_rows.shape[-1])).index_copy(0, index, out_rows)
    out = out.view(*q.shape[:-2], out_rows.shape[-1])
    return (out, max_logit) if module.return_max_logit else out
