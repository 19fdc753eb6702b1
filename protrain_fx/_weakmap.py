"""Weak references the runtime keeps: a map keyed by object identity (tensors compare elementwise,
so WeakKeyDictionary cannot hold them), one that raises once its object is gone, and methods set on
an object that do not keep it alive (a bound method kept in the object's own attributes is a
reference cycle: the object then outlives its last user reference until the garbage collector
runs)."""

from __future__ import annotations

import weakref

from protrain_fx.errors import ProtrainError


class IdentityWeakMap:
    def __init__(self):
        self._data: dict[int, tuple[weakref.ref, object]] = {}

    def __setitem__(self, key, value) -> None:
        k = id(key)
        self._data[k] = (weakref.ref(key, lambda _, k=k: self._data.pop(k, None)), value)

    def get(self, key, default=None):
        item = self._data.get(id(key))
        if item is None or item[0]() is not key:
            return default
        return item[1]

    def __getitem__(self, key):
        item = self._data.get(id(key))
        if item is None or item[0]() is not key:
            raise KeyError(key)
        return item[1]

    def __contains__(self, key) -> bool:
        item = self._data.get(id(key))
        return item is not None and item[0]() is key

    def pop(self, key, default=None):
        if key in self:
            return self._data.pop(id(key))[1]
        return default

    def __len__(self) -> int:
        return len(self._data)

    def items(self) -> list[tuple[object, object]]:
        """The live keys and their values."""
        return [(k, v) for ref, v in list(self._data.values()) if (k := ref()) is not None]


class WeakBound:
    """``func`` bound to ``obj`` without a reference to it, to set as ``obj.name``; has
    ``__func__`` as a bound method does (torch's LR schedulers wrap ``opt.step`` through it)."""

    def __init__(self, func, obj):
        self.__func__ = func
        self._ref = weakref.ref(obj)

    def __call__(self, *args, **kwargs):
        return self.__func__(self._ref(), *args, **kwargs)


def weakly(method, obj):
    """A callable giving ``method`` back, holding it weakly where it is bound to ``obj``."""
    if getattr(method, "__self__", None) is obj:
        return weakref.WeakMethod(method)
    return lambda: method


class WeakOrRaise:
    """A weak reference to ``obj`` whose call raises once ``obj`` is gone (``_ref()`` is the plain
    reference)."""

    def __init__(self, obj, what: str):
        self._ref, self._what = weakref.ref(obj), what

    def __call__(self):
        obj = self._ref()
        if obj is None:
            raise ProtrainError(f"protrain: the {self._what} was freed")
        return obj
