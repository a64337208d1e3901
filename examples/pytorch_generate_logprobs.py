"""Training == inference: sample with the KV cache, then recompute the samples' log-probs with one training forward.

    python examples/pytorch_generate_logprobs.py            # GPU if there is one, else CPU
    python examples/pytorch_generate_logprobs.py --paged    # the paged KV cache

Reinforcement learning samples sequences with an inference loop and then trains on their log-probabilities; when
the two computations disagree in their bits, the policy gradient is off-policy. Here a small Llama-style model
(RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) generates from several prompts with
``InferenceParams``: sequences join and finish at different steps, so every step's batch differs (prefill of a
whole prompt next to single-token decodes). Then one training forward over the finished sequences, packed
(thd), recomputes the log-probability of every sampled token. The two are compared with ``torch.equal``.

What makes the bits equal:

- Attention: ``DotProductAttention`` with ``inference_params`` runs each step as one packed call against the
  cached keys, and a row's arithmetic is that of the training forward's row (docs/kv_cache.rst), for the fused
  kernels and the unfused backend alike (the same backend in both phases).
- Everything else in this model works on one token at a time, and runs so: the linear layers, norms and the
  log-softmax are applied to each token's row as a ``[1, hidden]`` tensor, so the kernels that compute a row have
  the same shapes however many tokens share the step (a matmul over many rows may block its sums differently
  for different row counts: with the linear layers over all of a step's rows at once, this check fails on
  CPU by a few units in the last place). A production model would use batch-invariant matmul and norm
  kernels instead of the per-row loop; rotary embeddings are elementwise in the position, which both phases
  give explicitly.
- Sampling draws from one generator per sequence, so a token depends on its own sequence only.
"""

import argparse
import os
from collections import OrderedDict

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
os.environ.setdefault("NVTE_FLASH_ATTN", "0")  # the project's kernels: flash-attn-4 makes no such promise

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from transformer_engine.pytorch import DotProductAttention, InferenceParams  # noqa: E402

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, MAX_LEN = 96, 64, 4, 2, 16, 128, 2, 64


def rows(fn, x):
    """``fn`` on each token row of ``x`` [tokens, ...] separately: the same kernels whatever the row count."""
    return torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def rotary(x, positions):
    """Rotary embedding of x [tokens, heads, d] at ``positions`` [tokens] (elementwise in the position)."""
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, device=x.device, dtype=torch.float32) / HEAD_DIM))
    angle = positions[:, None].float() * inv[None, :]
    cos, sin = angle.cos()[:, None, :].to(x.dtype), angle.sin()[:, None, :].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class Layer(torch.nn.Module):
    def __init__(self, number: int):
        super().__init__()
        self.norm1 = torch.nn.Parameter(torch.ones(HIDDEN))
        self.norm2 = torch.nn.Parameter(torch.ones(HIDDEN))
        self.qkv = torch.nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False)
        self.proj = torch.nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.up = torch.nn.Linear(HIDDEN, 2 * FFN, bias=False)
        self.down = torch.nn.Linear(FFN, HIDDEN, bias=False)
        self.attn = DotProductAttention(HEADS, HEAD_DIM, num_gqa_groups=KV_HEADS, qkv_format="thd",
                                        attn_mask_type="padding_causal", layer_number=number)

    def forward(self, x, positions, **attn_args):
        qkv = rows(lambda r: self.qkv(rms_norm(r, self.norm1)), x)
        q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        q = rotary(q.view(-1, HEADS, HEAD_DIM), positions)
        k = rotary(k.view(-1, KV_HEADS, HEAD_DIM), positions)
        a = self.attn(q, k, v.reshape(-1, KV_HEADS, HEAD_DIM), **attn_args)
        x = x + rows(self.proj, a)

        def mlp(r):
            gate, up = self.up(rms_norm(r, self.norm2)).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return x + rows(mlp, x)


