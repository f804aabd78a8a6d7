"""Progress bars on stderr: whether to show them, and transformers' own (loading weights) on or off for a block."""

from __future__ import annotations

import contextlib
import sys


def shown(progress: bool | None) -> bool:
    """`progress`, or by default (None) whether stderr is a terminal."""
    return sys.stderr.isatty() if progress is None else bool(progress)


@contextlib.contextmanager
def transformers_bars(show: bool):
    """Within the block transformers' and huggingface_hub's progress bars are on or off as `show` says;
    after it, as they were."""
    import huggingface_hub.utils as hub  # optional start-up cost: only where a model loads
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled(), not hub.are_progress_bars_disabled()
    logging.enable_progress_bar() if show else logging.disable_progress_bar()  # the hub's too
    try:
        yield
    finally:
        logging.enable_progress_bar() if was[0] else logging.disable_progress_bar()
        hub.enable_progress_bars() if was[1] else hub.disable_progress_bars()
