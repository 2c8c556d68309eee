"""Runs inside llama-cpp-python's virtual environment: llama.cpp's side of the concurrency
sweeps of `benchmark_peers.py`, N requests decoded together through llama.cpp's own batched
API, as its `batched` and `parallel` examples and its server with `n_parallel` N do.

    VENV/bin/python llama_cpp_batched_driver.py MODEL.gguf OUTPUT_LEN THREADS WORKLOAD.json \\
        [--n-batch 2048] [--n-ubatch 512] [--flash-attn auto] [--check]

WORKLOAD.json as for the other drivers ({"concurrency": [...], "prompts": [...],
"repeats": r}). For each concurrency c, the first c prompts (token ids, no BOS added) in one
context with `n_seq_max` = c and a KV cache for all of them (each sequence its own stream of
its longest prompt plus OUTPUT_LEN, rounded up to 256 cells). Each step is one `llama_batch`:
first every generating sequence's last token (its own seq id and position), then prompt
tokens of the sequences still prefilling, in prompt order, up to `n_batch` tokens (a prompt
longer than what is left goes in pieces); a sequence's logits are asked for at its last
prompt token and at each generated token. Greedy: the argmax of each sequence's logits row.
EOS is ignored: every sequence gets exactly OUTPUT_LEN tokens. The KV cache is cleared
before each run, and each context gets a warm-up run first.

Prints {"engine": "llama.cpp", "concurrency": c, "tokens": n, "seconds": s} per concurrency
and repeat: output tokens over the wall time from the first prompt token to the last output
token, prefill included, as the other drivers measure.

`--flash-attn`: llama.cpp's default is `auto` (on where the backend has it, as on CPUs),
what its server and examples run with; llama-cpp-python's `Llama` turns it off unless told.

`--check`: instead of timing, checks the batching. One request: its greedy tokens against
`Llama.generate` on the same prompt (same thread count and flash attention). Four requests:
each sequence's tokens against the same prompt run alone through this driver. Prints one
JSON line per sequence ({"check", "sequence", "matching", "of", "first_difference"}; where
they differ, "margin_alone_at_difference": the run alone's gap between its best and
second-best logit there, a near tie that other float sums in a batch can flip) and exits 1
if the one-request check differs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # enum llama_flash_attn_type


class Batched:
    """One model and the batched decode loop over contexts made for a number of sequences."""

    def __init__(self, model_path: str, threads: int, n_batch: int, n_ubatch: int,
                 flash_attn: str) -> None:
        import llama_cpp  # pyright: ignore[reportMissingImports]  (the peer's venv)

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's log
        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        model = llama_cpp.llama_model_load_from_file(model_path.encode(),
                                                     llama_cpp.llama_model_default_params())
        vocab = llama_cpp.llama_model_get_vocab(model) if model else None
        if not model or not vocab:
            raise SystemExit(f"llama.cpp could not load {model_path}")
        self.model = model
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        self.threads, self.n_batch, self.n_ubatch = threads, n_batch, n_ubatch
        self.flash_attn = FLASH_ATTN[flash_attn]
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

    def context(self, n_seq: int, n_ctx_seq: int):
        """A context for `n_seq` sequences of up to `n_ctx_seq` tokens each."""
        lib = self.lib
        params = lib.llama_context_default_params()
        n_ctx_seq = -(-n_ctx_seq // 256) * 256
        params.n_ctx = n_seq * n_ctx_seq  # split into one KV stream a sequence
        params.n_seq_max = n_seq
        params.n_batch = self.n_batch
        params.n_ubatch = min(self.n_ubatch, self.n_batch)
        params.n_threads = params.n_threads_batch = self.threads
        params.flash_attn_type = self.flash_attn
        ctx = lib.llama_init_from_model(self.model, params)
        if not ctx:
            raise SystemExit(f"llama.cpp could not make a context for {n_seq} sequences "
                             f"of {n_ctx_seq} tokens")
        return ctx

    def clear(self, ctx) -> None:
        """Empties `ctx`'s KV cache (every sequence)."""
        memory = self.lib.llama_get_memory(ctx)
        if memory is None:
            raise SystemExit("llama.cpp's context has no memory (KV cache)")
        self.lib.llama_memory_clear(memory, True)

    def generate(self, ctx, prompts: list[list[int]], output_len: int,
                 margins: list[list[float]] | None = None) -> list[list[int]]:
        """Greedy continuations of exactly `output_len` tokens, all prompts decoded together
        in `ctx` (made for at least len(prompts) sequences, its cache cleared). `margins`,
        if given, gets each sequence's gap between its best and second-best logit at each
        token (how close to a tie the argmax was)."""
        import numpy as np

        lib, batch = self.lib, self.batch
        fed = [0] * len(prompts)  # prompt tokens in the cache, per sequence
        outputs: list[list[int]] = [[] for _ in prompts]

        def add(token: int, pos: int, seq: int, logits: bool) -> int:
            i = batch.n_tokens
            batch.token[i], batch.pos[i] = token, pos
            batch.n_seq_id[i], batch.seq_id[i][0] = 1, seq
            batch.logits[i] = logits
            batch.n_tokens = i + 1
            return i

        while any(len(out) < output_len for out in outputs):
            batch.n_tokens = 0
            rows: dict[int, int] = {}  # sequence -> its logits' row in this batch
            for seq, (prompt, out) in enumerate(zip(prompts, outputs)):
                if out and len(out) < output_len:
                    rows[seq] = add(out[-1], len(prompt) + len(out) - 1, seq, True)
            for seq, prompt in enumerate(prompts):
                room = self.n_batch - batch.n_tokens
                if fed[seq] == len(prompt) or room == 0:
                    continue
                end = min(len(prompt), fed[seq] + room)
                for pos in range(fed[seq], end):
                    add(prompt[pos], pos, seq, pos == len(prompt) - 1)
                if end == len(prompt):
                    rows[seq] = batch.n_tokens - 1
                fed[seq] = end
            status = lib.llama_decode(ctx, batch)
            if status != 0:
                raise SystemExit(f"llama_decode returned {status} ({batch.n_tokens} tokens)")
            for seq, i in rows.items():
                logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, i),
                                               shape=(self.n_vocab,))
                outputs[seq].append(int(logits.argmax()))
                if margins is not None:
                    second, first = np.partition(logits, -2)[-2:]
                    margins[seq].append(float(first - second))
        return outputs


