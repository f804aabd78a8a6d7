#!/usr/bin/env bash
# Device call: stock HF warmed up properly and once in full (validates the extrapolation), paired with PP.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
mkdir -p /root/keep && cp .carry-a/gguf.part1 /root/keep/ 2>/dev/null
python3 -c "import yaml, requests, tqdm, scipy; print('deps ok')"
python3 eval/bench.py --model codellama-7b --workloads grid,answers --tokenizer .carry/tokenizer \
    --book .carry/war-and-peace.txt.gz --out $OUT --tag=-rerun --deadline-s 200 \
    --methods "stock@8k x 64q|8k x 128q x 128a,stock_full@8k x 64q,pp_triton@8k x 64q|8k x 128q x 128a" \
    2>&1 | grep -v Warning | tee $OUT/bench-rerun.log | tail -8
