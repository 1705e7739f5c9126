#!/usr/bin/env bash
# One-GPU check of training efficiency, as ONE command (no network, no installs beyond the torch wheel's own
# packages and this project's requirements). Prints JSON lines, each prefixed by its part's name:
#   tests       the GPU tests of the attention paths (compiled FlexAttention == SDPA, fp32 and bf16), when
#               pytest is installed;
#   efficiency  bench.efficiency on the Qwen3-8B recipe shape: SDPA vs FlexAttention drafter step time,
#               tokens/s, MFU, peak memory, largest micro-batch (3072-token sequences) that fits;
#   pipeline    bench.pipeline: the in-process asynchronous pipeline (random-init Qwen3 target of hidden 4096,
#               4 layers, vocab 32768, 1-layer drafter, block 16, 512 anchors, 3072 max length, 8192-token
#               micro-batches, grad accum 2), STEPS steps, the first 2 untimed;
#   worker      the real torchrun worker (nproc 1, nccl) on the same inputs and steps: its summary, with the
#               steady-state figures (warm-up, final checkpoint and export excluded) next to the end-to-end ones;
#   compare     worker vs in-process pipeline tokens/s, steady and end to end (goal: steady >= 0.9).
# About 6-8 minutes on one H100 or H200. Every part has a timeout, 90 + 240 + 120 + 110 s = 560 s in all, inside a
# 600 s limit per command (EFF_BUDGET_S, 120 s, is the time of efficiency's two memory searches, 60 s each from
# its own start, inside its 240: the rest is the target build, the timed steps and flex's compile). Each line is
# also appended to $OUT/gpu_check.jsonl as soon as its part ends (the device tool's $OUT comes back even when
# the command runs past its limit), or to $WORK/gpu_check.jsonl without $OUT; efficiency's line of each
# attention path as soon as that path is measured. A part that crashes or times out is one line,
# `<part> {"failed": ..., "error": <its last stderr line>, "log": ...}`, and the next part runs; each part's
# stderr is also kept in $OUT/<part>.log (or $WORK's); the script exits 1 at the end if a part failed.
# Usage: bash bench/gpu_check.sh   (on a machine whose image lacks pydantic/polars: `bash bench/gpu_wheels.sh`
#   first where pip works, and carry .whl; the device tool: run(command="OUT=$OUT bash bench/gpu_check.sh",
#   carry=[".whl"], timeout_s=590))
#   overrides: PYTHON=python3 WORK=<tmp dir> STEPS=24 EFF_BUDGET_S=120 PARTS="tests efficiency pipeline worker"
#   DEVICE=cpu runs the same script on tiny shapes on CPU (a test of the script; the figures mean nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WORK="${WORK:-$(mktemp -d /tmp/dflash-gpu-check.XXXXXX)}"
DEVICE="${DEVICE:-cuda}"
PARTS="${PARTS:-tests efficiency pipeline worker}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled PYTHONUNBUFFERED=1
mkdir -p "$WORK"
RESULTS="${OUT:-$WORK}/gpu_check.jsonl"
LOGS="${OUT:-$WORK}"
FAILED=""
# The wheels bench/gpu_wheels.sh downloaded here and the device call carried (`carry: [".whl"]`): the
# requirements the device's image lacks, installed into the work folder (nothing outside it is touched).
if compgen -G ".whl/*.whl" > /dev/null && ! "$PY" -c "import pydantic, polars" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
        .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:$WORK/site"
fi
has() { [[ " $PARTS " == *" $1 "* ]]; }
emit() { echo "$1 $2" | tee -a "$RESULTS"; }  # one part's result line: stdout, and kept in $RESULTS at once

