"""Where one request's decode step goes: the engine's own Python per step against the
forward pass, and inside the forward, each kernel.

    python benchmarks/profile_single_step.py --quantization gguf   # or int8, or none
    python benchmarks/profile_single_step.py --speculative ngram  # verification steps

One request (128-token prompt, `--steps` greedy tokens) on the default model, or on another
GGUF file (`--gguf-file`, e.g. Gemma 3 270M `Q4_K_M` or `gguf_from_dir.py`'s MoE). Two passes:

1. Sections of `LLMEngine.step()`, timed around the engine's own methods (this script wraps
   them; the engine is unchanged): scheduler, input preparation, forward, vocabulary
   projection, sampling, runner bookkeeping, the scheduler's update, output processing
   (detokenizer included), and the rest of the loop. Wall time and the main thread's CPU
   time (`time.thread_time`: on a loaded machine the Python sections' CPU time is what
   they cost; their wall time includes waiting for a core).
2. `torch.profiler` over the same steps: self time per operator (the weight kernels by
   output size, attention, inductor's fused elementwise kernels, argmax).

Prints the bytes of weights a step reads and the bandwidth a step reaches.

`--speculative ngram`: prompt-lookup speculation (`--num-speculative-tokens`, default 8;
lookup n-grams 2-4) on `benchmark_peers.py --single`'s copy-heavy prompt (answering from a
passage in the prompt), whose steps mostly verify drafts. The table then also has the
runner's `spec.verify` (expanding the sampling metadata, rejection sampling, appending the
accepted tokens; indented inside it, the rejection sampler and its native argmax over the
verified positions, which like the plain sampler counts as model time) and `spec.propose`
(the prompt-lookup drafts for the next step), and per generated token as well as per step.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vllm import LLM, SamplingParams
from vllm.transformers_utils.default_model import default_model_path


class SectionTimer:
    """Accumulated wall and thread CPU time and calls per named section. A label that
    starts with a space is a section nested inside another one (not summed)."""

    def __init__(self) -> None:
        self.wall: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.cpu: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        self.on = False

    def clear(self) -> None:
        self.wall.clear()
        self.cpu.clear()
        self.calls.clear()

    def wrap(self, owner: object, name: str, label: str) -> None:
        """Times `owner.name`. A special method (`__call__`) is looked up on the type, so
        it is wrapped on the owner's class."""
        if name.startswith("__"):
            owner = type(owner)
        fn: Callable = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[label] += time.perf_counter() - wall
                self.cpu[label] += time.thread_time() - cpu
                self.calls[label] += 1

        setattr(owner, name, timed)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a one-token step reads: every linear layer's kernel (GGUF codes
    and scales or blocks, int8 weights and scales, or the dense weight, which packing keeps
    the same size), the vocabulary projection included, the embedding table not (one row is
    read); of a mixture of experts' layer, its top-k experts' share."""
    from vllm.model_executor.layers.fused_moe import FusedMoE, NativeExpertKernel
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.quantization.gguf_blocks import GGUFBlockLinear, GGUFLinear
    from vllm.model_executor.layers.quantization.int8 import Int8Linear

    def size(*tensors: torch.Tensor) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    total = 0
    for module in model.modules():
        if isinstance(module, FusedMoE):
            experts = module.kernel
            weights = experts.weights if isinstance(experts, NativeExpertKernel) \
                else (module.w13_weight, module.w2_weight)
            total += size(*weights) * module.top_k // module.num_experts
            continue
        if not isinstance(module, LinearBase):
            continue
        kernel = module.kernel
        if isinstance(kernel, GGUFBlockLinear):
            total += size(*kernel.weights)
        elif isinstance(kernel, GGUFLinear):
            total += size(kernel.codes, kernel.d, kernel.m) if kernel.kernel == "quant_gemv" \
                else size(kernel.packed, kernel.scale_zero)
        elif isinstance(kernel, Int8Linear):
            weight = kernel.weight_packed if kernel.native else kernel.weight_t
            total += size(weight, kernel.weight_scale)
        elif module.weight is not None:
            total += size(module.weight)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", default="gguf", choices=["gguf", "int8", "none"])
    parser.add_argument("--gguf-file", default=None,
                        help="a GGUF file instead of the default model (--quantization gguf)")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--speculative", default="none", choices=["none", "ngram"],
                        help="ngram: prompt-lookup speculation on the copy-heavy prompt")
    parser.add_argument("--num-speculative-tokens", type=int, default=8)
    parser.add_argument("--requests", type=int, default=1,
                        help="requests timed one after another (more steps, less noise)")
    parser.add_argument("--torch-profile", action=argparse.BooleanOptionalAction,
                        default=True, help="also the torch.profiler pass")
    args = parser.parse_args()
    if args.gguf_file is not None and args.quantization != "gguf":
        parser.error("--gguf-file runs with --quantization gguf")
    gguf = args.gguf_file or default_model_path()
    kwargs: dict = {"enforce_eager": args.enforce_eager}
    if args.quantization != "none":
        kwargs["quantization"] = args.quantization
    if args.quantization != "gguf":
        from benchmark_peers import export_hf_dir  # the GGUF as a Hugging Face directory

        model = export_hf_dir(gguf, os.path.join(tempfile.gettempdir(),
                                                 "vllm-bench-default-hf"))
    else:
        model = gguf
    speculative = args.speculative != "none"
    token_ids = None
    if speculative:
        from benchmark_peers import single_workload

        workload = single_workload(gguf, args.steps, args.num_speculative_tokens)
        kwargs["speculative_config"] = {"method": args.speculative,
                                        **workload["prompt_lookup"]}
        token_ids = workload["copy_prompt"]
    llm = LLM(model, max_model_len=2048, max_num_seqs=8, kv_cache_memory_bytes=256 * 1024**2,
              **kwargs)
    if token_ids is None:  # random ids of the model's own vocabulary
        rng = random.Random(0)
        top = min(40000, len(llm.get_tokenizer()))
        token_ids = [rng.randrange(100, top) for _ in range(128)]
    prompt = {"prompt_token_ids": token_ids}
    engine = llm.llm_engine
    core = engine.engine_core
    runner = core.model_executor.model_runner  # pyright: ignore[reportAttributeAccessIssue]
    timer = SectionTimer()
    timer.wrap(engine, "step", "step (total)")
    timer.wrap(core.scheduler, "schedule", "scheduler.schedule")
    timer.wrap(runner, "_update_states", "runner: update states")
    timer.wrap(runner, "_prepare_inputs", "runner: prepare inputs")
    timer.wrap(runner, "_run_model", "forward (layers)")
    timer.wrap(runner.model, "compute_logits", "vocabulary projection")
    timer.wrap(runner, "_sampling_metadata", "sampling metadata")
    timer.wrap(runner.sampler, "__call__", "sampler")
    timer.wrap(runner, "_bookkeep", "runner: bookkeeping")
    if speculative:
        timer.wrap(runner.spec, "verify", "spec.verify")
        timer.wrap(runner.spec.rejection_sampler, "__call__", "  rejection sampler")
        from vllm.v1.spec_decode import rejection_sampler

        timer.wrap(rejection_sampler, "greedy_tokens", "    its argmax (native)")
        timer.wrap(runner.spec, "propose", "spec.propose")
    timer.wrap(core.scheduler, "update_from_output", "scheduler.update_from_output")
    timer.wrap(engine.output_processor, "process_outputs", "output processing")
    params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up

    def one_request() -> None:
        engine.reset_prefix_cache()
        engine.add_request("r", prompt, params)
        first = True
        while engine.has_unfinished_requests():
            timer.on = not first  # decode steps only: the first step is the prefill
            engine.step()
            first = False
        timer.on = False

    one_request()
    timer.clear()
    for _ in range(args.requests):
        one_request()
    steps = timer.calls["step (total)"]
    tokens = (args.steps - 1) * args.requests  # each prefill step made the first
    total = timer.wall["step (total)"]
    print(f"{args.quantization}: {args.requests} request(s), {steps} decode steps, "
          f"{total / steps * 1e3:.2f} ms a step ({tokens / total:.1f} tok/s)")
    if speculative:
        verified = timer.calls["spec.verify"]
        print(f"speculation {args.speculative} k={args.num_speculative_tokens}: {tokens} "
              f"tokens in {steps} steps ({tokens / steps:.2f} a step), {verified} of them "
              f"verifying drafts")
    print(f"{'section':<32}{'wall us/step':>14}{'cpu us/step':>14}{'share':>8}"
          + (f"{'cpu us/token':>14}" if speculative else ""))
    inner = 0.0
    for label in timer.wall:
        if label == "step (total)":
            continue
        if not label.startswith(" "):
            inner += timer.wall[label]
        print(f"{label:<32}{timer.wall[label] / steps * 1e6:>14.0f}"
              f"{timer.cpu[label] / steps * 1e6:>14.0f}{timer.wall[label] / total:>8.1%}"
              + (f"{timer.cpu[label] / tokens * 1e6:>14.0f}" if speculative else ""))
    rest = total - inner
    print(f"{'rest of the loop':<32}{rest / steps * 1e6:>14.0f}{'':>14}{rest / total:>8.1%}")
    forward = timer.wall["forward (layers)"] + timer.wall["vocabulary projection"]
    # The plain steps' sampler and the verification steps' argmax: the native kernel.
    model_parts = ("forward (layers)", "vocabulary projection", "sampler",
                   "    its argmax (native)")
    wall, cpu = (sum(t[k] for k in model_parts) for t in (timer.wall, timer.cpu))
    python_cpu = timer.cpu["step (total)"] - cpu
    print(f"engine Python per step (everything but forward, logits, plain sampler"
          f"{', the argmax of the verified positions' if speculative else ''}): "
          f"{(total - wall) / steps * 1e6:.0f} us wall, {python_cpu / steps * 1e6:.0f} us CPU"
          + (f"; per generated token {python_cpu / tokens * 1e6:.0f} us CPU"
             if speculative else ""))
    nbytes = weight_bytes(runner.model)
    print(f"weights read per step: {nbytes / 1e6:.1f} MB; {nbytes / (total / steps) / 1e9:.1f}"
          f" GB/s over the whole step, {nbytes / (forward / steps) / 1e9:.1f} GB/s over the "
          "forward and logits")

    if not args.torch_profile:
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        one_request()
    ops: collections.Counter[str] = collections.Counter()  # microseconds
    for event in prof.key_averages(group_by_input_shape=True):
        name = event.key
        if name == "vllm_cpu::quant_gemv" or name.startswith("vllm_cpu::"):
            shapes = event.input_shapes
            name = f"{name} N={shapes[1][0] if len(shapes) > 1 and shapes[1] else '?'}"
        ops[name] += event.self_cpu_time_total
    profiled = sum(ops.values())
    print(f"torch.profiler, one request ({args.steps} tokens, prefill included), self time:")
    for name, us in ops.most_common(15):
        print(f"  {us / profiled:6.1%}  {us / 1e3:8.1f} ms  {name[:90]}")


if __name__ == "__main__":
    main()
