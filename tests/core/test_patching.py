"""The patch registry (``patching.py``): a patch of a class, inherited, instance, ``nn.Module`` or
module attribute is restored exactly (the held object set back, an attribute from elsewhere
deleted so lookup falls back), stacked patches come off in reverse order, refusals name the owner
and attribute, and the reference counts nest."""
from __future__ import annotations

import threading
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skyrl_numerics import patching
from skyrl_numerics.errors import PatchError

BY = "tests"


class Base:
    inherited = "base"

    def method(self):
        return "base method"


class Child(Base):
    own = "child"

    @staticmethod
    def static():
        return "static"


def _lazy(name):
    if name == "lazy":
        return "lazy lazy"
    raise AttributeError(name)


def _module():
    """A module (not imported: nothing in ``sys.modules``) with a global and a PEP 562 lazy name."""
    mod = types.ModuleType("skyrl_fake_mod")
    mod.value = 1
    mod.__getattr__ = _lazy
    return mod


def _state(owner, name):
    """What lookup sees and where: ``(held, raw stored object or None, value read)``."""
    own, raw = patching.held(owner, name)
    return own, raw, getattr(owner, name, "<missing>")


@pytest.fixture(autouse=True)
def _nothing_left():
    yield
    leftover = patching.live(BY)
    for p in reversed(leftover):
        patching.restore(p)
    assert not leftover, leftover


def _owners():
    """``(label, owner, attribute)`` of every kind of owner the registry handles."""
    inst = Child()
    inst.mine = "instance"
    lin = torch.nn.Linear(2, 2)
    lin.register_buffer("buf", torch.zeros(1))
    return [("class own", Child, "own"), ("class inherited", Child, "inherited"),
            ("class method inherited", Child, "method"), ("staticmethod", Child, "static"),
            ("instance own", inst, "mine"), ("instance from class", inst, "method"),
            ("module global", _module(), "value"), ("module __getattr__", _module(), "lazy"),
            ("nn.Module submodule", torch.nn.Sequential(torch.nn.ReLU()), "0"),
            ("nn.Module parameter", lin, "weight"), ("nn.Module buffer", lin, "buf"),
            ("nn.Module method", lin, "forward"), ("torch module", torch.cuda, "synchronize")]


def _value_for(owner, name):
    old = getattr(owner, name)
    if isinstance(old, torch.nn.Parameter):
        return torch.nn.Parameter(old.detach().clone())
    if isinstance(old, torch.Tensor):
        return old.clone()
    if isinstance(old, torch.nn.Module):
        return torch.nn.Identity()
    return lambda *a: "patched"


@pytest.mark.parametrize("label,owner,name", _owners(), ids=[o[0] for o in _owners()])
def test_patch_and_restore_put_back_exactly_what_was_there(label, owner, name):
    before = _state(owner, name)
    value = _value_for(owner, name)
    p = patching.patch(owner, name, value, by=BY)
    assert getattr(owner, name) is value and p.in_place()
    assert patching.live(BY) == [p]
    assert patching.restore(p)
    after = _state(owner, name)
    assert after[0] == before[0] and after[1] is before[1], label   # held or not, the same object
    if not before[0]:                                               # it came from elsewhere
        assert name not in vars(owner)
    assert not patching.restore(p)                                  # idempotent


def test_inherited_attribute_follows_its_base_after_restore():
    p = patching.patch(Child, "inherited", "patched", by=BY)
    assert Child.inherited == "patched" and Base.inherited == "base"
    patching.restore(p)
    Base.inherited = "changed meanwhile"
    try:
        assert Child.inherited == "changed meanwhile"               # deleted, not pinned
    finally:
        Base.inherited = "base"


def test_staticmethod_stays_a_staticmethod():
    raw = vars(Child)["static"]
    p = patching.patch(Child, "static", staticmethod(lambda: "patched"), by=BY)
    assert Child().static() == "patched"
    patching.restore(p)
    assert vars(Child)["static"] is raw and Child().static() == "static"


def test_instance_method_patch_is_dropped_not_pinned():
    inst = Child()
    p = patching.patch(inst, "method", lambda: "patched", by=BY)
    assert inst.method() == "patched"
    patching.restore(p)
    assert "method" not in vars(inst) and inst.method.__func__ is Child.method


def test_module_getattr_attribute_falls_back_after_restore():
    mod = _module()
    p = patching.patch(mod, "lazy", "patched", by=BY)
    assert mod.lazy == "patched"
    patching.restore(p)
    assert "lazy" not in vars(mod) and mod.lazy == "lazy lazy"


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(["own", "inherited", "method", "new"]), min_size=1, max_size=6),
       st.booleans())
