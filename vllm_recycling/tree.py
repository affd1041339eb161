"""Static draft-tree templates.

A template is a list of paths; a path names a node by the child rank taken at each level below
the root: ``[0]`` is the root's top-1 successor, ``[0, 2]`` the third successor of that node. A
node's token is ``adj[token[parent], rank]``. Compiled, node 0 is the root (the request's last
token) and nodes 1..N follow in breadth-first order, so every level is a contiguous slice and
every prefix of the node list is itself a valid tree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

MAX_DEPTH = 16
MAX_NODES = 256
DEFAULT_TREE = "2.2.2"


class TreeTemplateError(ValueError):
    """A template that cannot be compiled; the message names the offending node."""


@dataclass(frozen=True)
class TreeTemplate:
    """A compiled template. N = number of draft nodes, D = maximum depth; index 0 is the root.

    parent     [N+1] int64, parent node index (-1 for the root)
    depth      [N+1] int64, 0 for the root
    rank       [N+1] int64, child rank under the parent (0 for the root)
    ancestors  [N+1, N+1] bool, ancestors[i, j]: j is i or an ancestor of i (the tree mask)
    rank_path  [N+1, D] int64, the ranks taken from the root down to node i, -1 padded (lets a
               kernel compute any node's token on its own, without waiting for its parent's)
    level_starts: nodes of depth d are level_starts[d]:level_starts[d+1]
    """

    name: str
    paths: tuple[tuple[int, ...], ...]
    parent: torch.Tensor
    depth: torch.Tensor
    rank: torch.Tensor
    ancestors: torch.Tensor
    rank_path: torch.Tensor
    level_starts: tuple[int, ...]

    @property
    def num_nodes(self) -> int:
        """Draft nodes, the root excluded: the number of speculative tokens per step."""
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return len(self.level_starts) - 2

    def to(self, device: torch.device | str) -> "TreeTemplate":
        tensors = {
            f: getattr(self, f).to(device)
            for f in ("parent", "depth", "rank", "ancestors", "rank_path")
        }
        return TreeTemplate(self.name, self.paths, level_starts=self.level_starts, **tensors)


def shipped_trees() -> dict[str, Path]:
    """Template names shipped in ``configs/trees`` and their files."""
    folder = resources.files("vllm_recycling.configs") / "trees"
    return {Path(f.name).stem: Path(str(f)) for f in folder.iterdir() if f.name.endswith(".json")}


def load_tree(spec: str | Path | Sequence[Sequence[int]], topk: int) -> TreeTemplate:
    """Load a template from a shipped name, a JSON file path, or an inline list of paths.

    A file holds either a list of paths or ``{"name": ..., "paths": [...]}``.
    """
    if isinstance(spec, (str, Path)):
        shipped = shipped_trees()
        if isinstance(spec, str) and spec in shipped:
            name, path = spec, shipped[spec]
        else:
            path = Path(spec)
            if not path.is_file():
                raise TreeTemplateError(
                    f"tree {str(spec)!r} is neither a shipped template ({', '.join(sorted(shipped))}) "
                    "nor a readable file"
                )
            name = path.stem
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise TreeTemplateError(f"tree file {path}: {e}") from e
        if isinstance(data, dict):
            name = data.get("name", name)
            data = data.get("paths")
        return compile_tree(data, topk=topk, name=name)
    return compile_tree(spec, topk=topk, name="inline")


def compile_tree(paths: Sequence[Sequence[int]], topk: int, name: str = "inline") -> TreeTemplate:
    """Validate a list of paths and compile it to index tensors.

    Rules: at least one node; each path a non-empty list of ints with 0 <= rank < topk; depth at
    most MAX_DEPTH; no path twice; every node's parent listed before it. Nodes are then ordered
    breadth-first (stable within a level), which keeps parents before children.
    """
    if not isinstance(paths, (list, tuple)) or len(paths) == 0:
        raise TreeTemplateError(f"tree {name!r}: expected a non-empty list of paths, got {paths!r}")
    if len(paths) > MAX_NODES:
        raise TreeTemplateError(f"tree {name!r}: {len(paths)} nodes, at most {MAX_NODES} allowed")
    seen: dict[tuple[int, ...], int] = {(): -1}
    for i, p in enumerate(paths):
        where = f"tree {name!r} node {i} {p!r}"
        if not isinstance(p, (list, tuple)) or len(p) == 0 or not all(
            isinstance(r, int) and not isinstance(r, bool) for r in p
        ):
            raise TreeTemplateError(f"{where}: a path must be a non-empty list of integer ranks")
        p = tuple(p)
        if len(p) > MAX_DEPTH:
            raise TreeTemplateError(f"{where}: depth {len(p)} exceeds the limit {MAX_DEPTH}")
        bad = [r for r in p if not 0 <= r < topk]
        if bad:
            raise TreeTemplateError(f"{where}: rank {bad[0]} outside 0..{topk - 1} (topk={topk})")
        if p in seen:
            raise TreeTemplateError(f"{where}: duplicate of node {seen[p]}")
        if p[:-1] not in seen:
            raise TreeTemplateError(f"{where}: its parent {list(p[:-1])} is not listed before it")
        seen[p] = i

    ordered = sorted((tuple(p) for p in paths), key=len)  # stable: keeps order within a level
    index = {(): 0} | {p: i + 1 for i, p in enumerate(ordered)}
    n1 = len(ordered) + 1
    max_depth = len(ordered[-1])
    parent = [-1] + [index[p[:-1]] for p in ordered]
    depth = [0] + [len(p) for p in ordered]
    rank = [0] + [p[-1] for p in ordered]

    rank_path = torch.full((n1, max_depth), -1, dtype=torch.int64)
    ancestors = torch.zeros((n1, n1), dtype=torch.bool)
    for i, p in enumerate([()] + ordered):
        chain = [index[p[:d]] for d in range(len(p) + 1)]
        ancestors[i, chain] = True
        rank_path[i, : len(p)] = torch.tensor(p, dtype=torch.int64)
    parent_t = torch.tensor(parent, dtype=torch.int64)
    level_starts = tuple(depth.index(d) for d in range(max_depth + 1)) + (n1,)
    return TreeTemplate(
        name=name,
        paths=tuple(ordered),
        parent=parent_t,
        depth=torch.tensor(depth, dtype=torch.int64),
        rank=torch.tensor(rank, dtype=torch.int64),
        ancestors=ancestors,
        rank_path=rank_path,
        level_starts=level_starts,
    )


@dataclass(frozen=True)
class HybridTree:
    """The draft tree of the context branch: the matrix template's nodes, plus a chain of
    ``context_length`` nodes under the root whose tokens are the request's context match
    (``kernels.context_match``), not matrix rows. Compiled as one template (``tree``: what
    verification and the budget see) whose context nodes come first in their level, so that
    where a context node and a matrix sibling hold the same token the walk follows the
    context chain; ``matrix`` is what the draft kernel gathers.

    matrix_nodes [Nm+1] int64: the hybrid node of each matrix template node (root 0).
    context_nodes [C] int64: the hybrid node of the context chain's depth 1..C.
    """

    tree: TreeTemplate
    matrix: TreeTemplate
    matrix_nodes: torch.Tensor
    context_nodes: torch.Tensor

    @property
    def context_length(self) -> int:
        return int(self.context_nodes.numel())

    def to(self, device: torch.device | str) -> "HybridTree":
        return HybridTree(self.tree.to(device), self.matrix.to(device), self.matrix_nodes.to(device),
                          self.context_nodes.to(device))

    @cached_property
    def context_cols(self):
        """The context nodes' columns among the non-root nodes, a host array (read once)."""
        return self.context_nodes.cpu().numpy() - 1

    def sendable(self, num: int, valid=None):
        """[num, N] bool over the non-root nodes: every matrix node, and the context nodes that
        have a token (``valid`` [num, C], ``drafts.Context.valid``; None: no match, none)."""
        send = np.ones((num, self.tree.num_nodes), dtype=bool)
        send[:, self.context_cols] = False if valid is None else valid
        return send


def hybrid_tree(matrix: TreeTemplate, context_length: int, topk: int) -> HybridTree:
    """``matrix`` with a context chain of ``context_length`` nodes (0: none, the matrix template
    itself). The chain's first node takes rank ``topk`` under the root (no matrix rank), its
    descendants rank 0 under it; the whole tree must stay within MAX_NODES and MAX_DEPTH."""
    if context_length == 0:
        nodes = torch.arange(matrix.num_nodes + 1)
        return HybridTree(matrix, matrix, nodes, torch.zeros(0, dtype=torch.int64))
    context = [(topk,) + (0,) * d for d in range(context_length)]
    tree = compile_tree(context + list(matrix.paths), topk=topk + 1,
                        name=f"{matrix.name}+context{context_length}")
    index = {p: i + 1 for i, p in enumerate(tree.paths)}
    matrix_nodes = torch.tensor([0] + [index[p] for p in matrix.paths], dtype=torch.int64)
    context_nodes = torch.tensor([index[p] for p in context], dtype=torch.int64)
    return HybridTree(tree, matrix, matrix_nodes, context_nodes)
