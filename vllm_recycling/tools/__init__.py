"""Tooling around the plugin, never imported by what runs inside vLLM: the reference decoder
(the method in a plain transformers loop, the oracle the engine is tested against), the
prompts of the benchmarks, and the preparation of the built-in models."""