def test_stacked_patches_of_one_attribute_come_off_in_reverse(names, on_instance):
    """Any sequence of patches (several of one attribute) restored in reverse order leaves every
    attribute as it was; restoring an earlier one while a later one is in place is refused."""
    owner = Child() if on_instance else Child
    before = {n: _state(owner, n) for n in set(names)}
    try:
        stack = [patching.patch(owner, n, object(), by=BY, create=True) for n in names]
        for i, p in enumerate(stack):
            if any(q.name == p.name for q in stack[i + 1:]):
                with pytest.raises(PatchError, match="out of order"):
                    patching.restore(p)
        for p in reversed(stack):
            assert patching.restore(p)
    finally:
        for p in reversed(patching.live(BY)):     # a failed example leaves nothing behind
            patching.restore(p)
    for n, (own, raw, value) in before.items():
        assert _state(owner, n) == (own, raw, value), n


def test_refusals_name_the_owner_and_attribute():
    with pytest.raises(PatchError, match=r"test_patching\.Child\.nope: no such attribute"):
        patching.patch(Child, "nope", 1, by=BY)
    mod = _module()
    with pytest.raises(PatchError, match=r"skyrl_fake_mod\.missing: no such attribute"):
        patching.patch(mod, "missing", 1, by=BY)
    p = patching.patch(Child, "own", "a", by=BY)
    with pytest.raises(PatchError, match=r"Child\.own: already patched by tests \(own\); other"):
        patching.patch(Child, "own", "b", by="other")
    Child.own = "foreign"                                    # behind the registry's back
    with pytest.raises(PatchError, match=r"Child\.own: replaced outside the patch registry"):
        patching.patch(Child, "own", "c", by=BY)
    with pytest.raises(PatchError, match=r"Child\.own: replaced outside .* left as it is"):
        patching.restore(p)
    assert Child.own == "foreign" and patching.live(BY) == []
    Child.own = "child"
    q = patching.patch(mod, "created", 1, by=BY, create=True)     # create: deleted on restore
    patching.restore(q)
    assert "created" not in vars(mod)


def test_an_instance_patch_does_not_keep_its_owner_alive():
    import gc
    import weakref

    inst = Child()
    value = (lambda i: (lambda: i))(inst)             # refers to the owner, as wrappers do
    patching.patch(inst, "method", value, by=BY)
    ref = weakref.ref(inst)
    del inst, value
    gc.collect()
    assert ref() is None and patching.live(BY) == []


def test_refcount_nests_and_strict_release_refuses():
    events = []
    rc = patching.Refcount("thing", lambda: events.append("on"), lambda: events.append("off"))
    with rc.held():
        with rc.held():
            assert rc.depth == 2
        assert events == ["on"] and rc.active()
    assert events == ["on", "off"] and not rc.active()
    assert rc.release() is False
    with pytest.raises(PatchError, match="thing released more times than it was enabled"):
        rc.release(strict=True)
    with pytest.raises(PatchError, match="thing released more times"):
        with rc.held():
            rc.release()                              # someone else let go under the block
    assert events == ["on", "off", "on", "off"]


def test_refcount_threads_turn_on_once_and_off_once():
    events = []
    rc = patching.Refcount("thing", lambda: events.append("on"), lambda: events.append("off"))
    gate = threading.Barrier(8)

    def hold():
        gate.wait()
        for _ in range(200):
            with rc.held():
                pass
    rc.acquire()                                      # held throughout: no on/off churn
    threads = [threading.Thread(target=hold) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rc.release()
    assert events == ["on", "off"]


def test_patch_set_installs_once_restores_all_and_rolls_back_a_failed_apply():
    mod = _module()
    fail = []

    def apply():
        ps.set(mod, "value", 2)
        ps.set(Child, "inherited", "patched")
        if fail:
            ps.set(Child, "nope", 1)                  # refused: undoes the two above
    ps = patching.PatchSet(BY, apply)
    with ps.held():
        ps.install()
        assert ps.depth == 2 and mod.value == 2
        where = [p.where for p in ps.patches()]
        assert where[0] == "skyrl_fake_mod.value" and where[1].endswith("test_patching.Child.inherited")
        ps.uninstall()
        assert ps.installed()
    assert not ps.installed() and mod.value == 1 and "inherited" not in vars(Child)
    assert ps.uninstall() is False
    fail.append(1)
    with pytest.raises(PatchError, match="Child.nope"):
        ps.install()
    assert not ps.installed() and mod.value == 1 and "inherited" not in vars(Child)
    with pytest.raises(PatchError, match="outside install"):
        ps.set(mod, "value", 3)


def test_patch_set_uninstall_reports_a_foreign_replacement_and_restores_the_rest():
    mod = _module()
    ps = patching.PatchSet(BY, lambda: (ps.set(mod, "value", 2), ps.set(Child, "own", "p")))
    ps.install()
    mod.value = "foreign"
    with pytest.raises(PatchError, match=r"skyrl_fake_mod\.value: replaced outside"):
        ps.uninstall()
    assert not ps.installed() and Child.own == "child" and mod.value == "foreign"
