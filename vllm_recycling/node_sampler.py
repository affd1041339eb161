"""Every row of a speculative step sampled as a plain step of vLLM's sampler would sample it.

A plain step (no speculation) turns request b's logits row into its token at output position
n with vLLM 0.32's ``Sampler.forward`` (v1/sample/sampler.py): allowed tokens, bad words,
min-tokens and logit bias, penalties, greedy argmax, temperature, min-p, top-k/top-p, then
noise: on the CPU ``TopKTopPSampler.forward_cpu`` (v1/sample/ops/topk_topp_sampler.py:315-352)
draws one 31-bit seed per row (from the request's generator when it is seeded, else from the
global one) and takes ``fused_gumbel_argmax(logits, seed)``, whose noise is a function of the
seed and the token only; elsewhere a seeded request falls back to ``forward_native``
(263-284), one exponential vector per row (``random_sample``, 555-577), drawn from its
generator.

``NodeSampler`` runs that same ``Sampler.forward`` over every row of a speculative step, with
each row's request's settings, its path as history, and the noise of its output position: a
node at depth d gets what position n + d would draw (one draw per depth from the request's
generator, shared by the depth's nodes). Only the noise source is the plugin's
(``PositionNoise``, in place of ``TopKTopPSampler``). The generator's state after each draw is
kept: once the step's emitted tokens are known, ``GeneratorStates.rewind`` puts each seeded
generator back to the state after its last emitted position, so it advances by exactly the
tokens emitted, as without speculation. Unseeded requests draw from the global generator (the
same distribution; a plain step's own draws differ in order). Where vLLM's sampler would use
another noise source (FlashInfer on CUDA, unseeded requests only), the rows use
``forward_native``'s: the same distribution.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn as nn

from vllm_recycling.paths import StepRows


class PositionNoise(nn.Module):
    """vLLM's ``TopKTopPSampler`` with the noise of each row set beforehand: ``seeds`` [T]
    int64 (CPU, for ``fused_gumbel_argmax``) or ``noise`` [T, V] (exponential, as
    ``random_sample`` draws it)."""

    def __init__(self, logprobs_mode: str) -> None:
        super().__init__()
        self.logprobs_mode = logprobs_mode
        self.seeds: torch.Tensor | None = None
        self.noise: torch.Tensor | None = None

    def forward(self, logits, generators, k, p):
        from vllm.v1.sample.ops.topk_topp_sampler import (
            apply_top_k_top_p,
            sample_with_exponential_noise,
        )

        logits = apply_top_k_top_p(logits, k, p)
        processed = None
        if self.logprobs_mode == "processed_logits":
            processed = logits
        elif self.logprobs_mode == "processed_logprobs":
            processed = logits.log_softmax(dim=-1, dtype=torch.float32)
        if self.seeds is not None:  # forward_cpu
            return torch.ops._C.fused_gumbel_argmax(logits.to(dtype=torch.float32), self.seeds), processed
        probs = logits.softmax(dim=-1, dtype=torch.float32)  # forward_native
        return sample_with_exponential_noise(probs, self.noise), processed


@dataclass
class GeneratorStates:
    """Per seeded request (batch index): its generator and its state after each of the step's
    draws (position n, n + 1, ...)."""

    states: dict[int, tuple[torch.Generator, list[torch.Tensor]]]

    def rewind(self, emitted: list[list[int]]) -> None:
        """emitted: per request (batch order) the tokens the step emitted (host lists). A
        request that emitted k tokens keeps the state after its k-th draw; one that emitted
        nothing (a discarded partial prefill) drew nothing from its generator: on the CPU
        ``patches.cpu_fixes.SeededChunkedPrefillOnCPU`` holds it out of the step's draws."""
        for b, (generator, states) in self.states.items():
            k = len(emitted[b]) if b < len(emitted) else 0
            if 0 < k < len(states):
                generator.set_state(states[k - 1])


NO_STATES = GeneratorStates({})


