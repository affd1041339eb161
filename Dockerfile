# vLLM's OpenAI server image with the vllm-recycling plugin installed; the entry point is
# unchanged: docker run IMAGE MODEL --speculative-config '{"method": "recycling"}'
# (the plugin itself is not built yet: see the README's status table)
ARG VLLM_VERSION=v0.32.0
FROM vllm/vllm-openai:${VLLM_VERSION}
COPY . /opt/vllm-recycling
RUN pip install --no-cache-dir /opt/vllm-recycling
