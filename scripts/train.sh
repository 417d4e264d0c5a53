#!/usr/bin/env bash
# The main job: set-up (scripts/env.sh), the data (tokenizer + token file, built once into the cache), then
# DeepSeek-V3 `tiny` trained with 4 processes (torchrun, gloo): the experts of every MoE layer sharded over 4
# expert-parallel ranks (mtdeepep), everything else data parallel; then the held-out loss of the last checkpoint.
# Leaves $RUN_DIR/{metrics.jsonl, loss.png, run.json, checkpoints/} and prints the first and last steps.
# Safe to run again: it continues the run from its latest checkpoint (nothing to train once it is finished).
# Environment: RUN_DIR (default runs/tiny-ep4), NPROC (4), EP (4). Extra arguments go to train.py (e.g. --seed 1).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
CONFIG=examples/deepseek_v3/configs/tiny.toml
RUN_DIR="${RUN_DIR:-runs/tiny-ep4}"
NPROC="${NPROC:-4}"
EP="${EP:-4}"
SECONDS=0

python examples/deepseek_v3/train.py --config "$CONFIG" --out "$RUN_DIR" --prepare-data "$@"
RESUME=()
if [ -f "$RUN_DIR/checkpoints/latest" ]; then
    RESUME=(--resume)
fi
# One intra-op thread per rank: the ranks share the cores (torchrun's default, made explicit).
OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node "$NPROC" examples/deepseek_v3/train.py \
    --config "$CONFIG" --out "$RUN_DIR" --ep "$EP" "${RESUME[@]}" "$@"
LATEST="$RUN_DIR/checkpoints/$(cat "$RUN_DIR/checkpoints/latest")"
echo "held-out loss of $LATEST:"
python examples/deepseek_v3/evaluate.py --checkpoint "$LATEST" --tokens "$RUN_DIR/val_tokens.npy"
echo "scripts/train.sh: ${SECONDS} s (data, training, evaluation)"
