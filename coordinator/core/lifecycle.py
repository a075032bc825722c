"""The replica life cycle: every legal move of one replica, as data.

Theory of operation
-------------------

A *replica* is one form of one block at one location, keyed ``(block_hash, form, location)``.
Each key lives through *incarnations*: it is created (by a write grant, or by an offload
copy), lives, and ends in a terminal state; the same key may later be created again (the
block is cached again in the same place) and starts a fresh incarnation.

::

    (absent) ──grant──▶ ALLOCATED ──commit──▶ READY ──evict──▶ EVICTED
        │                 │  │  │                │ └─invalidate─▶ INVALID ◀─invalidate─ EVICTED
        │                 │  │  └─invalidate──▶ INVALID          (never served)
        │                 │  └─abort──▶ EVICTED   └─lose──▶ LOST
        │                 └─lose──▶ LOST
        └──offload (copy of a READY or EVICTED replica to host/disk)──▶ READY

    EVICTED / INVALID / LOST are terminal for an incarnation: ``grant`` or ``offload``
    starts a new one. An EVICTED incarnation is still a source an offload may name (its
    bytes may be in flight to a lower tier); an operator's or a disown's invalidation of its
    content moves it to INVALID (``Invalidated.retired``), so a copy in flight is refused.

Everything that decides whether a move is legal *by state alone* lives in
:data:`TRANSITIONS`. Checks that need more than the state (the holder's epoch, generation
fencing, pins, a matching offload source) are the commands' business
(:mod:`coordinator.core.commands`); the fold (:mod:`coordinator.core.state`) uses
:func:`step` as a cheap assertion that the log never asks for an illegal move.

Who may cause each kind:

=============  =====================================================================
kind           caused by
=============  =====================================================================
``grant``      the coordinator, granting a write lease (``ReplicaAllocated``)
``commit``     the lease holder's epoch, with generation and checksum (worker event)
``abort``      the lease holder (worker event) or lease release/expiry (coordinator)
``evict``      a worker dropping an unpinned replica, or the coordinator's LRU/control
``invalidate`` a worker whose hit validation failed, or an operator (``Invalidated``)
``lose``       the coordinator when the holder's epoch is fenced or the worker is lost
``offload``    a worker copying a READY replica to ``host:<node>`` or ``disk``
=============  =====================================================================
"""

from __future__ import annotations

from typing import Final

from shared.messages import ReplicaState

ALLOCATED: Final = ReplicaState.ALLOCATED
READY: Final = ReplicaState.READY
EVICTED: Final = ReplicaState.EVICTED
INVALID: Final = ReplicaState.INVALID
LOST: Final = ReplicaState.LOST

#: The kinds of move, in the order of the diagram.
KINDS: Final = ("grant", "commit", "abort", "evict", "invalidate", "lose", "offload")

#: States in which a replica holds (or is about to hold) a pool slot and may be read.
LIVE: Final = frozenset({ALLOCATED, READY})
#: States that end an incarnation.
TERMINAL: Final = frozenset({EVICTED, INVALID, LOST})

_RECREATE: Final = {"grant": ALLOCATED, "offload": READY}

#: ``state → {kind → next state}``; ``None`` is "no such replica yet".
TRANSITIONS: Final[dict[ReplicaState | None, dict[str, ReplicaState]]] = {
    None: dict(_RECREATE),
    ALLOCATED: {"commit": READY, "abort": EVICTED, "invalidate": INVALID, "lose": LOST},
    READY: {"evict": EVICTED, "invalidate": INVALID, "lose": LOST},
    EVICTED: {**_RECREATE, "invalidate": INVALID},   # (the coordinator's: ``Invalidated.retired``)
    INVALID: dict(_RECREATE),
    LOST: dict(_RECREATE),
}

#: How a worker's ``(from_state, to_state)`` pair names a kind. ``from_state`` None means
#: "a new replica" (an offload copy); the pair (None, ALLOCATED) is the coordinator's alone.
KIND_OF_PAIR: Final[dict[tuple[ReplicaState | None, ReplicaState], str]] = {
    (None, ALLOCATED): "grant",
    (ALLOCATED, READY): "commit",
    (ALLOCATED, EVICTED): "abort",
    (ALLOCATED, INVALID): "invalidate",
    (READY, EVICTED): "evict",
    (READY, INVALID): "invalidate",
    (ALLOCATED, LOST): "lose",
    (READY, LOST): "lose",
    (None, READY): "offload",
}

#: Kinds a worker may publish on the transitions stream (``grant``/``lose`` are decisions
#: only the coordinator takes).
WORKER_KINDS: Final = frozenset({"commit", "abort", "evict", "invalidate", "offload"})


class IllegalTransition(ValueError):
    """A move the life cycle does not allow from the replica's current state.

    Raised before anything is changed: the caller's state is untouched.
    """

    def __init__(self, state: ReplicaState | None, kind: str, key: object = None) -> None:
        self.state = state
        self.kind = kind
        self.key = key
        allowed = sorted(TRANSITIONS.get(state, {}))
        where = f"replica {key}: " if key is not None else ""
        name = state.value if state is not None else "absent"
        super().__init__(f"{where}cannot {kind} a replica that is {name}; allowed from {name}: {allowed}")


def step(state: ReplicaState | None, kind: str, key: object = None) -> ReplicaState:
    """The state after ``kind`` from ``state``, or :class:`IllegalTransition`."""
    try:
        return TRANSITIONS[state][kind]
    except KeyError:
        raise IllegalTransition(state, kind, key) from None


def kind_of(from_state: ReplicaState | None, to_state: ReplicaState) -> str | None:
    """The kind a worker's ``(from_state, to_state)`` pair names, or None if it names none."""
    return KIND_OF_PAIR.get((from_state, to_state))
