"""The router's instance lists and the index that finds their least-loaded member fast.

    workers/policy.py Router: remote, local, decode (each a `Pool`) -> `Least` per list

`Router.route` picks, within a list, the instance that is up with the least `(load, name)`:
outstanding prefill seconds for prefill, requests in flight for decode. A scan is O(instances)
a request; `Least` keeps a heap of `(load, name)` entries instead, so a pick costs O(log n)
amortised and is the same instance the scan picks (the names in a list are distinct, so the
least `(load, name)` is one instance, ties in load broken by name as the scan breaks them).

The heap is kept current without the callers' help: an instance tells the indexes that hold
it when its `outstanding_s`, `inflight` or `down` changes (`Watched.__setattr__`), and each
index pushes a fresh entry; entries of an older generation are dropped when they surface. A
`Pool` is a list that counts its changes (append, remove, slice assignment...), and the index
rebuilds itself when its pool changed, so the role planner's and the replay's edits of the
lists need nothing either.
"""

import heapq
import itertools

WATCHED = frozenset(("outstanding_s", "inflight", "down"))


class Watched:
    """A mixin for `workers.policy.Instance`: a change of a watched field is told to the
    indexes holding it (`_watchers`: {index: callback}) with a new generation."""

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        if name in WATCHED:
            d = self.__dict__
            d["_gen"] = d.get("_gen", 0) + 1
            for changed in d.get("_watchers", {}).values():
                changed(self)


def _changing(name):
    base = getattr(list, name)

    def method(self, *args, **kwargs):
        out = base(self, *args, **kwargs)
        self.version += 1
        return out
    method.__name__ = name
    return method


class Pool(list):
    """A list of instances that counts its changes in `version`."""

    def __init__(self, items=()):
        super().__init__(items)
        self.version = 0

    for _name in ("append", "extend", "insert", "remove", "pop", "clear", "sort", "reverse",
                  "__setitem__", "__delitem__", "__iadd__", "__imul__"):
        locals()[_name] = _changing(_name)
    del _name


class Least:
    """The up member of a `Pool` with the least `(key(instance), name)`, in O(log n)."""

    def __init__(self, key):
        self.key = key
        self._pool, self._seen = Pool(), -1     # the pool's version the heap was built for
        self._heap = []
        self._members = set()       # id() of the pool's instances
        self._seq = itertools.count()

    @property
    def pool(self):
        return self._pool

    @pool.setter
    def pool(self, items):
        self._pool, self._seen = Pool(items), -1

    def _entry(self, inst):
        return (self.key(inst), inst.name, next(self._seq), inst.__dict__.get("_gen", 0), inst)

    def _changed(self, inst):
        if id(inst) in self._members:
            heapq.heappush(self._heap, self._entry(inst))
            if len(self._heap) > 4 * len(self._members) + 64:
                self._rebuild()

    def _rebuild(self):
        self._members = {id(i) for i in self.pool}
        for i in self.pool:
            i.__dict__.setdefault("_watchers", {})[self] = self._changed
        self._heap = [self._entry(i) for i in self.pool if not i.down]
        heapq.heapify(self._heap)
        self._seen = self.pool.version

    def best(self):
        """The pool's up instance of least (key, name), or None when none is up."""
        if self._seen != self.pool.version:
            self._rebuild()
        heap = self._heap
        while heap:
            _, _, _, gen, inst = heap[0]
            if gen == inst.__dict__.get("_gen", 0) and not inst.down:
                return inst
            heapq.heappop(heap)     # stale, or down (coming up again pushes a new entry)
        return None
