"""One progress bar for every long loop: live on a terminal, quiet in a log.

tqdm redraws about ten times a second; written to a file or a CI log (stderr not a terminal) that is
thousands of lines per stage. There the bar updates at most every `LOG_INTERVAL_S` seconds and once at
the end, so a log still shows progress and timing without drowning everything else.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm

LOG_INTERVAL_S = 30.0


def progress_bar(iterable: Iterable | None = None, *, enabled: bool = True, **kwargs: Any) -> tqdm:
    """`tqdm(iterable, **kwargs)`, disabled when not `enabled`, throttled when stderr is not a terminal."""
    stream = kwargs.get("file") or sys.stderr
    if not getattr(stream, "isatty", lambda: False)():
        kwargs.setdefault("mininterval", LOG_INTERVAL_S)
        kwargs.setdefault("maxinterval", LOG_INTERVAL_S * 4)
    return tqdm(iterable, disable=not enabled, **kwargs)