class NodeSampler:
    """sampler: the model runner's vLLM ``Sampler``, whose settings (logprobs mode, fp64
    noise) and noise source the rows follow."""

    def __init__(self, sampler) -> None:
        from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
        from vllm.v1.sample.sampler import Sampler

        forward = sampler.topk_topp_sampler.forward
        self.fp64 = bool(getattr(sampler, "use_fp64_gumbel", False))
        self.seeded_by_seeds = getattr(forward, "__func__", None) is TopKTopPSampler.forward_cpu and not self.fp64
        self.noise = PositionNoise(sampler.logprobs_mode)
        self.sampler = Sampler(sampler.logprobs_mode, self.fp64)
        self.sampler.topk_topp_sampler = self.noise

    def sample(self, logits: torch.Tensor, rows: StepRows, row_req: torch.Tensor, depth: torch.Tensor,
               sampling, spec_token_ids: list[list[int]]):
        """(``SamplerOutput`` over the rows [T], ``GeneratorStates``). logits [T, V]: the step's
        logits (modified in place); rows / row_req, depth [T] (the same on the device): the
        step's rows; sampling: the batch's ``SamplingMetadata``; spec_token_ids: per request,
        its scheduled drafts (host lists; node j of a request holds its draft j - 1)."""
        states = NO_STATES if sampling.all_greedy else self._set_noise(logits, rows, depth, sampling.generators)
        expanded = expand_metadata(sampling, rows, row_req, spec_token_ids)
        try:
            return self.sampler(logits=logits, sampling_metadata=expanded), states
        finally:  # the step's [T, V] noise is not kept until the next step (review 11-27, D8)
            self.noise.seeds = self.noise.noise = None

    def _set_noise(self, logits, rows: StepRows, depth: torch.Tensor, generators) -> GeneratorStates:
        num_rows, vocab = logits.shape
        states = {}
        self.noise.seeds = self.noise.noise = None
        if self.seeded_by_seeds:
            seeds = torch.randint(0, 2**31, (num_rows,), dtype=torch.long)
            for b, generator in generators.items():  # seeded requests only, as vLLM does
                drawn, kept = _draws(generator, rows, b, lambda g: torch.randint(
                    0, 2**31, (1,), generator=g, dtype=torch.long).item())
                if drawn:
                    seeds[_rows_of(rows, b)] = torch.tensor(drawn, dtype=torch.long)[rows.depth[_rows_of(rows, b)]]
                    states[b] = (generator, kept)
            self.noise.seeds = seeds
        else:
            dtype = torch.float64 if self.fp64 else torch.float32
            noise = torch.empty((num_rows, vocab), dtype=dtype, device=logits.device)
            if len(generators) != len(rows.start):
                noise.exponential_()
            for b, generator in generators.items():
                width = _depth_of(rows, b) + 1
                if width == 0:
                    continue
                per_depth = torch.empty((width, vocab), dtype=dtype, device=logits.device)
                kept = []
                for d in range(width):
                    per_depth[d].exponential_(generator=generator)
                    kept.append(generator.get_state())
                lo, hi = int(rows.start[b]), _end_of(rows, b)
                noise[lo:hi] = per_depth[depth[lo:hi]]
                states[b] = (generator, kept)
            self.noise.noise = noise
        return GeneratorStates(states)


def samples_rows(sampling) -> bool:
    """Whether a step with drafts is verified row by row: a request samples, or one has a
    logit bias (vLLM's rejection sampler, which verifies greedy steps, applies only min-tokens
    to the draft rows, v1/sample/rejection_sampler.py:335-340), penalties or bad words (their
    history on a greedy path would be known only after the forward, on the device: row by row
    every node's history is its scheduled path, known on the host beforehand), or a request is
    still short of its ``min_tokens`` (the rejection sampler masks stop tokens on its bonus
    row whatever that row's position, 149-160, where a plain step masks them only before
    ``min_tokens``: row by row each row is masked by its own position)."""
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor

    return (
        not sampling.all_greedy
        or not sampling.no_penalties
        or bool(sampling.bad_words_token_ids)
        or any((isinstance(p, LogitBiasLogitsProcessor) and p.biases)
               or (isinstance(p, MinTokensLogitsProcessor) and p.min_toks)
               for p in sampling.logitsprocs.non_argmax_invariant)
    )


def plain_greedy(sampling) -> bool:
    """Whether every row of a step with drafts emits its logits' argmax, as a plain greedy step
    does (v1/sample/sampler.py: no logits processor, mask or penalty changes it): nothing
    ``samples_rows`` verifies row by row, no allowed-token mask, no logprobs asked for (a
    thinking budget and logprob_token_ids are refused at the request,
    ``patches.SampleLikeAPlainStep``). Such a step is verified from the argmax the matrix
    update computes."""
    return (
        not samples_rows(sampling)
        and sampling.allowed_token_ids_mask is None
        and sampling.max_num_logprobs is None
    )


def _end_of(rows: StepRows, b: int) -> int:
    return int(rows.start[b + 1]) if b + 1 < len(rows.start) else len(rows.row_req)


def _rows_of(rows: StepRows, b: int) -> slice:
    return slice(int(rows.start[b]), _end_of(rows, b))


def _depth_of(rows: StepRows, b: int) -> int:
    """The deepest node of request b (-1 when b is not in the step)."""
    if b >= len(rows.start):
        return -1
    return int(rows.depth[_rows_of(rows, b)].max())


