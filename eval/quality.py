"""Answer quality of parallel vs standard vs batch prompting: see hf_parallel/evaluation/quality.py."""

from hf_parallel.evaluation.quality import main

main()
