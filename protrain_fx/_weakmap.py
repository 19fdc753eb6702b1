"""A weak map keyed by object identity (tensors compare elementwise, so WeakKeyDictionary cannot
hold them)."""

from __future__ import annotations

import weakref


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
