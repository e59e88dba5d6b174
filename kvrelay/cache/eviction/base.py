"""The one interface of every place kvrelay evicts pages (DESIGN.md section 5).

A policy orders the pages its owner holds and names the next victim; it
never frees anything itself. The owner tells it what happens to each page:

- `admit(key, parent, evictable)`: the page is resident, held (not evictable)
  until `make_evictable`, or evictable at once with `evictable` (a sealed,
  unpinned page: one call instead of two); `parent` is the key of the page
  before it in its chain that the owner holds, when known, so a
  prefix-aware policy can keep a page while a later page of its chain stays;
- `make_evictable(key)` / `hold(key)`: the page may (sealed and unpinned) or
  may not (pinned by a lease, being written) be a victim;
- `touch(key)` / `touch_many(keys)`: the page(s) were read (hits); the
  index calls `touch_many` once per lookup, with no keys when nothing hit,
  so a policy can count lookups as time;
- `forget(key)`: the page left for another reason (removed, flushed, dropped);
- `victim()`: pick an evictable page, forget it and return its key;
- `victim_inner()`: when `victim()` found none, an evictable page that a
  prefix-aware policy keeps because a held page of its chain depends on it
  (an owner with a lower tier to demote it into loses nothing by taking it).

A held page is never in the evictable set, so pins and leases can never make
a page a victim. Every call is O(1) amortised.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable, Iterator, Sequence
from typing import ClassVar


class EvictionPolicy(abc.ABC):
    name: ClassVar[str]

    @abc.abstractmethod
    def admit(self, key: Hashable, parent: Hashable | None = None, evictable: bool = False) -> None:
        """A page became resident; `parent` as in the module doc. Held until
        `make_evictable`, or `evictable` at once (the same as calling it next)."""

    @abc.abstractmethod
    def make_evictable(self, key: Hashable) -> None:
        """The resident page may now be a victim (a release counts as a use)."""

    @abc.abstractmethod
    def hold(self, key: Hashable) -> None:
        """The resident page must not be a victim until `make_evictable`."""

    @abc.abstractmethod
    def touch(self, key: Hashable) -> None:
        """The resident page was read."""

    def touch_many(self, keys: Sequence[Hashable]) -> None:
        """`touch` each key, in order (a lookup's hits, maybe none: one call per lookup)."""
        for key in keys:
            self.touch(key)

    @abc.abstractmethod
    def forget(self, key: Hashable) -> None:
        """The page is no longer resident (a no-op for a key never admitted)."""

    @abc.abstractmethod
    def victim(self) -> Hashable | None:
        """Forget and return the page to evict next; None if none is evictable."""

    def victim_inner(self) -> Hashable | None:
        """Forget and return an evictable page `victim` keeps for a held later
        page of its chain; None if there is none (the default: `victim` keeps none)."""
        return None

    @abc.abstractmethod
    def evictable(self) -> Iterator[Hashable]:
        """The evictable pages (a snapshot, in no promised order), for filtered scans."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Resident pages, evictable or held."""

    def __contains__(self, key: Hashable) -> bool:
        raise NotImplementedError
