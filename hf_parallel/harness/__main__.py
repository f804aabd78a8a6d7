"""`python -m hf_parallel.harness ...`: lm-eval's command line with the hf-parallel model (see `cli.main`)."""

import sys

from .cli import main

sys.exit(main())
