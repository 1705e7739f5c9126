#!/usr/bin/env bash
# Run HERE (not on the device) before `bench/gpu_check.sh` goes to a lent GPU machine: downloads into .whl/ the
# wheels of this project's requirements that the device's Python image lacks (it has torch, transformers,
# tokenizers, safetensors, pyarrow, numpy, scipy, matplotlib, fsspec, httpx and pyyaml; not pydantic or polars),
# for CPython 3.12 on x86-64 Linux, at the versions installed in .venv (the ones the tests ran with). The
# device call then carries .whl (about 55 MB; the tree that travels may hold 64 MiB) and gpu_check.sh installs
# them into its work folder. Prefect, W&B and datasets are not needed there: nothing the check runs imports
# them (tests/test_bench_efficiency.py rehearses the script with those imports blocked).
# Usage: bash bench/gpu_wheels.sh   (PYTHON=.venv/bin/python by default)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
# typing-extensions too: pydantic and polars want a newer one than the image may have (it is backward compatible)
PACKAGES=(pydantic pydantic-core annotated-types typing-inspection typing-extensions polars polars-runtime-32)
pins=$("$PY" - "${PACKAGES[@]}" <<'PYEOF'
import importlib.metadata as md, sys
for name in sys.argv[1:]:
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:  # e.g. polars before 1.34 had no separate runtime wheel
        pass
PYEOF
)
rm -rf .whl && mkdir .whl
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $pins
du -sh .whl
echo "now: run(command=\"OUT=\$OUT bash bench/gpu_check.sh\", carry=[\".whl\"], timeout_s=590)"
