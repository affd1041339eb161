"""The plugin's own Prometheus metric on the OpenAI server's ``/metrics``.

``vllm_recycling:accepted_depth``: a histogram of accepted drafts per request per step (for a
tree, the depth of the accepted path; 0 when only the target's own token was emitted).

vLLM loads ``vllm.stat_logger_plugins`` entry points in the server's front-end process
(v1/engine/async_llm.py:147, v1/metrics/loggers.py:84-97) and hands every logger the
scheduler's per-step ``SpecDecodingStats`` (v1/spec_decode/metrics.py:18-52). That carries,
per draft position i, how many requests accepted at least i + 1 drafts, so the number of steps
that accepted exactly d drafts is ``per_pos[d - 1] - per_pos[d]`` (and ``drafts - per_pos[0]``
for d = 0): the histogram is exact. The matrix itself lives in the engine process; its fill is
logged there with every snapshot save.
"""

from __future__ import annotations

from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_recycling.config import ADDITIONAL_CONFIG_KEY

_HISTOGRAM = None

SPEC_DECODE_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}


def spec_decode_counters(llm) -> dict[str, int]:
    """vLLM's spec-decode counters of an offline ``LLM`` (``disable_log_stats=False``), summed
    over engines: drafts, draft_tokens, accepted."""
    counts = dict.fromkeys(SPEC_DECODE_COUNTERS.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in SPEC_DECODE_COUNTERS:
            counts[SPEC_DECODE_COUNTERS[metric.name]] += metric.value
    return counts


def _histogram(max_depth: int):
    """One histogram per process (Prometheus refuses a second registration of the name)."""
    global _HISTOGRAM
    if _HISTOGRAM is None:
        from prometheus_client import Histogram

        _HISTOGRAM = Histogram(
            "vllm_recycling:accepted_depth",
            "Drafts accepted per request per speculative step (the accepted tree depth).",
            labelnames=["model_name", "engine"],
            buckets=[d + 0.5 for d in range(max_depth)] + [float("inf")],
        )
    return _HISTOGRAM


class RecyclingStatLogger(StatLoggerBase):
    """Feeds ``vllm_recycling:accepted_depth``; inert unless the method is recycling."""

    def __init__(self, vllm_config, engine_index: int = 0):
        extra = vllm_config.additional_config or {}
        self.enabled = isinstance(extra, dict) and ADDITIONAL_CONFIG_KEY in extra
        if not self.enabled:
            return
        from vllm_recycling.config import RecyclingConfig

        depth = RecyclingConfig.from_vllm_config(vllm_config).draft_template().max_depth
        name = vllm_config.model_config.served_model_name
        self.histogram = _histogram(max(depth, 16))
        self.labels = {"model_name": name, "engine": str(engine_index)}

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        stats = getattr(scheduler_stats, "spec_decoding_stats", None)
        if not self.enabled or stats is None or stats.num_drafts == 0:
            return
        per_pos = list(stats.num_accepted_tokens_per_pos) + [0]
        child = self.histogram.labels(**{**self.labels, "engine": str(engine_idx)})
        at_least = [stats.num_drafts] + per_pos
        for depth in range(len(at_least) - 1):
            for _ in range(at_least[depth] - at_least[depth + 1]):
                child.observe(depth)

    def log_engine_initialized(self):
        pass