class TinyLlama(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList(Layer(n + 1) for n in range(LAYERS))
        self.norm = torch.nn.Parameter(torch.ones(HIDDEN))
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens, positions, **attn_args):
        """Log-probabilities [tokens, vocab] of the next token after each of ``tokens`` (packed)."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, positions, **attn_args)
        return rows(lambda r: torch.log_softmax(self.head(rms_norm(r, self.norm)).float(), dim=-1), x)


def generate(model, prompts, new_tokens, arrivals, params):
    """Serve the prompts with ``params``: sequence i joins at step ``arrivals[i]`` (prefill of its whole
    prompt), then decodes one token per step until it has ``new_tokens[i]``; at most ``params``'s batch size
    run at once (a newcomer waits for a free slot). Returns each sequence's sampled tokens and their
    log-probs, and the sizes of the steps' batches."""
    device = prompts[0].device
    gens = [torch.Generator(device=device).manual_seed(1000 + i) for i in range(len(prompts))]
    seqs = [p.tolist() for p in prompts]
    sampled, logprobs = [[] for _ in prompts], [[] for _ in prompts]
    fed = [0] * len(prompts)  # tokens of each sequence already in the cache
    running, batches, step = [], [], 0
    while any(len(s) < n for s, n in zip(sampled, new_tokens)):
        for i in range(len(prompts)):
            if arrivals[i] <= step and fed[i] == 0 and i not in running and len(running) < params.max_batch_size:
                running.append(i)
        step += 1
        if not running:
            continue
        order = list(reversed(running))  # the step's batch order differs from the cache's slots
        step_dict = OrderedDict((i, len(seqs[i]) - fed[i]) for i in order)
        params.pre_step(step_dict)
        tokens = torch.cat([torch.tensor(seqs[i][fed[i]:], device=device) for i in order])
        positions = torch.cat([torch.arange(fed[i], len(seqs[i]), device=device) for i in order])
        with torch.no_grad():
            logp = model(tokens, positions, inference_params=params)
        ends = torch.tensor(list(step_dict.values())).cumsum(0) - 1
        for i, end in zip(order, ends.tolist()):
            fed[i] = len(seqs[i])
            token = torch.multinomial(logp[end].exp(), 1, generator=gens[i]).item()
            sampled[i].append(token)
            logprobs[i].append(logp[end, token])
            seqs[i].append(token)
        running = [i for i in running if len(sampled[i]) < new_tokens[i]]  # a finished one leaves the cache
        batches.append(len(order))
    return sampled, [torch.stack(lp) for lp in logprobs], batches


def recompute(model, prompts, sampled):
    """The sampled tokens' log-probs from one training forward over every finished sequence, packed."""
    device = prompts[0].device
    full = [torch.cat([p, torch.tensor(s, device=device)]) for p, s in zip(prompts, sampled)]
    lens = [len(f) for f in full]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    tokens = torch.cat(full)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    with torch.no_grad():
        logp = model(tokens, positions, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                     max_seqlen_kv=max(lens))
    out = []
    for n, (p, s) in enumerate(zip(prompts, sampled)):
        start = int(cu[n]) + len(p) - 1  # the row that predicts the first sampled token
        rows_ = logp[start:start + len(s)]
        out.append(rows_[torch.arange(len(s), device=device), torch.tensor(s, device=device)])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--paged", action="store_true", help="a paged KV cache with its pages in random order")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = TinyLlama().to(device, dtype).eval()
    g = torch.Generator().manual_seed(1)
    lengths, new_tokens, arrivals = (5, 12, 3, 9, 7), (9, 4, 12, 6, 8), (0, 0, 1, 3, 6)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).to(device) for n in lengths]
    kw = dict(is_paged=True, page_size=4, total_num_pages=3 * MAX_LEN // 4) if args.paged else {}
    params = InferenceParams(3, MAX_LEN, KV_HEADS, HEAD_DIM, dtype, **kw)
    if args.paged:
        order = torch.randperm(len(params.cache_manager.free_pages), generator=g).tolist()
        params.cache_manager.free_pages = [params.cache_manager.free_pages[i] for i in order]
    for layer in model.layers:
        params.allocate_memory(layer.attn.layer_number)
    sampled, served, batches = generate(model, prompts, new_tokens, arrivals, params)
    trained = recompute(model, prompts, sampled)
    same = all(torch.equal(a, b) for a, b in zip(served, trained))
    print(f"backend {model.layers[0].attn.last_backend}; step batch sizes {batches}")
    print(f"sampled {sum(len(s) for s in sampled)} tokens; log-probs of serving and training bitwise equal: {same}")
    if not same:
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(served, trained))
        raise SystemExit(f"largest difference {diff}")


if __name__ == "__main__":
    main()
