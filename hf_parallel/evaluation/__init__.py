"""Answer-quality evaluation of parallel prompting against standard and batch prompting.

`quality` is the runner and its command line; it puts together `config` (the run's
settings and flags), `loaders` (SQuAD, DROP and QuAC, by name, and the error for a file
it cannot read), `prompts`, `methods` (the generate calls), `checkpoint`, `metrics` (the
official scorers), `batch_prompting` and `report`.
"""
