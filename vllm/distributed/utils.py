"""Checks and arithmetic of tensor-parallel sharding, done before any rank starts."""

from __future__ import annotations

import os

from vllm.transformers_utils.config import is_encoder_decoder_config


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
    if is_encoder_decoder_config(hf_config):
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
    for key in ("intermediate_size", "moe_intermediate_size",
                "shared_expert_intermediate_size"):
        inter = getattr(hf_config, key, None)
        if inter and inter % tp:
            raise ValueError(f"{what}: {key} {inter} is not divisible by "
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


def numa_node_cpus(root: str = "/sys/devices/system/node") -> dict[int, list[int]]:
    """NUMA node -> its CPUs, from sysfs ({} where sysfs has no nodes)."""
    nodes: dict[int, list[int]] = {}
    if not os.path.isdir(root):
        return nodes
    for entry in sorted(os.listdir(root)):
        if entry.startswith("node") and entry[4:].isdigit():
            with open(os.path.join(root, entry, "cpulist")) as f:
                nodes[int(entry[4:])] = parse_cpu_ranges(f.read().strip())
    return nodes


def visible_memory_nodes(nodes: dict[int, list[int]] | None = None,
                         env: str | None = None) -> list[int] | None:
    """The NUMA nodes ranks are placed on: vLLM's `CPU_VISIBLE_MEMORY_NODES` ("0,1"), else
    every node where there are several; None on a single-node machine."""
    nodes = numa_node_cpus() if nodes is None else nodes
    text = os.environ.get("CPU_VISIBLE_MEMORY_NODES") if env is None else env
    if text:
        visible = parse_cpu_ranges(text)
        unknown = sorted(set(visible) - set(nodes))
        if unknown:
            raise ValueError(f"CPU_VISIBLE_MEMORY_NODES={text!r} names NUMA node(s) {unknown}; "
                             f"this machine has {sorted(nodes) or 'none'}.")
        return visible
    return sorted(nodes) if len(nodes) > 1 else None


def _node_of(rank: int, world_size: int, visible: list[int]) -> int:
    return visible[rank * len(visible) // world_size]


def memory_node_for_rank(rank: int, world_size: int,
                         visible: list[int] | None) -> int | None:
    """The NUMA node of `rank`: ranks fill the visible nodes in order, in equal groups
    (4 ranks on nodes [0, 1]: 0, 0, 1, 1)."""
    return _node_of(rank, world_size, visible) if visible else None


def cpus_for_rank(bind: str | None, rank: int, world_size: int,
                  available: list[int] | None = None,
                  nodes: dict[int, list[int]] | None = None,
                  visible: list[int] | None = None) -> list[int] | None:
    """The cores a CPU rank runs on, from vLLM's `VLLM_CPU_OMP_THREADS_BIND`:
    `auto` (or unset with more than one rank) places ranks on the visible NUMA nodes
    (`visible_memory_nodes`; each node's cores split among its ranks) or, on one node,
    splits this process's cores evenly in order; `0-7|8-15` lists each rank's cores;
    `all` / `nobind` leaves threads unbound. None means: do not bind.

    Example: 16 cores on one node, `auto`, 2 ranks -> rank 0 [0..7], rank 1 [8..15]; nodes
    {0: [0..7], 1: [8..15]} and 4 ranks -> ranks 0, 1 on node 0 ([0..3], [4..7]).
    """
    if bind in ("all", "nobind") or (bind is None and world_size == 1):
        return None
    if bind is None or bind == "auto":
        cpus = available if available is not None else usable_cpus()
        if visible:
            node = _node_of(rank, world_size, visible)
            node_cpus = set((nodes if nodes is not None else numa_node_cpus()).get(node, []))
            sharing = [r for r in range(world_size) if _node_of(r, world_size, visible) == node]
            cpus = [c for c in cpus if c in node_cpus]
            world_size, rank = len(sharing), sharing.index(rank)
        if len(cpus) < world_size:
            raise ValueError(f"{world_size} ranks need a core each; {len(cpus)} available.")
        per = len(cpus) // world_size
        return cpus[rank * per:(rank + 1) * per]
    lists = bind.split("|")
    if len(lists) != world_size:
        raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND={bind!r} lists {len(lists)} core sets "
                         f"for {world_size} ranks; give one per rank, separated by '|'.")
    return parse_cpu_ranges(lists[rank])


_MPOL_BIND = 2
_SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}


def bind_memory_to_node(node: int) -> None:
    """This process's future allocations come from NUMA node `node` (set_mempolicy
    MPOL_BIND; Linux x86-64 and arm64)."""
    import ctypes
    import platform

    number = _SYS_SET_MEMPOLICY.get(platform.machine())
    if number is None:
        raise OSError(f"set_mempolicy: unknown system call number on {platform.machine()}")
    mask = ctypes.c_ulong(1 << node)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, _MPOL_BIND, ctypes.byref(mask), ctypes.c_ulong(node + 2)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"set_mempolicy(MPOL_BIND, node {node}): {os.strerror(errno)}")


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
