"""The loop's execution-contract check (``loop.py``; the contract: ``invariant/contract.py``).

Per configuration the trainer's contract is taken once, when its trainer starts; the engine's is
asked of the engine's worker (in process: ``collective_rpc``; a server: ``GET /skyrl_contract``)
before the engine takes the configuration's weights, and again at every weight sync, before the
engine takes the new version. A ``bitwise`` configuration refuses any difference with
:class:`~skyrl_numerics.errors.ContractMismatch` naming the fields, before the first rollout or
before the engine applies the version; the others
record the difference and go on. ``train.json`` → ``contracts`` → configuration name:
:meth:`ContractWatch.record`.
"""
from __future__ import annotations

from skyrl_numerics.errors import ContractMismatch, InputError
from skyrl_numerics.invariant.contract import ExecutionContract


class ContractWatch:
    """One configuration's contracts: ``trainer`` (a :meth:`ExecutionContract.to_dict`),
    ``refuse`` (a bitwise configuration), ``name`` (for the message)."""

    def __init__(self, name: str, trainer: dict, *, refuse: bool):
        self.name, self.refuse = name, refuse
        self.trainer = ExecutionContract.from_dict(trainer, source="trainer")
        self.engine: ExecutionContract | None = None
        self.diff: list = []
        self.checks = 0
        self.engine_changed_at: list[str] = []
        self.differed_at: dict[str, list[str]] = {}
        self.unavailable_at: dict[str, str] = {}

    def compare(self, engine: dict, when: str) -> None:
        """Compare the engine's contract now (``when``: ``"before the first step"``,
        ``"at sync 3"``); a bitwise configuration raises on a difference."""
        eng = ExecutionContract.from_dict(engine, source="engine")
        if self.engine is not None and eng != self.engine:
            self.engine_changed_at.append(when)
        self.engine, self.checks = eng, self.checks + 1
        self.diff = self.trainer.diff(eng)
        if self.diff:
            self.differed_at[when] = [d[0] for d in self.diff]
        if self.diff and self.refuse:
            raise ContractMismatch(self.diff, what=f"config {self.name!r}, {when}")

    def unavailable(self, why: str, when: str) -> None:
        """The engine could not report its contract (e.g. a server without our route): recorded
        (``unavailable``) for a configuration that does not refuse; a bitwise one cannot run
        unchecked and is refused naming ``contract``."""
        if self.refuse:
            raise InputError(f"config {self.name!r}, {when}: the engine reported no execution "
                             f"contract ({why}); a bitwise run needs it", field="contract")
        self.unavailable_at[when] = why

    def record(self) -> dict:
        """What ``train.json`` keeps: both contracts as last compared (fields + fingerprint),
        whether they were equal, their differing fields (``diff``), how many checks ran, whether
        a difference refuses, the checks at which the engine's contract changed and the fields
        that differed at each check that found a difference (``differed_at``)."""
        return {"trainer": self.trainer.to_dict(),
                "engine": self.engine.to_dict() if self.engine is not None else None,
                "equal": self.engine is not None and not self.diff,
                "diff": [{"field": f, "trainer": a, "engine": b} for f, a, b in self.diff],
                "checks": self.checks, "refuses": self.refuse,
                "engine_changed_at": self.engine_changed_at, "differed_at": self.differed_at,
                **({"unavailable_at": self.unavailable_at} if self.unavailable_at else {})}
