"""What several test modules share, so that no test module imports another: the tiny models (`models`), tokenizers
built offline (`char_tokenizers`), the project's paths and eval/'s scripts (`project`), and helpers of one area each.
`model_zoo`, `model_outcome` (also used by eval/model_coverage.py) and `tensor_parallel_check` (a script that
tests/models/test_tensor_parallel.py runs under torchrun) live here too."""
