"""Checks and arithmetic of tensor-parallel sharding, done before any rank starts."""

from __future__ import annotations

import os


def divide(numerator: int, denominator: int, what: str = "") -> int:
    if numerator % denominator:
        raise ValueError(f"{what or numerator} ({numerator}) is not divisible by "
                         f"tensor_parallel_size={denominator}.")
    return numerator // denominator


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: a slice of them, or one replicated head when the ranks
    outnumber them (tp 4 over 2 KV heads: ranks 0-1 hold head 0, ranks 2-3 head 1)."""
    return max(1, num_kv_heads // tp_size)


def kv_head_start(num_kv_heads: int, tp_size: int, rank: int) -> int:
    """The first KV head of `rank`'s slice (see `kv_heads_per_rank`)."""
    if tp_size >= num_kv_heads:
        return rank // (tp_size // num_kv_heads)
    return rank * (num_kv_heads // tp_size)


def _check_heads(heads: int, kv_heads: int, tp: int, what: str) -> None:
    if heads % tp:
        raise ValueError(f"{what}: {heads} attention heads cannot be split across "
                         f"tensor_parallel_size={tp} ranks (heads must be divisible by it).")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"{what}: {kv_heads} key/value heads cannot be split across "
                         f"tensor_parallel_size={tp} ranks (one must divide the other).")


def check_tp_divisibility(hf_config, tp: int) -> None:
    """Raises, naming the numbers, when a model's heads or feed-forward width cannot be
    sharded `tp` ways. Vocabularies are padded instead, so they never refuse."""
    if tp == 1:
        return
    name = getattr(hf_config, "architectures", None) or [type(hf_config).__name__]
    what = name[0]
    if getattr(hf_config, "is_encoder_decoder", False):
        for side in ("encoder", "decoder"):
            heads = getattr(hf_config, f"{side}_attention_heads")
            _check_heads(heads, heads, tp, f"{what} {side}")
            ffn = getattr(hf_config, f"{side}_ffn_dim")
            if ffn % tp:
                raise ValueError(f"{what} {side}: ffn_dim {ffn} is not divisible by "
                                 f"tensor_parallel_size={tp}.")
        return
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    _check_heads(heads, kv_heads, tp, what)
    inter = getattr(hf_config, "intermediate_size", None)
    if inter is not None and inter % tp:
        raise ValueError(f"{what}: intermediate_size {inter} is not divisible by "
                         f"tensor_parallel_size={tp}.")


def usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def check_cpu_ranks(num_ranks: int) -> None:
    """CPU ranks each need at least one core of their own."""
    cores = len(usable_cpus())
    if num_ranks > cores:
        raise ValueError(f"{num_ranks} CPU ranks (tensor_parallel_size x "
                         f"data_parallel_size) need a core each, but this process may use "
                         f"{cores}.")


def parse_cpu_ranges(text: str) -> list[int]:
    """"0-3,8" -> [0, 1, 2, 3, 8]."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"Bad CPU list {text!r} (expected e.g. '0-7' or '0,2,4')."
                             ) from None
        if last < first:
            raise ValueError(f"Bad CPU range {part!r} in {text!r}.")
        cpus.extend(range(first, last + 1))
    return cpus


def cpus_for_rank(bind: str | None, rank: int, world_size: int,
                  available: list[int] | None = None) -> list[int] | None:
    """The cores a CPU rank runs on, from vLLM's `VLLM_CPU_OMP_THREADS_BIND`:
    `auto` (or unset with more than one rank) splits this process's cores evenly in
    order; `0-7|8-15` lists each rank's cores; `all` / `nobind` leaves threads unbound.
    None means: do not bind.

    Example: 16 cores, `auto`, 2 ranks -> rank 0 [0..7], rank 1 [8..15].
    """
    if bind in ("all", "nobind") or (bind is None and world_size == 1):
        return None
    if bind is None or bind == "auto":
        cpus = available if available is not None else usable_cpus()
        if len(cpus) < world_size:
            raise ValueError(f"{world_size} ranks need a core each; {len(cpus)} available.")
        per = len(cpus) // world_size
        return cpus[rank * per:(rank + 1) * per]
    lists = bind.split("|")
    if len(lists) != world_size:
        raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND={bind!r} lists {len(lists)} core sets "
                         f"for {world_size} ranks; give one per rank, separated by '|'.")
    return parse_cpu_ranges(lists[rank])


def engine_cpus(bind: str | None, engine: int, num_engines: int,
                tp_size: int = 1) -> tuple[int, ...] | None:
    """The cores of data-parallel engine `engine` of `num_engines`: the union of its
    tensor-parallel ranks' cores, ranks numbered engine-major (`VLLM_CPU_OMP_THREADS_BIND`
    lists one core set per rank of every engine). None: unbound (one engine, or `all`).

    Example: 8 cores, `auto`, 2 engines of tp 2 -> engine 1 gets ranks 2 and 3: [4..7].
    """
    if num_engines == 1:
        return None
    world = num_engines * tp_size
    cpus: list[int] = []
    for rank in range(engine * tp_size, (engine + 1) * tp_size):
        rank_cpus = cpus_for_rank(bind, rank, world)
        if rank_cpus is None:
            return None
        cpus += rank_cpus
    return tuple(cpus)
