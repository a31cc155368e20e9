#!/usr/bin/env bash
# The Python packages `train_bench.py --memory` needs on a GPU host that has CUDA torch,
# transformers and peft but none of the project's other packages and no registry (the device
# machine: Python 3.12, torch 2.11, transformers 5.17), as one tarball of a `site/` folder to put
# on PYTHONPATH there:
#   - what the job path imports that such a host lacks (versions of requirements/cuda.txt);
#   - Unsloth 2026.10.9 (../shared/PEERS.md) and what it imports, bitsandbytes for 4-bit bases
#     (Unsloth's QLoRA and the HF+PEFT QLoRA peer).
# Installed with --no-deps for Python 3.12 / manylinux x86_64 (run it where pip reaches PyPI),
# then Unsloth's studio/ folder and every bitsandbytes library but cuda130's and cpu's are removed, to
# stay under the device's 64 MiB a call.
#   bench/memory_site.sh            # writes .whl/memory-site.tar.gz (git-ignored)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-.venv/bin/python}"
out=.whl/memory-site.tar.gz
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
packages=(
  pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 annotated-types==0.8.0
  typing-inspection==0.4.5 python-dotenv==1.2.4 typing-extensions==4.16.0
  unsloth==2026.10.9 unsloth-zoo==2026.10.9 trl==1.15.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19
  tyro==1.0.17 docstring-parser==0.18.0 shtab==1.13.0 typeguard==4.6.1 cut-cross-entropy==25.1.1
  hf-transfer==0.1.9 msgspec==0.22.0 json5==0.17.3 nest-asyncio==1.6.0 structlog==26.1.0 torchao==0.17.0
  bitsandbytes==0.50.2
)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$py" -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --target "$work/site" "${packages[@]}"
rm -rf "$work/site/studio" "$work/site/bin" "$work/site/test"
find "$work/site/bitsandbytes" -name 'libbitsandbytes_*.so' ! -name '*_cuda130.so' ! -name '*_cpu.so' -delete
mkdir -p "$(dirname "$out")"
tar czf "$out" -C "$work" site
echo "$out: $(du -h "$out" | cut -f1)"
