"""deft: DeFT communication scheduling for PyTorch data-parallel training.

The contract between the parts (profile, schedule, config) imports without torch; the runtime
(``deft.DistributedDataParallel``) is loaded on first use so the solver stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deft.config import DeftConfig, LinkConfig
from deft.errors import CommunicationError, ContractError, DeftError, TraceError
from deft.profile import Bucket, BucketTimes, Link, Profile
from deft.schedule import CommTask, Schedule, StagePlan, Update

if TYPE_CHECKING:  # pragma: no cover - the runtime (and torch) load on first use, see __getattr__
    from deft.runtime.ddp import DistributedDataParallel

__version__ = "0.1.0"

__all__ = [
    "Bucket", "BucketTimes", "CommTask", "CommunicationError", "ContractError", "DeftConfig", "DeftError",
    "DistributedDataParallel", "Link", "LinkConfig", "Profile", "Schedule", "StagePlan", "TraceError",
    "Update", "__version__",
]


def __getattr__(name: str) -> type[DistributedDataParallel]:
    if name == "DistributedDataParallel":
        from deft.runtime.ddp import DistributedDataParallel

        return DistributedDataParallel
    raise AttributeError(f"module 'deft' has no attribute {name!r}")
