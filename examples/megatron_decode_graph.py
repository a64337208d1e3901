"""Megatron-core's CUDA-graph decode on this package: generation with graphs on equals graphs off, bit for bit.

    pip install setuptools wheel pybind11      # a new venv has none; --no-build-isolation builds with them
    pip install --no-build-isolation ".[pytorch]" && pip install megatron-core==0.19.2   # Python 3.12
    python examples/megatron_decode_graph.py     # GPU if there is one (bf16), else CPU (fp32, no graphs)

Megatron-core captures decode steps in CUDA graphs (``cuda_graph_impl="local"``) only with static batching and
``flash_decode=True``, and its flash decode calls ``flash_attn_with_kvcache`` in
``megatron.core.transformer.attention``. ``te_megatron.install()`` puts this package's capturable step there.

On a GPU, Megatron's ``TextGenerationController`` generates greedily from a small GPT (the TransformerEngine
layer spec) twice, with CUDA graphs off and on: the generated tokens and every step's logits are bitwise
equal, and the graphs were captured (one per layer) and replayed (one per layer and decode step).

On a CPU no CUDA graph can be captured or replayed, and Megatron's controller and KV-cache allocation are
CUDA-only. The script then runs the same model and config without ``cuda_graph_impl`` and steps Megatron's
``GPTInferenceWrapper`` as the controller does: the decode steps go through the step that would be captured
(``flash_decode=True``, this package's ``flash_attn_with_kvcache``), eagerly, and are compared with the
ordinary path (``flash_decode=False``, ``TEDotProductAttention``). It says so in its output.
docs/megatron.rst shows this file and the whole install (torch's CPU build, the versions CI tests);
tests/pytorch/test_megatron_gpt.py runs it.
"""

import argparse
import contextlib
import os
import sys
import tempfile

import torch

VOCAB = 64
PROMPTS = ([3, 17, 5, 9, 41], [8, 2, 60, 33, 12, 7, 25])


def build_model(device: str, dtype: torch.dtype, max_len: int, seed: int = 0, **changes):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=True,  # then copied to the device
        attention_dropout=0.0, hidden_dropout=0.0, deterministic_mode=True,
        gradient_accumulation_fusion=False, bias_dropout_fusion=device == "cuda", masked_softmax_fusion=False,
        persist_layer_norm=False,
        cuda_graph_modules=[],  # with cuda_graph_impl="local": graph each TransformerLayer whole
        **changes,  # flash_decode=True, cuda_graph_impl="local"
    )
    torch.manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
                     vocab_size=VOCAB, max_sequence_length=max_len)
    return model.to(device=device, dtype=dtype).eval()


class Tokenizer:  # what the controller needs of a tokenizer: token ids are the text here
    eod = VOCAB - 1

    def detokenize(self, tokens):
        return " ".join(map(str, tokens))


