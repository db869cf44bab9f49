"""The project's one reversible patch registry: every monkeypatch of another library's object goes
through here, so each is recorded, refused when it could not be undone exactly, and undone exactly.

Its users: ``engine/vllm_patches.py`` (vLLM's classes and modules, and objects of a running
engine), ``trainer/megatron/compat.py`` (``torch.cuda`` and megatron-core on a machine without
CUDA) and ``kernels/mode.py`` (whose dispatcher overrides are not attributes: it uses the
reference count, :class:`Refcount`, alone).

The rules, the same for every kind of owner (a module, a class, an instance, an ``nn.Module``):

* A patch records whether the owner *holds* the attribute itself — in its ``__dict__`` (a
  module's globals, a class's own namespace, an instance's dict) or, for an ``nn.Module``, in its
  ``_modules`` / ``_parameters`` / ``_buffers`` — and the object held, as stored (a
  ``staticmethod`` stays a ``staticmethod``). Restoring sets that object back. An attribute the
  owner did not hold (inherited from a base class, provided by an instance's class or by a
  module's ``__getattr__``, or created with ``create=True``) is deleted on restore, so lookup
  falls back to where it came from, as it is then.
* Refused with :class:`~skyrl_numerics.errors.PatchError`, which names ``owner.attribute``:
  patching an attribute the owner does not have (unless ``create=True``); patching one that
  another user (a different ``by``) has a patch of in place; patching or restoring one whose
  value was replaced outside the registry since it was patched; restoring a patch while a later
  patch of the same attribute is still in place (restore that one first).
* Patches of one attribute by the same user stack, and come off in the reverse order.
* :class:`Refcount`: something turned on by its first holder and off by its last (nested and
  threaded use). :class:`PatchSet`: a list of patches installed that way, once per process.
* :func:`live` lists the patches in place, in the order applied.

The registry holds an owner and a patched value weakly where they take a weak reference, so a
patch kept for an object's life does not keep the object alive; the object an owner held before
the patch is kept (strongly) to put it back.
"""
from __future__ import annotations

import contextlib
import threading
import types
import weakref
from typing import Callable

from .errors import PatchError

__all__ = ["Patch", "PatchSet", "Refcount", "patch", "restore", "live", "held", "describe"]

_MODULE_STORES = ("_modules", "_parameters", "_buffers")   # where an nn.Module keeps attributes
_GONE = object()                                            # what a dead weak reference yields
_lock = threading.RLock()
_live: list[Patch] = []                                     # in the order applied


def describe(owner) -> str:
    """How errors and listings name ``owner``: a module's name, a class's dotted path, or
    ``<Type instance>``."""
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return f"<{type(owner).__qualname__} instance>"


def held(owner, name: str) -> tuple[bool, object]:
    """``(True, the stored object)`` when ``owner`` holds ``name`` itself (its ``__dict__``; an
    ``nn.Module``'s submodule, parameter and buffer stores), else ``(False, None)``."""
    try:
        d = vars(owner)
    except TypeError:      # no __dict__ (__slots__): an attribute it has is its own
        return (True, getattr(owner, name)) if hasattr(owner, name) else (False, None)
    if name in d:
        return True, d[name]
    if not isinstance(owner, type):
        for store in _MODULE_STORES:
            s = d.get(store)
            if isinstance(s, dict) and name in s:
                return True, s[name]
    return False, None


def _ref(obj) -> Callable[[], object]:
    """A weak reference to ``obj`` (yielding ``_GONE`` once it is collected) where ``obj`` takes
    one, else a strong one."""
    try:
        r = weakref.ref(obj)
    except TypeError:
        return lambda: obj

    def deref():
        o = r()
        return _GONE if o is None else o
    return deref


class Patch:
    """One patch in place (or restored): ``owner.<name>`` set by ``by`` (``what``: its label in
    listings). ``own``: the owner held the attribute itself; ``original``: the object it held
    (None when not ``own``: restoring deletes the attribute)."""

    __slots__ = ("by", "what", "name", "where", "own", "original", "_owner", "_stored")

    def __init__(self, owner, name: str, *, by: str, what: str, own: bool, original, stored):
        self.by, self.what, self.name, self.where = by, what, name, f"{describe(owner)}.{name}"
        self.own, self.original = own, original
        self._owner, self._stored = _ref(owner), _ref(stored)

    @property
    def owner(self):
        """The patched object, or None once it was collected."""
        o = self._owner()
        return None if o is _GONE else o

    def in_place(self) -> bool:
        """Whether the owner still holds exactly the object this patch stored."""
        o = self._owner()
        if o is _GONE:
            return False
        own, current = held(o, self.name)
        return own and current is self._stored()

    def __repr__(self) -> str:
        return f"<Patch {self.where} by {self.by} ({self.what})>"


def _prune() -> None:
    _live[:] = [p for p in _live if p.owner is not None]


def _top(owner, name: str) -> Patch | None:
    """The last patch in place of ``owner.<name>``."""
    _prune()
    return next((p for p in reversed(_live) if p.name == name and p.owner is owner), None)


