#!/usr/bin/env bash
# Downloads into benchmarks/gpu_wheels/ (git-ignored) the wheels that `benchmarks/gpu_check.sh`
# installs on an offline GPU machine: torchtune 0.6.1 and what `import torchtune`, `tune run`
# and this package need there, for CPython 3.12 on manylinux x86-64.
#
#   bash benchmarks/gpu/fetch_gpu_wheels.sh          # needs pip and network access to PyPI
#
# Needs: any python3 with pip (the wheels are chosen by the --python-version/--platform flags,
# not by the interpreter that runs pip). Takes ~10-20 s. Writes ~12 MiB.
#
# The GPU machine is assumed to have Python 3.12, torch (2.11, CUDA 13), transformers (with
# huggingface_hub, tokenizers, numpy, pyyaml, regex, httpx, filelock, fsspec), sentencepiece,
# safetensors, tqdm, and also pyarrow and pandas (see "Not carried" below). Everything is
# downloaded with --no-deps from an explicit, pinned list, because the resolver would otherwise
# pull torch and the CUDA libraries (gigabytes) that the machine already has.
#
# Then, to run the check on the GPU machine, the device tool is called with
#   carry: ["benchmarks/gpu_wheels"]   command: bash benchmarks/gpu_check.sh $OUT   timeout_s: 540
# (the working tree plus the carried folder must stay under 64 MiB; the repo is ~5 MB).
#
# Why these versions:
# - torchao 0.14.1, the newest release that pyproject.toml allows (<0.15). With torch 2.11 it
#   warns "Skipping import of cpp extensions due to incompatible torch version" (it is built
#   against an older torch) and runs its Python code, which is all that torchtune 0.6.1 imports
#   (NF4Tensor, quantization APIs); this recipe calls none of its kernels. Checked with torch
#   2.11.0: import torchtune, the recipe, its tests (see benchmarks/RESULTS.md, "GPU check").
#   The only torchao built against torch 2.11 (0.17.0, no such warning) cannot serve: from
#   0.16.0 on, torchtune.training fails to import (`int4_weight_only` is gone from
#   torchao.quantization).
# - datasets 5.2.0: the version the CPU tests use; it needs huggingface_hub >= 1.31 and
#   pyarrow >= 24.
# - the rest: the versions the CPU tests use.
#
# Not carried, on purpose:
# - pyarrow (55 MB for 26.0.1, ~40 MB for any cp312 release) and pandas (12 MB): `datasets`
#   imports both at import time, but with them the folder would not fit the 64 MiB the device
#   tool carries. The GPU image has both (so gpu_check.sh skips wheels whose package is
#   already installed anyway); on a machine without them `import torchtune` fails, and
#   gpu_check.sh says so in its install step.
# - hf_transfer (3.5 MB; torchtune imports it inside try/except, only to speed up downloads),
#   blobfile + pycryptodomex (tiktoken imports blobfile only for remote paths), Pillow (imported
#   only by image datasets), lxml: none is imported by `import torchtune`, `tune run` or this
#   recipe.

set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DEST=${1:-$ROOT/benchmarks/gpu_wheels}
PY=${PYTHON:-python3}
MAX_MIB=${GPU_WHEELS_MAX_MIB:-50}

# What the GPU image lacks (its package list has none of these).
CORE=(
  torchtune==0.6.1
  torchao==0.14.1
  torchdata==0.11.0       # torchtune pins it; imported by torchtune.data
  datasets==5.2.0         # imported by torchtune.datasets
  dill==0.4.1             # datasets
  multiprocess==0.70.19   # datasets
  omegaconf==2.4.0        # torchtune.config; 2.4 has no antlr4 runtime dependency
  kagglehub==1.0.3        # `tune` imports it for `tune download`, also for `tune run`
  kagglesdk==0.1.38       # kagglehub
)
# Present on the GPU image, but not installed by torch + transformers alone: carried so that a
# machine with only those still gets everything except pyarrow/pandas (they are small).
EXTRA=(
  tiktoken==0.14.0        # torchtune.models.llama3 tokenizers
  psutil==7.2.2           # torchtune.training memory stats
  xxhash==4.1.0           # datasets
  requests==2.34.2        # datasets, kagglehub, tiktoken
  urllib3==2.8.0          # requests, torchdata
  charset-normalizer==3.5.3  # requests
  protobuf==7.36.2        # kagglesdk
)

mkdir -p "$DEST"
# A stale wheel of another version would make two versions of one package: start clean.
rm -f "$DEST"/*.whl

# pip matches each manylinux tag exactly, so name every one the chosen wheels use.
"$PY" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 \
  --platform manylinux2010_x86_64 --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 \
  -d "$DEST" "${CORE[@]}" "${EXTRA[@]}"

# One wheel per requested package, and the total under the limit.
"$PY" - "$DEST" "$MAX_MIB" "${CORE[@]}" "${EXTRA[@]}" <<'EOF'
import re, sys
from pathlib import Path

dest, max_mib, wanted = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
wheels = sorted(dest.glob("*.whl"))
names = [norm(w.name.split("-")[0]) for w in wheels]
missing = [r for r in wanted if norm(r.split("==")[0]) not in names]
doubled = sorted({n for n in names if names.count(n) > 1})
total = 0
for w in sorted(wheels, key=lambda w: -w.stat().st_size):
    size = w.stat().st_size
    total += size
    print(f"{size / 2**20:7.2f} MiB  {w.name}")
print(f"{total / 2**20:7.2f} MiB  total, {len(wheels)} wheels in {dest}")
if missing or doubled:
    sys.exit(f"missing wheels: {missing}; more than one version of: {doubled}")
if total > max_mib * 2**20:
    sys.exit(f"{total / 2**20:.1f} MiB is over {max_mib} MiB: the device tool carries 64 MiB "
             "with the working tree")
EOF
