"""Answer-quality evaluation of parallel prompting against standard and batch prompting.

`quality` is the runner (its command line is `hf_parallel.cli.evaluate`); it puts together `config`
(the run's settings, one flag a field), `loaders` (SQuAD, DROP and QuAC, by name, and the error for a
file it cannot read), `prompts`, `methods` (the generate calls), `checkpoint`, `metrics` (the official
scorers), `batch_prompting` and `report`.
"""
