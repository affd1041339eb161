"""Token Recycling speculative decoding for vLLM."""

__version__ = "0.1.0"

# The runtime modules log under "vllm." (``vllm.logger.init_logger(LOGGER_NAME)``), so that
# vLLM's logging configuration (format, level) applies to their lines too.
LOGGER_NAME = "vllm.plugins.vllm_recycling"