def patch(owner, name: str, value, *, by: str, what: str | None = None,
          create: bool = False) -> Patch:
    """Set ``owner.<name> = value`` on behalf of ``by`` and record it; returns the :class:`Patch`
    for :func:`restore`. Refuses (``PatchError``) an attribute the owner lacks (unless
    ``create``), one another ``by`` has patched, one replaced outside the registry since its last
    patch, and an owner that does not store what is assigned (a descriptor)."""
    where = f"{describe(owner)}.{name}"
    with _lock:
        own, original = held(owner, name)
        if not own and not create and not hasattr(owner, name):
            raise PatchError(f"no such attribute to patch (asked by {by})", where=where)
        top = _top(owner, name)
        if top is not None and top.by != by:
            raise PatchError(f"already patched by {top.by} ({top.what}); {by} may not patch it "
                             "too", where=where)
        if top is not None and not top.in_place():
            raise PatchError(f"replaced outside the patch registry since {top.by} patched it",
                             where=where)
        setattr(owner, name, value)
        stored_own, stored = held(owner, name)
        if not stored_own:
            _put_back(owner, name, own, original)
            raise PatchError("the owner did not store the assigned value (a descriptor?); "
                             "not patched", where=where)
        p = Patch(owner, name, by=by, what=what or name, own=own,
                  original=original if own else None, stored=stored)
        _live.append(p)
        return p


def _put_back(owner, name: str, own: bool, original) -> None:
    if own:
        setattr(owner, name, original)
    elif held(owner, name)[0]:   # it came from elsewhere: drop ours, lookup falls back
        delattr(owner, name)


def restore(p: Patch) -> bool:
    """Undo ``p``: set back the object the owner held, or delete an attribute it did not hold.
    False when ``p`` is no longer in place (restored already, or its owner collected).
    Refuses while a later patch of the attribute is in place, and when the attribute was replaced
    outside the registry (then ``p`` is dropped from the registry, the foreign value left)."""
    with _lock:
        if p not in _live:
            return False
        owner = p.owner
        if owner is None:
            _live.remove(p)
            return False
        top = _top(owner, p.name)
        if top is not p:
            raise PatchError(f"restore out of order: {top.by} ({top.what}) patched it after "
                             f"{p.by} ({p.what}); restore that one first", where=p.where)
        _live.remove(p)
        if not p.in_place():
            raise PatchError(f"replaced outside the patch registry since {p.by} patched it; "
                             "left as it is", where=p.where)
        _put_back(owner, p.name, p.own, p.original)
        return True


def live(by: str | None = None) -> list[Patch]:
    """The patches in place (of ``by``, or all), in the order applied."""
    with _lock:
        _prune()
        return [p for p in _live if by is None or p.by == by]


class Refcount:
    """Something turned on by its first holder and off by its last, process-wide and thread-safe:
    :meth:`acquire` / :meth:`release`, or ``with held():``. When ``on`` raises, it stays off and
    the error propagates; ``off`` runs with the count already at zero."""

    def __init__(self, what: str, on: Callable[[], None], off: Callable[[], None]):
        self.what, self._on, self._off = what, on, off
        self._lock = threading.RLock()
        self.depth = 0

    def acquire(self) -> None:
        with self._lock:
            if self.depth == 0:
                self._on()
            self.depth += 1

    def release(self, *, strict: bool = False) -> bool:
        """Drop one hold; the last one runs ``off``. With no hold: False, or (``strict``) a
        ``PatchError``."""
        with self._lock:
            if self.depth == 0:
                if strict:
                    raise PatchError(f"{self.what} released more times than it was enabled")
                return False
            self.depth -= 1
            if self.depth == 0:
                self._off()
            return True

    def active(self) -> bool:
        return self.depth > 0

    @contextlib.contextmanager
    def held(self):
        """Held for the block (released under it by someone else: ``PatchError`` at the exit)."""
        self.acquire()
        try:
            yield
        finally:
            self.release(strict=True)


class PatchSet:
    """Patches installed together, once per process, reference-counted. The first
    :meth:`install` runs ``apply``, which calls :meth:`set` once per patch (if it raises, what it
    set is restored and the error propagates); the last :meth:`uninstall` restores every patch,
    in the reverse order, and raises one ``PatchError`` naming those it had to refuse."""

    def __init__(self, by: str, apply: Callable[[], None]):
        self.by, self._apply = by, apply
        self._patches: list[Patch] = []
        self._applying = False
        self._count = Refcount(by, self._on, self._off)

    def set(self, owner, name: str, value, *, create: bool = False) -> None:
        """One patch of the set; only while ``apply`` runs."""
        if not self._applying:
            raise PatchError(f"{self.by}: set() outside install()", where=f"{describe(owner)}.{name}")
        self._patches.append(patch(owner, name, value, by=self.by, create=create))

    def _on(self) -> None:
        self._applying = True
        try:
            self._apply()
        except BaseException as e:
            for message in self._restore_all():
                e.add_note(f"and while undoing: {message}")
            raise
        finally:
            self._applying = False

    def _off(self) -> None:
        refused = self._restore_all()
        if refused:
            raise PatchError(f"{self.by}: " + "; ".join(refused))

    def _restore_all(self) -> list[str]:
        refused = []
        while self._patches:
            try:
                restore(self._patches.pop())
            except PatchError as e:
                refused.append(str(e))
        return refused

    def install(self) -> None:
        self._count.acquire()

    def uninstall(self) -> bool:
        """Undo one :meth:`install` (False when none is in place)."""
        return self._count.release()

    def installed(self) -> bool:
        return self._count.active()

    @property
    def depth(self) -> int:
        return self._count.depth

    def patches(self) -> list[Patch]:
        """This set's patches in place, in the order applied."""
        return list(self._patches)

    def held(self):
        """``with patch_set.held(): ...``: installed for the block."""
        return self._count.held()
