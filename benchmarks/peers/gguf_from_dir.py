"""A GGUF file of a benchmark's model directory, for llama.cpp (`benchmark_peers.py --single
--gguf-file`): the tests' writer (`tests/test_gguf_families._write_gguf`) with the
directory's tokenizer, in a Q4_K_M-like mix: layer matrices Q4_K with Q6_K for the value
and down projections, stacked experts Q4_K (down Q6_K, or Q8_0 where the expert width is not
whole super-blocks of 256), embeddings and output Q8_0.

    python benchmarks/peers/gguf_from_dir.py /tmp/bm_moe/qwen3_moe /tmp/qwen3_moe-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.test_gguf_families import _write_gguf  # noqa: E402


def q4_k_m(name: str, expert_width: int = 256) -> str:
    """The type of a tensor; the experts' down projection reads rows of `expert_width`,
    which K-quants need in whole super-blocks of 256 (else Q8_0, llama.cpp's fallback)."""
    if "ffn_down_exps" in name and expert_width % 256:
        return "Q8_0"
    return "Q6_K" if ("attn_v" in name or "ffn_down" in name) else "Q4_K"


def main() -> None:
    parser = argparse.ArgumentParser(description="A benchmark directory as a Q4_K_M-like GGUF")
    parser.add_argument("model_dir")
    parser.add_argument("out")
    args = parser.parse_args()
    with open(os.path.join(args.model_dir, "config.json")) as f:
        config = json.load(f)
    width = config.get("moe_intermediate_size") or config["intermediate_size"]
    _write_gguf(args.out, args.model_dir, config["model_type"],
                expert_qtype=lambda name: q4_k_m(name, width), layer_qtype=q4_k_m,
                real_tokenizer=True)
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