# part NAME SECONDS COMMAND...: the command under a timeout (0: none), its stderr shown and kept in $LOGS/NAME.log,
# each JSON line of its stdout emitted as it comes and the last kept in $WORK/NAME.json. A crash or a timeout is
# emitted as NAME's failure line (status 1); the script goes on.
part() {
    local name=$1 seconds=$2 rc=0 why error
    shift 2
    { timeout "$seconds" "$@" 2>&1 >&3 3>&- | tee "$LOGS/$name.log" >&2; } 3>&1 | keep_json "$name" || rc=$?
    (( rc == 0 )) && return 0
    why="exit $rc"
    (( rc == 124 )) && why="timed out after $seconds s"
    error=$(tail -n 1 "$LOGS/$name.log" | tr -d '\000-\037')
    error=${error//\\/\\\\}
    FAILED+=" $name"
    emit "$name" "{\"failed\": \"$why\", \"error\": \"${error//\"/\\\"}\", \"log\": \"$LOGS/$name.log\"}"
    return 1
}
keep_json() {
    local line
    : > "$WORK/$1.json"
    while IFS= read -r line; do
        if [[ "$line" == "{"* ]]; then emit "$1" "$line"; echo "$line" > "$WORK/$1.json"; else echo "$line" >&2; fi
    done
}

"$PY" - "$DEVICE" <<'EOF'
import importlib.util, sys
need = ["torch", "transformers", "polars", "pyarrow", "pydantic", "fsspec", "safetensors", "yaml", "numpy"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing Python packages {missing}: run `bash bench/gpu_wheels.sh` on the machine "
             "that sends this script and carry .whl with it (or install them)")
import torch
if sys.argv[1] == "cuda":
    if not torch.cuda.is_available():
        sys.exit("gpu_check: torch sees no CUDA device (DEVICE=cpu runs the tiny CPU mode)")
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
          f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB", file=sys.stderr)
EOF

if [[ "$DEVICE" == cuda ]]; then
    STEPS="${STEPS:-24}"
    EFF=(--device cuda --budget-s "${EFF_BUDGET_S:-120}")
    PIPE=(--device cuda --dtype bfloat16 --hidden 4096 --target-layers 4 --draft-layers 1 --vocab 32768
          --num-anchors 512 --block-size 16 --samples 768 --max-len 3072 --max-tokens 8192 --grad-accum 2
          --threads 4 --torch-threads 4)
else
    STEPS="${STEPS:-8}"
    EFF=(--device cpu --tiny --steps 1 --warmup 1 --max-seqs 2 --budget-s "${EFF_BUDGET_S:-120}")
    PIPE=(--device cpu --dtype float32 --hidden 128 --target-layers 2 --draft-layers 1 --vocab 1024
          --num-anchors 16 --block-size 8 --samples 96 --max-len 128 --max-tokens 512 --grad-accum 2
          --threads 2 --torch-threads 1)
fi

if has tests; then
    if "$PY" -c "import pytest" 2>/dev/null && [[ "$DEVICE" == cuda ]]; then
        result=$(timeout 90 "$PY" -m pytest tests/test_model_attention.py -m gpu -q -p no:cacheprovider 2>&1 \
                 | tee "$LOGS/tests.log" | tail -n 1) || true
        emit tests "{\"gpu_attention_tests\": \"$result\"}"
    else
        emit tests '{"gpu_attention_tests": "skipped (no pytest or no CUDA)"}'
    fi
fi

if has efficiency; then
    part efficiency 240 "$PY" -m bench.efficiency "${EFF[@]}" || true
fi

# bench.pipeline writes the worker's config and inputs before it measures: when it fails later, the worker still runs
pipeline_ok=true
if has pipeline || has worker; then
    part pipeline 120 "$PY" -m bench.pipeline --scenario custom "${PIPE[@]}" --steps "$STEPS" --warmup 2 \
        --repeats 1 --workdir "$WORK" --worker-config "$WORK/worker.yaml" || pipeline_ok=false
fi

if has worker; then
    rm -rf "$WORK/run"
    worker_ok=true
    part worker 110 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 --monitor-interval 0.1 \
        -m dflash_core.runtime.worker --tokenized "$WORK/custom/tokenized" --plan "$WORK/custom/plan" \
        --out "$WORK/run" --config "$WORK/worker.yaml" || worker_ok=false
    if $pipeline_ok && $worker_ok; then
        part compare 0 "$PY" - "$WORK/pipeline.json" "$WORK/worker.json" <<'EOF' || true
import json, sys
pipeline = json.load(open(sys.argv[1]))["results"][-1]
worker = json.load(open(sys.argv[2]))
base = pipeline["pipeline_tokens_per_s"]
print(json.dumps({
    "pipeline_tokens_per_s": base,
    "worker_steady_tokens_per_s": worker["steady_tokens_per_s"],
    "worker_end_to_end_tokens_per_s": worker["tokens_per_s"],
    "worker_steady_vs_pipeline": round(worker["steady_tokens_per_s"] / base, 3),
    "worker_end_to_end_vs_pipeline": round(worker["tokens_per_s"] / base, 3),
    "worker_outside_steps_s": {k: worker[k] for k in ("checkpoint_s", "export_s")},
    "worker_steady_mfu": worker.get("steady_mfu"),
    "worker_steps": {k: worker[k] for k in ("steps", "steady_steps", "steady_compile_steps_skipped")},
    "goal": "worker_steady_vs_pipeline >= 0.9",
}))
EOF
    else
        emit compare '{"skipped": "the pipeline or the worker part failed"}'
    fi
fi

if [[ -n "$FAILED" ]]; then
    echo "gpu_check: failed parts:$FAILED (their lines in $RESULTS, their logs in $LOGS)" >&2
    exit 1
fi
