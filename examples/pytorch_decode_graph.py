"""A whole model's decode step (every layer) captured once in a CUDA graph and replayed, bits unchanged.

    python examples/pytorch_decode_graph.py            # GPU: captured and replayed; CPU: the same step eagerly
    python examples/pytorch_decode_graph.py --paged    # the paged KV cache

The shipped small model (``TinyTransformerLM``) prefills a batch of prompts with ``InferenceParams``, then decodes
one token per sequence per step. A decode step (every sequence one new token) reads its metadata (lengths,
cu_seqlens, cache rows, page table) from static buffers that ``pre_step`` rewrites in place, and its kernels read
the lengths on the device: so the step's launches are the same at every step of a batch size, and one capture
serves them all. Each step then is ``pre_step`` (host work and one copy), a copy of the new tokens into the
captured input, and ``graph.replay()``. The replayed logits are compared with eager steps from a fresh cache
(docs/kv_cache.rst: capturing a decode step). On a CPU no CUDA graph can be captured: the step that would be
captured (static buffers, rewritten in place) is called eagerly at every position instead, compared the same way,
and the output says so.
"""

import argparse
from collections import OrderedDict

import torch

from transformer_engine.pytorch import InferenceParams
from transformer_engine.pytorch.models import TinyConfig, TinyTransformerLM

BATCH, PROMPT, STEPS, MAX_LEN = 3, 5, 12, 32


def new_cache(model, cfg, device, paged):
    params = InferenceParams(BATCH, MAX_LEN, cfg.num_gqa_groups, cfg.head_dim, next(model.parameters()).dtype,
                             is_paged=paged, page_size=8 if paged else None, device=device)
    for layer in model.layers:
        params.allocate_memory(layer.attention.layer_number)
    return params


def prefill(model, params, prompts):
    params.pre_step(OrderedDict((i, PROMPT) for i in range(BATCH)))
    return model(prompts, inference_params=params)[:, -1].argmax(-1)


def eager_decode(model, params, first, tokens):
    """The reference: every decode step run eagerly, feeding the given tokens; returns each step's logits."""
    logits = []
    for step in range(STEPS):
        params.pre_step(OrderedDict((i, 1) for i in range(BATCH)))
        logits.append(model((first if step == 0 else tokens[step - 1]).view(BATCH, 1), inference_params=params))
    return torch.stack(logits)


def captured_decode(model, params, first, warm_up):
    """Decode greedily through one captured step (on CPU, the same step called eagerly); returns each step's
    logits, the tokens fed and how many times a graph was replayed (0 on CPU). ``warm_up``: a cache of the same
    sizes whose steps compile the kernels first."""
    static_tokens = first.view(BATCH, 1).clone()
    step_dict = OrderedDict((i, 1) for i in range(BATCH))

    def step(cache):
        return model(static_tokens, inference_params=cache)

    graph = None
    if static_tokens.is_cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles the kernels on a scratch cache: params' own cache is untouched
            warm_up.pre_step(OrderedDict((i, PROMPT) for i in range(BATCH)))
            model(static_tokens.expand(BATCH, PROMPT), inference_params=warm_up)
            for _ in range(2):
                warm_up.pre_step(step_dict)
                step(warm_up)
        torch.cuda.current_stream().wait_stream(side)
    logits, fed, replays = [], [], 0
    for n in range(STEPS):
        params.pre_step(step_dict)  # rewrites the static metadata in place: no new tensors for the graph
        if graph is None and static_tokens.is_cuda:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_logits = step(params)
        if graph is not None:
            graph.replay()
            replays += 1
            out = static_logits
        else:
            out = step(params)
        logits.append(out.clone())
        fed.append(static_tokens.view(-1).clone())
        static_tokens.copy_(out[:, -1].argmax(-1).view(BATCH, 1))
    return torch.stack(logits), fed, replays


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--paged", action="store_true", help="a paged KV cache (pages of 8 tokens)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    cfg = TinyConfig(vocab_size=64, hidden_size=64, num_layers=2, num_attention_heads=4, num_gqa_groups=2)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = TinyTransformerLM(cfg).to(device, dtype).eval()
    prompts = torch.randint(0, cfg.vocab_size, (BATCH, PROMPT), device=device)
    with torch.no_grad():
        params = new_cache(model, cfg, device, args.paged)
        first = prefill(model, params, prompts)
        replayed, fed, replays = captured_decode(model, params, first, new_cache(model, cfg, device, args.paged))
        reference_params = new_cache(model, cfg, device, args.paged)
        prefill(model, reference_params, prompts)
        eager = eager_decode(model, reference_params, fed[0], fed[1:])
    what = f"{cfg.num_layers} layers, batch {BATCH}, {STEPS} steps, {'paged' if args.paged else 'non-paged'} cache"
    if replays:
        print(f"captured decode: one CUDA graph captured, replayed {replays} times; {what}")
        print(f"replayed steps equal eager steps bitwise: {torch.equal(replayed, eager)}")
    else:
        print(f"CPU: no CUDA graph was captured or replayed (CUDA graphs need a GPU); the step a graph would capture "
              f"(static buffers rewritten in place) ran eagerly at every position; {what}")
        print(f"static-buffer steps equal fresh eager steps bitwise: {torch.equal(replayed, eager)}")


if __name__ == "__main__":
    main()
