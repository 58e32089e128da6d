"""The runtime: ``deft.DistributedDataParallel`` executing a DeFT schedule on real process groups.

One job per module (docs/DESIGN.md, section 5, "Modules", has the table); :mod:`deft.runtime.ddp` is the
facade. The runtime is the top library layer: it imports the contract, the solver, the profiler's trace
ranges and the preserver, and nothing below imports it (tests/test_architecture.py).
"""

from __future__ import annotations

from deft.runtime.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