def generate_with_controller(model, new: int):
    """CUDA: Megatron's TextGenerationController, greedy, the batch as large as the context (no padding rows,
    so graphs on and off run the same shapes). The generated tokens [b, new] and every step's logits."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.inference_request import InferenceRequest
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )
    from megatron.core.inference.utils import InferenceMode

    context = StaticInferenceContext(max_batch_size=len(PROMPTS), max_sequence_length=max(map(len, PROMPTS)) + new)
    wrapper = GPTInferenceWrapper(model, context)
    step, logits = wrapper.run_one_forward_step, []

    def recorded(*args, **kwargs):  # keep every step's logits, to compare them too
        out = step(*args, **kwargs)
        logits.append(out.clone())
        return out

    wrapper.run_one_forward_step = recorded
    params = SamplingParams(top_k=1, num_tokens_to_generate=new)
    params.no_early_termination = True
    requests = {str(i): InferenceRequest(request_id=str(i), prompt=Tokenizer().detokenize(p), prompt_tokens=list(p),
                                         sampling_params=params) for i, p in enumerate(PROMPTS)}
    with InferenceMode.active():
        done = TextGenerationController(wrapper, Tokenizer()).generate_all_output_tokens_static_batch(requests)
    torch.cuda.synchronize()
    return torch.stack([done[str(i)].generated_tokens for i in range(len(PROMPTS))]), logits


def generate_stepping_the_wrapper(model, new: int):
    """CPU: the controller's static-batch schedule, run by hand (the controller and Megatron's cache allocation
    are CUDA-only). The generated tokens [b, new] and every step's logits."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.utils import InferenceMode
    from megatron.core.transformer.attention import Attention

    lens = torch.tensor([len(p) for p in PROMPTS])
    total = int(lens.max()) + new
    context = StaticInferenceContext(max_batch_size=len(PROMPTS), max_sequence_length=total)
    dtype = next(model.parameters()).dtype
    for m in model.modules():  # Megatron allocates its cache on torch.cuda.current_device(); hand it CPU buffers
        if isinstance(m, Attention):
            context.key_value_memory_dict[m.layer_number] = tuple(
                torch.empty(total, len(PROMPTS), m.num_query_groups_per_partition, dim, dtype=dtype)
                for dim in (m.key_hidden_size, m.val_hidden_size))
    wrapper = GPTInferenceWrapper(model, context)
    wrapper.prep_model_for_inference()
    tokens = torch.zeros(len(PROMPTS), total, dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        tokens[i, :len(p)] = torch.tensor(p)
    inputs = wrapper.prep_inference_input(tokens)
    start, end, logits = 0, int(lens.min()), []
    # GPTModel.forward makes the decode step's offsets on torch.cuda.current_device(): the CPU here.
    current_device, torch.cuda.current_device = torch.cuda.current_device, lambda: torch.device("cpu")
    try:
        while end < total:  # prefill up to the shortest prompt, then one token per step
            with InferenceMode.active():
                out = wrapper.run_one_forward_step(wrapper.get_batch_for_context_window(inputs, start, end))
            logits.append(out.clone())
            started = lens <= end  # a longer prompt keeps its own tokens until it ends
            tokens[started, end] = out[started, -1].argmax(-1)
            start, end = end, end + 1
            if bool(started.all()):
                context.enable_decode_mode()
    finally:
        torch.cuda.current_device = current_device
    return torch.stack([tokens[i, len(p):len(p) + new] for i, p in enumerate(PROMPTS)]), logits


@contextlib.contextmanager
def counting_graphs():
    """How many CUDA graphs were captured and replayed in the block, whoever made them."""
    counts = {"captured": 0, "replayed": 0}
    graph = torch.cuda.CUDAGraph
    begin, replay = graph.capture_begin, graph.replay

    def counted_begin(self, *args, **kwargs):
        counts["captured"] += 1
        return begin(self, *args, **kwargs)

    def counted_replay(self, *args, **kwargs):
        counts["replayed"] += 1
        return replay(self, *args, **kwargs)

    graph.capture_begin, graph.replay = counted_begin, counted_replay
    try:
        yield counts
    finally:
        graph.capture_begin, graph.replay = begin, replay


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=6, help="tokens generated per prompt")
    args = parser.parse_args()
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        print("megatron-core is not installed: pip install megatron-core==0.19.2 (Python 3.12)", file=sys.stderr)
        return 2
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from transformer_engine.pytorch.integrations import megatron as te_megatron

    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"  # deterministic_mode requires it with TransformerEngine
    on_gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    max_len = max(map(len, PROMPTS)) + args.new_tokens
    store = os.path.join(tempfile.mkdtemp(), "store")
    if on_gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl" if on_gpu else "gloo", init_method=f"file://{store}", rank=0,
                            world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    previous = te_megatron.install()  # once per process; te_megatron.uninstall(previous) puts flash-attn's back
    try:
        if on_gpu:
            model_parallel_cuda_manual_seed(123, inference_rng_tracker=True)  # a graph-safe RNG tracker
            eager = build_model(device, dtype, max_len, flash_decode=True)
            graphed = build_model(device, dtype, max_len, flash_decode=True, cuda_graph_impl="local")
            graphed.load_state_dict(eager.state_dict())
            with counting_graphs() as counts_eager:
                tokens, logits = generate_with_controller(eager, args.new_tokens)
            with counting_graphs() as counts:
                other_tokens, other_logits = generate_with_controller(graphed, args.new_tokens)
            assert counts_eager == {"captured": 0, "replayed": 0}, counts_eager
            what = (f"CUDA graphs: {counts['captured']} captured, {counts['replayed']} replayed "
                    f"({graphed.config.num_layers} layers, {args.new_tokens - 1} decode steps)")
            compared = "generation with CUDA graphs equals generation without"
        else:
            # te_rng_tracker: this package's tracker, which follows the CPU generator when there is no GPU.
            model_parallel_cuda_manual_seed(123, te_rng_tracker=True)
            ordinary = build_model(device, dtype, max_len)
            flash = build_model(device, dtype, max_len, flash_decode=True)
            flash.load_state_dict(ordinary.state_dict())
            tokens, logits = generate_stepping_the_wrapper(ordinary, args.new_tokens)
            import megatron.core.transformer.attention as megatron_attention

            calls = []  # counted, to show that the decode steps went through this package's step

            def counted(*args, **kwargs):
                calls.append(1)
                return te_megatron.flash_attn_with_kvcache(*args, **kwargs)

            megatron_attention.flash_attn_with_kvcache = counted
            other_tokens, other_logits = generate_stepping_the_wrapper(flash, args.new_tokens)
            what = ("CPU: no CUDA graph was captured or replayed (CUDA graphs need a GPU); the decode steps ran "
                    f"eagerly through the step a graph would capture (flash_decode=True): {len(calls)} calls of "
                    f"te_megatron.flash_attn_with_kvcache ({flash.config.num_layers} layers x "
                    f"{args.new_tokens - 1} decode steps)")
            compared = "that step's generation equals the ordinary path's (flash_decode=False)"
    finally:
        te_megatron.uninstall(previous)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    same = torch.equal(other_tokens, tokens) and len(other_logits) == len(logits) and all(
        torch.equal(a, b) for a, b in zip(other_logits, logits))
    print(f"device {device}, {dtype}; generated {tokens.tolist()}")
    print(what)
    print(f"{compared}, tokens and logits bitwise: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
