"""One error type for bad input, so the CLI can print one line and exit 2.

Every check in the library that rejects user data raises :class:`InputError` with the place
(``row``, ``field``, ``index``; ``turn`` for a multi-turn trajectory's token) and what was expected
vs what was found. :class:`ContractMismatch` (an InputError) refuses a bitwise run whose trainer and engine would
compute other numbers, naming each differing field of the execution contract;
:class:`UnsupportedVersion` (another) a vLLM release outside the tested range. Three more, not
about input: :class:`NotEnoughMemory` (a step that would not
fit), :class:`PatchError` (a refused monkeypatch, ``patching.py``) and :class:`NotInvariant` (what
``kernels.batch_invariant_mode`` cannot make batch-invariant, named instead of run silently).
"""
from __future__ import annotations


class InputError(ValueError):
    """Bad input data. ``str(err)`` is one line naming where and what is wrong."""

    def __init__(self, message: str, *, row: int | None = None, field: str | None = None,
                 index: int | None = None, source: str | None = None, turn: int | None = None):
        message = " ".join(str(message).split()) if ("\n" in str(message) or "\r" in str(message)) else str(message)
        self.message = message
        self.row, self.field, self.index, self.source, self.turn = row, field, index, source, turn
        where = []
        if source is not None:
            where.append(str(source))
        if row is not None:
            where.append(f"row {row}")
        if turn is not None:
            where.append(f"turn {turn}")
        if field is not None:
            where.append(f"field '{field}'")
        if index is not None:
            where.append(f"index {index}")
        prefix = ", ".join(where)
        line = f"{prefix}: {message}" if prefix else message
        super().__init__(line.replace("\r", "\\r").replace("\n", "\\n"))

    def with_source(self, source: str) -> "InputError":
        """The same error, naming the file (or other source) it came from."""
        return InputError(self.message, row=self.row, field=self.field, index=self.index,
                          source=source, turn=self.turn)


class NotEnoughMemory(RuntimeError):
    """The free memory, measured when a step is about to start, does not hold what the step
    needs: ``what`` it is, the bytes it ``needs``, the bytes ``free``. The doctor lists the row
    as skipped with this line instead of letting the machine run out of memory."""

    def __init__(self, what: str, needs: int, free: int):
        self.what, self.needs, self.free = what, needs, free
        super().__init__(f"memory: {what} needs {needs / (1 << 30):.1f} GiB, "
                         f"{free / (1 << 30):.1f} GiB free now")


class PatchError(RuntimeError):
    """A patch of another library's object (``skyrl_numerics.patching``) was refused: the
    attribute is not there, someone else holds it, or it was replaced behind the registry's back.
    ``where`` names the owner and attribute (``"torch.cuda.current_device"``) when there is one."""

    def __init__(self, message: str, *, where: str | None = None):
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


class NotInvariant(RuntimeError):
    """``batch_invariant_mode`` met something it cannot make batch-invariant and refuses it rather
    than run it stock: ``op`` names it (an aten op as ``name.overload``, or ``"torch.compile"``) and
    the message says why and what to do. Strict mode raises it for an op the mode neither
    overrides nor lists as row-local (``kernels/mode_watch.py``)."""

    def __init__(self, op: str, why: str):
        self.op, self.why = op, why
        super().__init__(f"batch_invariant_mode: {op}: {why}")


class ContractMismatch(InputError):
    """Trainer and engine would not compute the same bits: their execution contracts
    (``invariant/contract.py``) differ. ``diff``: ``[(field, trainer's, engine's)]``; ``fields``:
    the differing field names; ``what``: where the check ran. One line naming every field (long
    values cut to 80 characters)."""

    def __init__(self, diff, *, what: str = ""):
        self.diff = [tuple(d) for d in diff]
        self.fields = [d[0] for d in self.diff]
        self.what = what

        def cut(v) -> str:
            s = repr(v)
            return s if len(s) <= 80 else s[:77] + "..."

        parts = "; ".join(f"{f} {cut(a)} vs {cut(b)}" for f, a, b in self.diff)
        super().__init__(f"execution contract{f' ({what})' if what else ''}: trainer vs engine "
                         f"differ in {parts}: a bitwise run needs both sides to compute the same "
                         "numbers", field=",".join(self.fields))


class UnsupportedVersion(InputError):
    """A library release outside the range this project is tested with (``engine/vllm_versions``
    for vLLM): one line naming the installed version and the supported range. An
    :class:`InputError`, so the CLI prints that line and exits 2."""

    def __init__(self, message: str, *, installed: str | None, supported: str):
        self.installed, self.supported = installed, supported
        super().__init__(message)
