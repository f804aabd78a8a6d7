#!/usr/bin/env bash
# One device call: GPU tests, then benchmark parts.  Usage: bash eval/gpu_run.sh PART  (A or B)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv | tee $OUT/gpu.txt
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" | tee -a $OUT/gpu.txt
TOK=".carry/tokenizer --book .carry/war-and-peace.txt.gz"
case "$1" in
A)
  [ -n "${SKIP_TESTS:-}" ] || timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_generation.py tests/test_triton_kernel.py \
      2>&1 | tail -25 > $OUT/pytest.log; tail -3 $OUT/pytest.log
  python3 eval/bench.py --model codellama-7b --workloads grid,docs --tokenizer $TOK --out $OUT --tag=-grid \
      --methods "stock,pp_triton,pp_reference@8k x 64q|16k x 64q|8k x 256q,pp_p1@8k x 64q|16k x 64q|1 docs x 4k x 64q" \
      --deadline-s 330 2>&1 | grep -v Warning | tee $OUT/bench-a.log | tail -30
  ;;
B)
  python3 eval/bench.py --model codellama-7b --workloads docs,answers --tokenizer $TOK --out $OUT --tag=-answers \
      --methods "stock@8k x 128q x 128a|8k x 128q x 256a|8k x 128q x 512a|8k x 128q x 1024a|16 docs x 4k x 64q,pp_triton@8k x 128q x 128a|8k x 128q x 256a|8k x 128q x 512a|8k x 128q x 1024a|16 docs x 4k x 64q,pp_interleaved@8k x 128q x 128a|8k x 128q x 1024a,pp_p1@8k x 128q x 128a" \
      --deadline-s 230 2>&1 | grep -v Warning | tee $OUT/bench-b1.log | tail -12
  python3 eval/bench.py --model qwen2.5-7b --workloads grid --tokenizer $TOK --out $OUT --tag=-grid \
      --methods "stock,pp_triton,pp_reference@8k x 64q,pp_p1@8k x 64q|16k x 64q" --deadline-s 150 2>&1 | grep -v Warning | tee $OUT/bench-b2.log | tail -12
  ;;
esac
