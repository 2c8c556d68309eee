"""Prefix hit rate of data-parallel routing on a shared-prefix workload.

    python benchmarks/benchmark_dp_routing.py MODEL [--dp 2] [--groups 8] [--per-group 8]

Two measurements of the same workload (`groups` prompt prefixes of `prefix_blocks` full
blocks, each followed by `per-group` distinct suffixes, shuffled, sent `concurrency` at a
time):

- simulated: the router (`PrefixAffinityRouter`) against a load-only router (what routing
  without affinity gives), each engine's prefix cache modelled as the set of blocks it
  prefilled; a request's hit is its leading blocks already in its engine's cache;
- served: `vllm serve MODEL -dp N` started here, the hit rate read from `/metrics`
  (prefix-cache hits / queries in tokens, summed over engines), and the requests each
  engine finished.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sys

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.server_utils import SMALL_ENGINE_ARGS, RemoteServer, scrape_metrics  # noqa: E402
from vllm.v1.engine.dp_router import PrefixAffinityRouter  # noqa: E402

BLOCK = 16


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(0)
    prefixes = [[rng.randrange(10, 700) for _ in range(args.prefix_blocks * BLOCK)]
                for _ in range(args.groups)]
    prompts = [prefix + [rng.randrange(10, 700) for _ in range(BLOCK)]
               for prefix in prefixes for _ in range(args.per_group)]
    rng.shuffle(prompts)
    return prompts


def block_hashes(ids: list[int]) -> list[int]:
    parent, hashes = hash(None), []
    for k in range(len(ids) // BLOCK):
        parent = hash((parent, tuple(ids[k * BLOCK:(k + 1) * BLOCK])))
        hashes.append(parent)
    return hashes


def simulate(prompts: list[list[int]], dp: int, concurrency: int, affinity: bool) -> float:
    """Hit rate in tokens; a request stays in flight until `concurrency` later ones came."""
    router = PrefixAffinityRouter(dp, capacity_blocks=10**6)
    caches: list[set[int]] = [set() for _ in range(dp)]
    in_flight: list[int] = []
    hits = queries = 0
    for ids in prompts:
        hashes = block_hashes(ids)
        loads = [in_flight.count(e) for e in range(dp)]
        engine = router.choose(hashes if affinity else [], loads, [True] * dp)
        router.record(engine, hashes)
        matched = next((k for k, h in enumerate(hashes) if h not in caches[engine]),
                       len(hashes))
        hits, queries = hits + matched * BLOCK, queries + len(ids)
        caches[engine].update(hashes)
        in_flight = (in_flight + [engine])[-concurrency:]
    return hits / queries


async def replay(url: str, model: str, prompts: list[list[int]], concurrency: int) -> None:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        async def one(ids: list[int]) -> None:
            async with limit:
                response = await http.post("/v1/completions", json={
                    "model": model, "prompt": ids, "max_tokens": 4, "ignore_eos": True})
                response.raise_for_status()

        await asyncio.gather(*[one(ids) for ids in prompts])


def served(model: str, prompts: list[list[int]], dp: int, concurrency: int
           ) -> tuple[float, list[float]]:
    server = RemoteServer(model, ["-dp", str(dp), *SMALL_ENGINE_ARGS, "--max-model-len", "1024"])
    try:
        asyncio.run(replay(server.url, model, prompts, concurrency))
        metrics = scrape_metrics(server)
    finally:
        server.stop()
    total = {"hits": 0.0, "queries": 0.0}
    per_engine = [0.0] * dp
    for name, value in metrics.items():
        for kind in total:
            if name.startswith(f"vllm:prefix_cache_{kind}_total{{"):
                total[kind] += value
        match = re.match(r'vllm:request_success_total\{engine="(\d+)"', name)
        if match:
            per_engine[int(match.group(1))] += value
    return total["hits"] / total["queries"], per_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--prefix-blocks", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--no-serve", action="store_true", help="simulate only")
    args = parser.parse_args()
    prompts = workload(args)
    # One shared cache: every prefix misses once, every suffix block always.
    ideal = (args.groups * (args.per_group - 1) * args.prefix_blocks * BLOCK
             / sum(map(len, prompts)))
    print(f"{len(prompts)} prompts of {len(prompts[0])} tokens, {args.groups} prefixes; "
          f"one shared cache would hit {ideal:.3f}")
    for affinity in (True, False):
        rate = simulate(prompts, args.dp, args.concurrency, affinity)
        print(f"simulated dp={args.dp} {'affinity' if affinity else 'load only'}: "
              f"hit rate {rate:.3f}")
    if not args.no_serve:
        for dp in (args.dp, 1):
            rate, per_engine = served(args.model, prompts, dp, args.concurrency)
            print(f"served dp={dp}: hit rate {rate:.3f}, requests per engine {per_engine}")


if __name__ == "__main__":
    main()
