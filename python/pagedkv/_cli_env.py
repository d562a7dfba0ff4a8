"""The command-line tools' process settings, applied before anything imports numpy.

The tools do no linear algebra, so numpy's BLAS thread pool (started when numpy is imported,
one thread per core) only costs CPU: `simulate --mrc-only` on the shared trace paid about
0.03 to 0.05 CPU-seconds for it on 2 cores, more on bigger machines. One BLAS thread, unless
the caller set its own.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
