"""Progress bars for the long start-up phases (weight loading, CUDA graph capture).

Shown only where a person watches: stderr is a terminal, Pagoda logs at INFO or
lower, and this is the first (rank 0) worker, so logs written to files or pipes, and
tensor-parallel ranks after the first, stay free of bar redraws.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress_enabled(rank: int = 0) -> bool:
    return (
        rank == 0 and sys.stderr.isatty() and logging.getLogger("pagoda").isEnabledFor(logging.INFO)
    )


def progress(
    iterable: Iterable[T], desc: str, total: int | None = None, unit: str = "it", rank: int = 0
) -> Iterator[T]:
    """`iterable` itself, or wrapped in a tqdm bar on stderr when progress_enabled(rank)."""
    if not progress_enabled(rank):
        return iter(iterable)
    from tqdm.auto import tqdm  # progress bars only

    return iter(
        tqdm(
            iterable,
            desc=desc,
            total=total,
            unit=unit,
            file=sys.stderr,
            leave=False,
            dynamic_ncols=True,
        )
    )
