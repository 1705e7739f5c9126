#!/usr/bin/env bash
# One-GPU check of the training runtime: bf16 autocast, an nccl process group, a random-init Qwen3 target of
# realistic width (hidden 4096, 32 heads / 8 KV heads, MLP 12288, 4 layers, vocab 32768) and a 1-layer DFlash
# drafter (block 16, 512 anchors). Prints two JSON lines:
#   1. bench.pipeline: steps/s of the async pipeline vs the sequential loop vs each stage alone, drafter wait
#      fraction, tokens/s and peak GPU memory;
#   2. the real torchrun worker (nproc 1, nccl) on the same inputs: its summary (tokens_per_s, peak_mem_gb).
# About 3-5 minutes on one H100/H200 (most of it Python start-up and building the inputs).
# Usage: bash bench/gpu_check.sh            (PYTHON=python3, WORK=<tmp dir>, STEPS=12 may be overridden)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WORK="${WORK:-$(mktemp -d /tmp/dflash-gpu-check.XXXXXX)}"
STEPS="${STEPS:-12}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled PYTHONUNBUFFERED=1

"$PY" - <<'EOF'
import importlib.util, sys
need = ["torch", "transformers", "polars", "pyarrow", "pydantic", "fsspec", "safetensors", "yaml", "numpy"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing Python packages {missing}; install them (or carry their wheels) first")
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device")
print(f"# torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB", file=sys.stderr)
EOF

SHAPE=(--hidden 4096 --target-layers 4 --draft-layers 1 --vocab 32768 --num-anchors 512 --block-size 16
       --samples 768 --max-len 3072 --max-tokens 8192 --grad-accum 2)
"$PY" -m bench.pipeline --scenario custom --device cuda --dtype bfloat16 "${SHAPE[@]}" --steps "$STEPS" \
    --warmup 2 --repeats 1 --threads 4 --torch-threads 4 --workdir "$WORK" --worker-config "$WORK/worker.yaml"

"$PY" -m torch.distributed.run --standalone --nproc-per-node 1 --monitor-interval 0.1 \
    -m dflash_core.runtime.worker --tokenized "$WORK/custom/tokenized" --plan "$WORK/custom/plan" \
    --out "$WORK/run" --config "$WORK/worker.yaml" 2>&1 | tail -n 1
