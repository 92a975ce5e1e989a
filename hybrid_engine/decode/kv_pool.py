"""The paged K/V pool: fixed-size pages of every layer's keys and values, preallocated once, and its host ledger.

Why pages. A slot no longer holds a K/V row of the full cache capacity: memory
follows the tokens held (a row takes a page as it reaches it), a prompt's n
samples point at the same prompt pages, and attention reads only the pages a
row's span covers, not the capacity.

Graph-safety invariants:

* Storage is allocated once per pool and never moves. Layer ``i``'s keys and
  values are their own tensors (``keys[i]``, ``values[i]``), token-major
  ``[num_pages * page_size, heads, dim]``, so a captured step keeps reading the
  right addresses, and layers may differ in heads and K/V widths (MLA keys and
  values differ; a sliding-window or linear layer can get a pool of its own).
* Page :data:`NULL_PAGE` is never handed out. Writes nobody will read (padding
  columns, finished rows) go there, and unused block-table entries point at
  it, so every index a captured step computes is in range and every value
  attention reads is finite; attention masks by each row's length, never by
  what a table entry holds.
* Which page belongs to whom is host bookkeeping only (:class:`PageLedger`):
  the host assigns pages ahead of the steps that fill them and writes block
  tables before replays, so no step reads the device to find a page. Pages a
  finished row keeps past its call (:class:`HeldPages`, an episode's K/V
  between turns) are the ledger's too, evicted oldest first when a call runs
  short.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from hybrid_engine.accelerator.memory import device_memory
from hybrid_engine.decode import kv_storage

__all__ = ["DEFAULT_PAGE_SIZE", "MAX_PAGE_SIZE", "NULL_PAGE", "HeldPages", "KVBudget", "KVPool", "LayerSpec",
           "PageLedger", "device_memory", "pages_for", "pool_pages"]

#: Tokens per page unless configured (``kv_page_size``): vLLM's default; a shared prompt's partial last page,
#: copied once per sample, is then at most 15 tokens.
DEFAULT_PAGE_SIZE = 16
#: The largest page size accepted: a shared prompt's partial last page is copied once per sample, so pages much
#: larger than a prompt copy more than they share.
MAX_PAGE_SIZE = 4096
#: The page that absorbs writes nobody reads and that unused table entries name.
NULL_PAGE = 0


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` tokens."""
    return -(-tokens // page_size)


class LayerSpec(NamedTuple):
    """What one layer caches per token: ``heads`` K/V heads of ``key_dim``/``value_dim`` elements; ``ring``: a
    windowed layer keeps only its last ``ring`` tokens, per row, outside the pages
    (:class:`~hybrid_engine.decode.kv_cache.PagedKVCache`)."""

    heads: int
    key_dim: int
    value_dim: int
    ring: int | None = None

    @property
    def paged_elements(self) -> int:
        """Elements one token of this layer takes in the pages (none for a ring layer)."""
        return 0 if self.ring else self.heads * (self.key_dim + self.value_dim)


class KVPool:
    """``num_pages`` pages of ``page_size`` tokens for every layer in ``layers`` (see the module docstring)."""

    def __init__(self, layers: Sequence[LayerSpec], num_pages: int, page_size: int, *, device: torch.device,
                 dtype: torch.dtype) -> None:
        if num_pages < 2:
            raise ValueError(f"KVPool: need at least 2 pages (one is the null page), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"KVPool: page_size must be >= 1, got {page_size}")
        self.layers = tuple(LayerSpec(*spec) for spec in layers)
        self.num_pages = num_pages
        self.page_size = page_size
        slots = num_pages * page_size
        # A ring layer's tokens live in its cache's rings, not in pages: no page storage for it.
        shapes = [(slots if not s.ring else 0, s.heads, s.key_dim) for s in self.layers]
        shapes += [(slots if not s.ring else 0, s.heads, s.value_dim) for s in self.layers]
        # Releasable storage at fixed addresses where the device has it (sleep/wake keeps the graphs valid).
        self._storage = kv_storage.ReleasableTensors([(sh, dtype) for sh in shapes], device)
        n = len(self.layers)
        self.keys, self.values = self._storage.tensors[:n], self._storage.tensors[n:]
        # Offsets within a page, made once: a captured step must not build them from a host int.
        self.offsets = torch.arange(page_size, device=device)

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def page_bytes(self) -> int:
        """Bytes one page holds over all layers."""
        per_token = sum(s.paged_elements for s in self.layers) * self.keys[0].element_size()
        return per_token * self.page_size

    def memory_bytes(self) -> int:
        """Bytes of the pages held now: 0 while asleep (:meth:`sleep` released them)."""
        return 0 if self.asleep else self.page_bytes * self.num_pages

    def page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """The token slots of ``pages`` (any shape ``[...]``) as ``[..., page_size]``; capture-safe."""
        return pages[..., None] * self.page_size + self.offsets

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy pages ``src[i]`` into ``dst[i]`` in every layer (device page ids; capture-safe). The sources
        are gathered before anything is written, so ``dst[i] == src[i]`` is a no-op."""
        src_slots, dst_slots = self.page_slots(src).flatten(), self.page_slots(dst).flatten()
        for layer in (*self.keys, *self.values):
            if layer.shape[0]:  # ring layers have no page storage
                layer.index_copy_(0, dst_slots, layer.index_select(0, src_slots))

    # ------------------------------------------------------------ sleep/wake
    @property
    def releasable(self) -> bool:
        """Whether :meth:`sleep` can drop this pool's memory at fixed addresses."""
        return self._storage.releasable

    @property
    def asleep(self) -> bool:
        """Whether the pages' memory is released (nothing may read them until :meth:`wake`)."""
        return self._storage.released

    def sleep(self) -> None:
        """Drop the pages' physical memory, addresses kept (contents lost). The caller evicts held rows first
        and has synchronised the device."""
        if not self._storage.releasable:
            raise RuntimeError(f"KVPool.sleep: no releasable storage on {self.device}")
        self._storage.release()

    def wake(self) -> bool:
        """Take the memory back: the backend hands it back NaN-filled (as fresh device memory holds garbage),
        and every page is zeroed here. Not only the null page: attention reads the unwritten tail of a row's
        last page with zero weight, and ``0 * NaN`` is NaN, so every page must hold finite values (the
        invariant above). Returns whether the storage moved (a backend that reallocates: the caller must then
        treat its graphs as stale)."""
        moved = self._storage.restore()
        if moved:
            n = len(self.layers)
            self.keys, self.values = self._storage.tensors[:n], self._storage.tensors[n:]
        self.zero_pages()
        return moved

    def zero_pages(self) -> None:
        """Zero every page in every layer, :data:`NULL_PAGE` included."""
        for layer in (*self.keys, *self.values):
            layer.zero_()

    def copy_from(self, old: "KVPool") -> None:
        """Take every page of a smaller pool of the same layout at the same page ids (a pool that grows keeps
        the pages held in it)."""
        for new, kept in zip((*self.keys, *self.values), (*old.keys, *old.values)):
            new[: kept.shape[0]].copy_(kept)


class HeldPages:
    """A finished row's pages kept past its call, holding the K/V of its first ``tokens`` tokens, so that a later
    call continues the row on them (an episode's next turn) and prefills only what comes after.

    The ledger holds them until :meth:`release`, or until a call runs short of pages and evicts them (oldest
    first); then :attr:`pages` is ``None`` and the row is prefilled again. A continuing call takes them over
    (:meth:`PageLedger.take_held`)."""

    __slots__ = ("__weakref__", "ledger", "pages", "tokens")

    def __init__(self, ledger: "PageLedger", pages: list[int], tokens: int) -> None:
        self.ledger, self.pages, self.tokens = ledger, pages, tokens

    def live_in(self, ledger: "PageLedger | None") -> bool:
        """Whether the pages are still held, in ``ledger`` (a rebuilt pool has a new ledger)."""
        return ledger is self.ledger and ledger.holds(self)

    def release(self, *, wait: bool = True) -> None:
        """Give the pages back: at once, or, while a call uses the ledger, when the next call starts. Safe from
        any thread; from a finalizer, pass ``wait=False`` (:meth:`PageLedger.release_held`)."""
        self.ledger.release_held(self, wait=wait)


class PageLedger:
    """Host bookkeeping of a pool's pages: a free list and a reference count per page.

    A page is shared by reference (a prompt's full pages by every sample that
    reads them) and returns to the free list when its last holder releases it.
    ``peak`` is the most pages held at once since :meth:`reset_peak`, less those
    held ``tentative``ly: pages a call's plan reserved ahead of a host read and
    gives back on demand (:class:`~hybrid_engine.generation.pages.PagePlan`), so
    the peak is what the rows needed whether or not the host planned ahead.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))  # popped from the end: lowest page first
        self._refs = [0] * num_pages
        self.peak = 0
        self._held: dict[int, HeldPages] = {}  # id -> held pages, oldest first
        self._released: list[HeldPages] = []  # released while a call ran: given back by collect()
        # Released by a finalizer that found the lock taken (a collection run inside this ledger's own locked
        # section would deadlock on it): given back by collect().
        self._deferred: collections.deque[HeldPages] = collections.deque()
        self._lock = threading.Lock()
        self.busy = False  # a call is assigning pages (set by its plan)
        self.tentative = 0  # pages in use that the call's plan reserved ahead and may give back (not in ``peak``)

    def grow(self, num_pages: int) -> None:
        """Take ``num_pages`` pages in all (the pool grew; held pages keep their ids)."""
        self._free[:0] = range(num_pages - 1, self.num_pages - 1, -1)
        self._refs += [0] * (num_pages - self.num_pages)
        self.num_pages = num_pages

    # ------------------------------------------------------------ held pages
    def hold(self, pages: list[int], tokens: int) -> HeldPages:
        """Keep ``pages`` (their references pass from the caller) past the call, with ``tokens`` tokens' K/V."""
        held = HeldPages(self, pages, tokens)
        with self._lock:
            self._held[id(held)] = held
        return held

    def take_held(self, held: HeldPages) -> list[int] | None:
        """The caller takes over ``held``'s pages and their references (a call continues the row); ``None``
        when they are no longer held (released or evicted)."""
        with self._lock:
            if self._held.pop(id(held), None) is None:
                return None
            pages, held.pages = held.pages, None
        return pages

    def rehold(self, held: HeldPages) -> None:
        """Hold again pages taken over by :meth:`take_held` (the continuing call could not use them)."""
        with self._lock:
            self._held[id(held)] = held

    def holds(self, held: HeldPages) -> bool:
        with self._lock:
            return self._held.get(id(held)) is held

    def release_held(self, held: HeldPages, *, wait: bool = True) -> None:
        """Give ``held``'s pages back (see :meth:`HeldPages.release`). ``wait=False`` (a finalizer, which may run
        inside this ledger's locked sections, in any thread): never block; when the lock is taken, the release
        waits for the next :meth:`collect`."""
        if not self._lock.acquire(blocking=wait):
            self._deferred.append(held)
            return
        try:
            if self._held.pop(id(held), None) is None:
                return
            if self.busy:  # the call's plan owns the free list now: it gives them back at its next look
                self._released.append(held)
            else:
                self._give_back(held)
        finally:
            self._lock.release()

    def _give_back(self, held: HeldPages) -> None:
        pages, held.pages = held.pages, None
        self.release(pages)

    def start_call(self) -> None:
        """A call's plan starts assigning pages: releases from other threads wait for :meth:`collect`."""
        with self._lock:
            self.busy = True
        self.collect()

    def end_call(self) -> None:
        self.collect()
        with self._lock:
            self.busy = False

    def collect(self) -> None:
        """Give back the pages of held rows released while a call ran (by its plan)."""
        with self._lock:
            released, self._released = self._released, []
            while self._deferred:
                held = self._deferred.popleft()
                if self._held.pop(id(held), None) is not None:
                    released.append(held)
            for held in released:
                self._give_back(held)

    def held_list(self) -> list[HeldPages]:
        """The held rows now, oldest first."""
        with self._lock:
            return list(self._held.values())

    def reclaim(self) -> int:
        """Free every page no held row keeps; returns how many references were lost. Between calls only (no plan
        assigning pages), when every page in use belongs to a held row: what a call interrupted in its own
        bookkeeping (a ``KeyboardInterrupt`` between taking a row's pages and holding them) left referenced by
        nobody."""
        self.collect()
        with self._lock:
            if self.busy:
                raise RuntimeError("PageLedger.reclaim: a call is assigning pages; reclaim between calls only")
            kept = [0] * self.num_pages
            for held in self._held.values():
                for p in held.pages:
                    kept[p] += 1
            lost = 0
            for p in range(NULL_PAGE + 1, self.num_pages):
                if self._refs[p] > kept[p]:
                    lost += self._refs[p] - kept[p]
                    self._refs[p] = kept[p]
                    if kept[p] == 0:
                        self._free.append(p)
            return lost

    def evict(self, pages: int) -> bool:
        """Release held rows, oldest first, until ``pages`` pages are free (by the call's plan); whether they are."""
        self.collect()
        with self._lock:
            while len(self._free) < pages and self._held:
                oldest = self._held.pop(next(iter(self._held)))
                self._give_back(oldest)
            return len(self._free) >= pages

    @property
    def held_rows(self) -> int:
        return len(self._held)

    @property
    def held_pages(self) -> int:
        """Distinct pages held rows keep (shared prompt pages count once)."""
        with self._lock:
            return len({p for held in self._held.values() for p in held.pages})

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out (all but the null page)."""
        return self.num_pages - 1

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    @property
    def committed(self) -> int:
        """Pages in use less those held tentatively."""
        return self.in_use - self.tentative

    def allocate(self, n: int, *, tentative: bool = False) -> list[int] | None:
        """``n`` fresh pages held once each, or ``None`` (nothing taken) when fewer are free; ``tentative``: they
        count in :attr:`tentative` until :meth:`commit` (not in the peak)."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        if tentative:
            self.tentative += n
        self.peak = max(self.peak, self.in_use - self.tentative)
        return pages

    def commit(self, n: int) -> None:
        """``n`` tentative pages are now needed (or given back, after :meth:`release`): no longer tentative."""
        if n > self.tentative:
            raise RuntimeError(f"PageLedger: {n} tentative pages committed, {self.tentative} held")
        self.tentative -= n
        self.peak = max(self.peak, self.in_use - self.tentative)

    def retain(self, pages: Iterable[int]) -> None:
        """One more holder of each of ``pages``."""
        for p in pages:
            if self._refs[p] < 1:
                raise RuntimeError(f"PageLedger: page {p} is not held; only held pages can be shared")
            self._refs[p] += 1

    def release(self, pages: Iterable[int]) -> None:
        """One holder less of each of ``pages``; a page nobody holds is free again."""
        for p in pages:
            refs = self._refs[p] - 1
            if refs < 0:
                raise RuntimeError(f"PageLedger: page {p} released more often than held")
            self._refs[p] = refs
            if refs == 0:
                self._free.append(p)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def reset_peak(self) -> None:
        self.peak = self.in_use - self.tentative


class KVBudget(NamedTuple):
    """What sizes a call's pool: the page size, a configured budget (``tokens`` or ``nbytes``, set through the
    knobs ``<knob>_tokens``/``<knob>_bytes``) or none, and the call's longest prompt and ``max_new`` tokens."""

    page_size: int
    tokens: int | None
    nbytes: int | None
    knob: str
    longest_prompt: int
    max_new: int
    #: The device the pool goes on: a configured budget must fit its memory (``None``: not checked).
    device: torch.device | None = None


#: Host bytes the page ledger keeps per page (a free-list entry, its int and a reference count).
LEDGER_BYTES_PER_PAGE = 48


def _size(nbytes: int) -> str:
    return f"{nbytes} bytes ({nbytes / 2**30:.3g} GiB)"


def _check_memory(name: str, value: int, knob: str, pages: int, page_size: int, page_bytes: int,
                  device: torch.device) -> None:
    """Refuse, before anything is allocated, a configured pool (``name=value``) its device (or the host's ledger)
    cannot hold."""
    device = torch.device(device)
    pool, ledger = (pages + 1) * page_bytes, (pages + 1) * LEDGER_BYTES_PER_PAGE  # the null page comes on top
    bookkeeping = f"{_size(ledger)} of host bookkeeping"
    if device.type == "cpu":
        needs = [(device, pool + ledger, f"{_size(pool)} of pages and {bookkeeping}")]
    else:
        needs = [(device, pool, f"{_size(pool)} of pages"), (torch.device("cpu"), ledger, bookkeeping)]
    for where, need, what in needs:
        memory = device_memory(where)
        if memory is not None and need > memory:
            raise ValueError(
                f"{name}={value} asks for a pool of {pages} pages of {page_size} tokens ({page_bytes} bytes a page): "
                f"{what} on {where}, more than the {_size(memory)} it has in all; lower {name} to what the "
                f"machine holds, or leave {knob}_tokens and {knob}_bytes unset (the pool then holds what the call's "
                "rows need)")


def pool_pages(budget: KVBudget, *, page_bytes: int, slots: int, stage_rows: int, capacity: int,
               stage_width: int) -> tuple[int, bool]:
    """``(pages, fixed)``: the pages a call's pool holds besides the null page, and whether they were configured.

    Configured: that budget, fixed. Otherwise what the contiguous rows of ``capacity`` tokens (and a stage of
    ``stage_rows`` prompts ``stage_width`` wide) took for the same call, in whole pages: memory a call holds
    follows its tokens within it (``kv_pages_peak``), and the pool changes only when the rows' capacity does,
    so the graphs keep their addresses. A budget that cannot hold one request of the call (its staged prompt
    and its own row), one more than the budget's device has (or the host, for the ledger; checked before
    anything is allocated, so the rollout keeps its pool and graphs), and a byte budget for a model that keeps
    no K/V in pages are each a ``ValueError`` naming the knob and the sizes.
    """
    page_size, tokens, nbytes, knob, longest_prompt, max_new, device = budget
    row = pages_for(longest_prompt + max_new - 1, page_size)
    one = row + (pages_for(longest_prompt, page_size) if stage_rows else 0)
    if nbytes is not None and tokens is None and page_bytes == 0:
        raise ValueError(
            f"{knob}_bytes={nbytes}: the model keeps no K/V in pages in this call (its layers keep per-row states, "
            "or windowed rings where rows reach past twice the window), so a byte budget has nothing to size; "
            f"leave {knob}_bytes unset, or bound the pool's pages with {knob}_tokens")
    if tokens is not None:
        pages, name, value = tokens // page_size, f"{knob}_tokens", tokens
    elif nbytes is not None:
        pages, name, value = nbytes // page_bytes, f"{knob}_bytes", nbytes
    else:
        return slots * pages_for(capacity, page_size) + stage_rows * pages_for(stage_width, page_size), False
    if pages < one:
        per_page = f" ({page_bytes} bytes a page)" if page_bytes else ""
        in_bytes = f" (or {knob}_bytes to {one * page_bytes})" if page_bytes else ""
        raise ValueError(
            f"{name}={value} holds {pages} pages of {page_size} tokens{per_page}, but one request of "
            f"this call (a prompt of {longest_prompt} tokens and max_new_tokens {max_new}) needs up to {one} pages: "
            f"raise {knob}_tokens to at least {one * page_size}{in_bytes}")
    if device is not None:
        _check_memory(name, value, knob, pages, page_size, page_bytes, device)
    return pages, True
