"""An lm-evaluation-harness backend: the model `hf-parallel`, registered on import (needs `lm-eval`).

`HFParallelLM` is the harness's HF backend with every request answered by hf_parallel, shared token prefixes
computed once; `main` is `python -m hf_parallel.harness`, the harness's command line with it registered and the
offline tasks of `tasks/` included.
"""

from .cli import TASKS, main
from .model import HFParallelLM

__all__ = ["HFParallelLM", "main", "TASKS"]
