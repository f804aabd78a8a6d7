"""Answer quality of parallel vs standard vs batch prompting: `hf-parallel eval`'s command line
(hf_parallel/cli/evaluate.py), with `merge` to join runs of different methods."""

from hf_parallel.cli.evaluate import main

main()