def _draws(generator, rows: StepRows, b: int, draw):
    """One draw per depth of request b's tree, and the generator's state after each."""
    drawn, kept = [], []
    for _ in range(_depth_of(rows, b) + 1):
        drawn.append(draw(generator))
        kept.append(generator.get_state())
    return drawn, kept


def expand_metadata(sampling, rows: StepRows, row_req: torch.Tensor, spec_token_ids: list[list[int]]):
    """vLLM's ``SamplingMetadata`` (v1/sample/metadata.py) of the batch, over the step's rows:
    every per-request setting repeated for each of the request's rows, each row's history its
    request's output then its path's drafts, the logits processors over the rows
    (``expand_logitsprocs``), no generators (the noise is set apart) and no logprobs of given
    tokens."""
    def rep(t):
        return None if t is None else t[row_req]

    histories = sampling.output_token_ids
    if not sampling.no_penalties or sampling.bad_words_token_ids:
        histories = path_histories(rows, sampling.output_token_ids, spec_token_ids)
    bad_words = {}
    for b, words in sampling.bad_words_token_ids.items():
        if b < len(rows.start):
            bad_words.update({t: words for t in range(*_rows_of(rows, b).indices(len(rows.row_req)))})
    no_penalties = sampling.no_penalties
    return replace(
        sampling,
        temperature=rep(sampling.temperature),
        top_p=rep(sampling.top_p),
        top_k=rep(sampling.top_k),
        generators={},
        prompt_token_ids=None if no_penalties else rep(sampling.prompt_token_ids),
        frequency_penalties=sampling.frequency_penalties if no_penalties else rep(sampling.frequency_penalties),
        presence_penalties=sampling.presence_penalties if no_penalties else rep(sampling.presence_penalties),
        repetition_penalties=sampling.repetition_penalties if no_penalties else rep(sampling.repetition_penalties),
        output_token_ids=histories,
        allowed_token_ids_mask=rep(sampling.allowed_token_ids_mask),
        bad_words_token_ids=bad_words,
        logitsprocs=expand_logitsprocs(sampling.logitsprocs, rows, row_req, sampling.output_token_ids),
        logprob_token_ids=None,
        spec_token_ids=None,
        thinking_budget_state_holder=None,
    )


def path_histories(rows: StepRows, output_token_ids: list[list[int]], spec_token_ids: list[list[int]]):
    """[T] lists: each row's history, its request's output tokens then the drafts on its path
    (the root: the output alone), as a plain step at that position would read it."""
    histories: list[list[int]] = []
    for t, (b, parent) in enumerate(zip(rows.row_req.tolist(), rows.parent.tolist())):
        if parent == t:  # a root
            histories.append(output_token_ids[b])
        else:
            histories.append([*histories[parent], spec_token_ids[b][t - int(rows.start[b]) - 1]])
    return histories


