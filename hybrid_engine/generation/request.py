"""One object per request of a generation call: what it asks for and where it stands.

The scheduler used to keep a request's state in a container per fact (active
slots, steps left, admission order, lengths, ...), each keyed by slot or by
output row, and preemption made a new copy of the request. Here it is one
:class:`Request`, moved as one reference: its status, its slot while it runs,
its resume point after a preemption and its length once finished are fields
of the same object, so no two containers can disagree about it.

Pages are not a field: the pages a running request's slot holds are the
call's :class:`~hybrid_engine.generation.pages.PagePlan`'s (one owner for the
page ledger); ``held`` is what an earlier call kept of a row this request
continues (an episode's next turn).

Names: ``row`` is the request's row of the call's output batch; ``stream`` is
the sampler's counter stream (:func:`~hybrid_engine.decode.sampling.counter_uniform`),
which fixes what it samples wherever and whenever it runs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hybrid_engine.decode.kv_pool import HeldPages

__all__ = ["Request", "Status"]


class Status(enum.Enum):
    WAITING = "waiting"  # queued, never started
    RUNNING = "running"  # holds a slot
    PREEMPTED = "preempted"  # queued again, to resume from ``resume_from`` tokens
    FINISHED = "finished"  # harvested: ``length`` tokens in its result row


@dataclass(eq=False)  # identity: two requests are never the same request
class Request:
    row: int  # row of the output batch
    prompt_index: int
    budget: int
    stream: int  # the sampler's counter stream
    prompt_len: int  # real prompt tokens
    min_tokens: int = 0  # EOS is suppressed before this many tokens
    resume_from: int = 0  # tokens it had generated when it was preempted (0: not preempted)
    knob: int = 0  # the index of its sampling setting in the call's table (SamplingKnobs.set_table)
    seed: int | None = None  # its own sampler seed (None: the call's)
    held: HeldPages | None = None  # the pages an earlier call kept of its prompt's first tokens (it continues them)
    status: Status = Status.WAITING
    slot: int | None = None  # its decode slot while RUNNING
    left: int = 0  # while RUNNING: an upper bound on the decode steps before it must have finished
    length: int | None = None  # tokens generated, once FINISHED
    checked: int = 0  # a prefix of its response known to hold no stop string

    def seed_or(self, call_seed: int) -> int:
        return call_seed if self.seed is None else self.seed

    def tokens_bound(self) -> int:
        """While RUNNING: an upper bound on the tokens its row holds now (its prompt, and every token but the
        last one generated)."""
        return self.prompt_len + self.budget - self.left - 1

    @property
    def continues(self) -> bool:
        """It starts on pages an earlier call kept (an episode's next turn), not from a staged prompt."""
        return self.held is not None and not self.resume_from