def check(engine: Batched, args: argparse.Namespace, prompts: list[list[int]],
          output_len: int) -> int:
    """The batching against one request at a time (see the module's docstring)."""
    from llama_cpp import Llama  # pyright: ignore[reportMissingImports]

    def report(name: str, seq: int, got: list[int], want: list[int]) -> bool:
        diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        row = {"check": name, "sequence": seq,
               "matching": sum(a == b for a, b in zip(got, want)), "of": len(want),
               "first_difference": diff}
        if diff is not None:  # the run alone's best-to-second logit gap there
            row["margin_alone_at_difference"] = round(margins[seq][diff], 4)
        print(json.dumps(row), flush=True)
        return diff is None and len(got) == len(want)

    n_ctx_seq = max(len(p) for p in prompts[:4]) + output_len
    alone_ctx = engine.context(1, n_ctx_seq)
    alone, margins = [], []
    for prompt in prompts[:4]:
        engine.clear(alone_ctx)
        gaps: list[float] = []
        margins.append(gaps)
        alone.append(engine.generate(alone_ctx, [prompt], output_len, [gaps])[0])
    engine.lib.llama_free(alone_ctx)

    reference = Llama(model_path=args.model, n_ctx=2048, n_threads=args.threads,
                      n_threads_batch=args.threads, n_batch=512,
                      flash_attn=args.flash_attn != "off", verbose=False)
    want = []
    for token in reference.generate(prompts[0], temp=0.0, top_k=1, reset=True):
        want.append(token)
        if len(want) == output_len:
            break
    ok = report("1 request / Llama.generate", 0, alone[0], want)

    together_ctx = engine.context(4, n_ctx_seq)
    together = engine.generate(together_ctx, prompts[:4], output_len)
    engine.lib.llama_free(together_ctx)
    for seq, (got, single) in enumerate(zip(together, alone)):
        report("4 requests / each alone", seq, got, single)
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("output_len", type=int)
    parser.add_argument("threads", type=int)
    parser.add_argument("workload")
    parser.add_argument("--n-batch", type=int, default=2048,
                        help="tokens a llama_decode call takes (llama.cpp's default)")
    parser.add_argument("--n-ubatch", type=int, default=512,
                        help="tokens a forward pass takes (llama.cpp's default)")
    parser.add_argument("--flash-attn", choices=sorted(FLASH_ATTN), default="auto")
    parser.add_argument("--check", action="store_true",
                        help="check the batched tokens against one request at a time")
    args = parser.parse_args()
    with open(args.workload) as f:
        spec = json.load(f)
    prompts = spec["prompts"]
    engine = Batched(args.model, args.threads, args.n_batch, args.n_ubatch, args.flash_attn)
    if args.check:
        sys.exit(check(engine, args, prompts, args.output_len))
    for c in spec["concurrency"]:
        chosen = prompts[:c]
        ctx = engine.context(c, max(len(p) for p in chosen) + args.output_len)
        engine.generate(ctx, chosen, 8)  # warm-up: this context's buffers, the page cache
        for _ in range(spec.get("repeats", 1)):
            engine.clear(ctx)
            start = time.perf_counter()
            outputs = engine.generate(ctx, chosen, args.output_len)
            seconds = time.perf_counter() - start
            print(json.dumps({"engine": "llama.cpp", "concurrency": c,
                              "tokens": sum(len(out) for out in outputs),
                              "seconds": seconds}), flush=True)
        engine.lib.llama_free(ctx)


if __name__ == "__main__":
    main()
