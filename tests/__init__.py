"""hf_parallel's tests, shaped like the package.

tests/<sub-package>/ holds the tests of hf_parallel/<sub-package>/ (cli, evaluation, server, harness, frontends,
engine, runner, decoding, attention, row, models, kernels): each module in the folder of the sub-package it mainly
tests.  Two folders hold what no one sub-package owns: tests/library/ (the whole library: fp32 greedy answers equal to
`model.generate`'s, the package's and the tests' shape, the README and the notebook, a real model on real data) and
tests/eval/ (the scripts of eval/).  tests/helpers/ holds what several modules share; no module imports a test
module, and conftest.py's fixtures set and restore anything that holds for the whole process
(tests/library/test_test_layout.py checks all three).
"""