def expand_logitsprocs(logitsprocs, rows: StepRows, row_req: torch.Tensor, output_token_ids):
    """vLLM's built-in logits processors (v1/sample/logits_processor/builtin.py: min-p, logit
    bias, min-tokens) over the step's rows: copies whose per-request state is repeated for
    each row (min-tokens: on the rows at a depth its request still needs it), so that their own
    ``apply`` processes each row as it processes its request's row in a plain step."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinPLogitsProcessor,
        MinTokensLogitsProcessor,
    )

    expanded = LogitsProcessors()
    for group, into in ((logitsprocs.argmax_invariant, expanded.argmax_invariant),
                        (logitsprocs.non_argmax_invariant, expanded.non_argmax_invariant)):
        for proc in group:
            if isinstance(proc, MinPLogitsProcessor):
                proc = _copy_with(proc, min_p=proc.min_p[row_req]) if proc.min_p_count else proc
            elif isinstance(proc, LogitBiasLogitsProcessor):
                proc = _expand_logit_bias(proc, rows) if proc.biases else proc
            elif isinstance(proc, MinTokensLogitsProcessor):
                proc = _expand_min_tokens(proc, rows) if proc.min_toks else proc
            else:
                raise ValueError(
                    f"recycling: logits processor {type(proc).__name__} is not supported with "
                    "speculative sampling"
                )
            into.append(proc)
    return expanded


def _copy_with(proc, **state):
    clone = copy.copy(proc)
    for name, value in state.items():
        setattr(clone, name, value)
    return clone


def _expand_logit_bias(proc, rows: StepRows):
    reqs, toks, biases = [], [], []
    for b, bias in proc.biases.items():
        if b >= len(rows.start):
            continue
        for t in range(*_rows_of(rows, b).indices(len(rows.row_req))):
            reqs.extend([t] * len(bias))
            toks.extend(bias.keys())
            biases.extend(bias.values())
    return _copy_with(
        proc,
        bias_tensor=proc._device_tensor(biases, torch.float32),
        logits_slice=(proc._device_tensor(reqs, torch.int32), proc._device_tensor(toks, torch.int32)),
    )


def _expand_min_tokens(proc, rows: StepRows):
    reqs, toks, restore_reqs, restore_toks = [], [], [], []
    for b, (min_tokens, output, stop_ids, structured) in proc.min_toks.items():
        if b >= len(rows.start):
            continue
        remaining = min_tokens - len(output)
        span = _rows_of(rows, b)
        for t in np.flatnonzero(rows.depth[span] < remaining) + span.start:
            reqs.extend([int(t)] * len(stop_ids))
            toks.extend(stop_ids)
            if structured:
                restore_reqs.extend([int(t)] * len(stop_ids))
                restore_toks.extend(stop_ids)
    return _copy_with(
        proc,
        logits_slice=(proc._device_tensor(reqs, torch.int32), proc._device_tensor(toks, torch.int32)),
        restore_logits_slice=(proc._device_tensor(restore_reqs, torch.int32),
                              proc._device_tensor(restore_toks, torch.int32)),
    )


# What ``expand_logitsprocs`` reads of vLLM 0.32's built-in logits processors (private state).
_PROCESSOR_STATE = {
    "MinPLogitsProcessor": ("min_p", "min_p_count"),
    "LogitBiasLogitsProcessor": ("biases", "bias_tensor", "logits_slice", "_device_tensor"),
    "MinTokensLogitsProcessor": ("min_toks", "logits_slice", "restore_logits_slice", "_device_tensor"),
}


def self_check(sampler, logitsprocs, device) -> str | None:
    """At start-up, against the runner's own ``Sampler`` and logits processors: None when the
    rows of a speculative step are sampled as plain steps sample them here, else what differs
    (review R2: the vLLM internals this module relies on, checked before serving rather than
    failing, or changing seeded output, at the first sampled step).

    It checks the private state ``expand_logitsprocs`` reads on the runner's processors, then
    samples seeded requests (temperature, top-k) two positions deep both ways: two plain steps
    of the runner's sampler, and one ``NodeSampler`` step over a root and a draft per request;
    the tokens must be equal, and each generator, rewound to two emitted tokens, must be where
    two plain steps leave it (one draw per position: the seed draw ``forward_cpu`` makes, or the
    exponential noise ``random_sample`` draws)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    from vllm_recycling.paths import StepRowsOnDevice

    for proc in [*logitsprocs.argmax_invariant, *logitsprocs.non_argmax_invariant]:
        missing = [a for a in _PROCESSOR_STATE.get(type(proc).__name__, ()) if not hasattr(proc, a)]
        if missing:
            return f"vLLM's {type(proc).__name__} has no {', '.join(missing)}"
    requests, vocab = 4, 512
    host = torch.Generator().manual_seed(0)
    logits = (torch.randn(2 * requests, vocab, generator=host) * 3).to(device)

    def metadata(generators, spec=None) -> SamplingMetadata:
        zeros = torch.zeros(requests, device=device)
        return SamplingMetadata(
            temperature=torch.full((requests,), 0.8, device=device), all_greedy=False, all_random=True,
            top_p=None, top_k=torch.tensor([vocab, 50, 5, vocab], device=device), generators=generators,
            max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=zeros,
            presence_penalties=zeros, repetition_penalties=zeros + 1, output_token_ids=[[] for _ in range(requests)],
            allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
            spec_token_ids=spec,
        )

    def generators():
        return {b: torch.Generator(device=device).manual_seed(1000 + b) for b in range(requests)}

    plain_generators = generators()
    plain = [sampler(logits[d::2].clone(), metadata(plain_generators)).sampled_token_ids[:, 0].tolist()
             for d in range(2)]
    rows = StepRows.build([1] * requests, None)
    on_device = StepRowsOnDevice.of(rows, device)
    node_generators = generators()
    spec = [[int(t)] for t in plain[0]]
    output, states = NodeSampler(sampler).sample(
        logits.clone(), rows, on_device.row_req, on_device.depth, metadata(node_generators, spec), spec)
    ours = output.sampled_token_ids[:, 0].tolist()
    if ours[0::2] != plain[0] or ours[1::2] != plain[1]:
        return (f"seeded rows sampled {ours[0::2]} / {ours[1::2]} where plain steps sample "
                f"{plain[0]} / {plain[1]}: this vLLM draws its sampling noise otherwise")
    states.rewind([[0, 0]] * requests)
    for b in range(requests):
        if not torch.equal(node_generators[b].get_state(), plain_generators[b].get_state()):
            return "a seeded generator advances otherwise than one draw per sampled position"
    return None
