"""The runtime: ``deft.DistributedDataParallel`` executing a DeFT schedule on real process groups.

``ddp`` (the wrapper, optimizer interception, warm-up, planning, checkpoint), ``executor`` (launch and
wait rules of a cyclic schedule), ``buckets`` (flat gradient layout), ``links`` (one process group per
link); the warm-up timing lives in :mod:`deft.profiler.timing`.
"""

from __future__ import annotations

from deft.runtime.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
