"""Errors deft raises on bad input: each names the file (or source), the field and what was expected."""

from __future__ import annotations


class DeftError(Exception):
    """Base class of every error deft raises on purpose."""


class ContractError(DeftError, ValueError):
    """A profile, schedule or config that is damaged or does not match the contract.

    The message always reads ``<source>: <field>: <problem>`` so a user can find the bad value.
    """

    def __init__(self, source: str, field: str, problem: str) -> None:
        self.source = source
        self.field = field
        self.problem = problem
        super().__init__(f"{source}: {field}: {problem}")


class TraceError(DeftError, ValueError):
    """A trace file (Kineto JSON, Nsight Systems SQLite) that lacks what the profiler needs."""

    def __init__(self, source: str, problem: str) -> None:
        self.source = source
        self.problem = problem
        super().__init__(f"{source}: {problem}")


class CommunicationError(DeftError, RuntimeError):
    """A collective failed or timed out; names the rank, the link and the collective."""
