"""A plain transformers decoding loop running the whole method at batch 1.

It is the oracle the vLLM integration is measured against: prefill the prompt, then each step
draft a tree from the last token, verify it in one forward pass with a 4-D tree mask and
positions = prefix length + depth, update the matrix from every node's logits, accept a path
by the plugin's own rule (``tools.accept.accept_tree``: every node sampled with its output
position's noise, the tree walked by the sampled tokens), and keep only the root and the
accepted path in the KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_recycling.drafts import Context, draft
from vllm_recycling.matrix import AdjacencyMatrix
from vllm_recycling.tools.accept import accept_tree, target_probs
from vllm_recycling.tree import TreeTemplate, hybrid_tree
from vllm_recycling.tree_step import TreeLayout


@dataclass
class Generation:
    """tokens: the generated ids (EOS included when hit). tokens_per_step: for every tree step,
    the tokens the verifier emitted (accepted draft nodes + 1), before truncation to the limit.
    The first token comes from the prefill and counts in no step, as in vLLM."""

    tokens: list[int] = field(default_factory=list)
    tokens_per_step: list[int] = field(default_factory=list)

    @property
    def mat(self) -> float:
        """Mean accepted tokens per step, the bonus token included."""
        return sum(self.tokens_per_step) / max(len(self.tokens_per_step), 1)


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None


class ReferenceDecoder:
    """model: a Hugging Face causal LM (Llama-like, DynamicCache); tree and matrix from the core;
    context_length: the context branch's nodes (``config.CONTEXT_LENGTH`` as the plugin has it
    by default, 0 for none). Every step verifies every matrix node and the context nodes that
    have a token (the plugin's ``budget: "fixed"``)."""

    def __init__(self, model, tree: TreeTemplate, matrix: AdjacencyMatrix, context_length: int = 0) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.hybrid = hybrid_tree(tree, context_length, matrix.topk).to(self.device)
        self.tree = self.hybrid.tree
        self.layout = TreeLayout.from_template(self.tree, self.device)
        self.matrix = matrix
        n1 = self.tree.num_nodes + 1
        mask = torch.zeros((n1, n1), dtype=model.dtype, device=self.device)
        self.tree_bias = mask.masked_fill(~self.tree.ancestors, torch.finfo(model.dtype).min)
        # Set to a list (with a matrix that keeps probabilities) to record every step's
        # (node confidences [N+1], whether each node's token is the target's argmax at its
        # parent [N+1], root True): what the adaptive budget would have seen, and what verifying
        # any subtree greedily would have accepted (benchmarks/studies/budget_projection.py).
        self.trace: list[tuple[list[float], list[bool]]] | None = None

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        eos_token_id: int | list[int] | None = None,
        sampling: SamplingSettings = SamplingSettings(),
        request_id: str = "0",
    ) -> Generation:
        from transformers import DynamicCache

        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(self.device).manual_seed(sampling.seed)
        greedy = sampling.temperature <= 0
        temperature = None if greedy else torch.full((1,), sampling.temperature, device=self.device)
        top_k = None if sampling.top_k is None else torch.full((1,), sampling.top_k, device=self.device)
        top_p = None if sampling.top_p is None else torch.full((1,), sampling.top_p, device=self.device)

        self.matrix.allocate(request_id)
        slots = self.matrix.slots([request_id])
        out = Generation()
        try:
            cache = DynamicCache()
            prompt = torch.tensor([prompt_ids], device=self.device)
            logits = self.model(input_ids=prompt, past_key_values=cache, use_cache=True).logits
            last = logits[0, -1:].float()
            first = self.matrix.update(prompt[:, -1:], last, slots)[0]
            if not greedy:
                first = torch.multinomial(target_probs(last, temperature, top_k, top_p)[0], 1, generator=generator)[0]
            out.tokens.append(int(first))
            while len(out.tokens) < max_new_tokens and out.tokens[-1] not in eos:
                prefix = cache.get_seq_length()
                root = torch.tensor([out.tokens[-1]], device=self.device)
                history = np.asarray([list(prompt_ids) + out.tokens], dtype=np.int32)
                context = Context.find(history, [0], np.array([history.shape[1]]), self.hybrid.context_length)
                drafted = draft(self.matrix, self.hybrid, root, slots, context, with_probs=self.trace is not None)
                every, conf = drafted if self.trace is not None else (drafted, None)
                nodes = self._verified_nodes(context)
                rows = np.concatenate([[0], nodes])
                tokens = every[:, rows]
                sub = self.tree_bias[rows][:, rows]
                mask = torch.cat(
                    [torch.zeros((rows.size, prefix), dtype=sub.dtype, device=self.device), sub], dim=1)
                logits = self.model(
                    input_ids=tokens,
                    position_ids=(prefix + self.tree.depth[rows])[None],
                    attention_mask=mask[None, None],
                    past_key_values=cache,
                    use_cache=True,
                ).logits[0].float()
                argmax = self.matrix.update(tokens, logits, slots)
                path = accept_tree(self.layout, tokens, logits, temperature, top_k, top_p, generator,
                                   nodes=None if nodes.size == self.tree.num_nodes else nodes)
                accepted = int(path.num_accepted[0])
                if self.trace is not None:  # over every node of the tree; one not verified never matches
                    local = np.full(self.tree.num_nodes + 1, -1)
                    local[rows] = np.arange(rows.size)
                    parent_row = local[self.tree.parent.clamp(min=0).cpu().numpy()]
                    match = np.zeros(self.tree.num_nodes + 1, dtype=bool)
                    ok = (local >= 0) & (parent_row >= 0)
                    match[ok] = every[0, ok].cpu().numpy() == argmax[parent_row[ok]].cpu().numpy()
                    match[0] = True
                    self.trace.append((conf[0].tolist(), match.tolist()))
                _keep_path(cache, prefix, path.nodes[0, : accepted + 1])
                out.tokens_per_step.append(accepted + 1)
                for token in path.output_tokens[0, : accepted + 1].tolist():
                    out.tokens.append(token)
                    if token in eos or len(out.tokens) == max_new_tokens:
                        break
        finally:
            self.matrix.free(request_id)
        return out


    def _verified_nodes(self, context) -> np.ndarray:
        """The template nodes (root excluded, breadth-first) verified this step: every matrix node
        and the context nodes that have a token, as the plugin's budget "fixed" sends."""
        return np.flatnonzero(self.hybrid.sendable(1, None if context is None else context.valid)[0]) + 1


def _keep_path(cache, prefix: int, nodes: torch.Tensor) -> None:
    """KV compaction: the tree's entries start at ``prefix``; keep the root and the accepted
    nodes, in depth order, at positions prefix, prefix+1, ..."""
    keep = torch.cat([torch.arange(prefix, device=nodes.device), prefix + nodes])
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, keep)
        layer.values = layer.values.index_select(-2, keep)
