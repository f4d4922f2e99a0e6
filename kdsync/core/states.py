"""derecho's member states and the one table of the changes between them
(DerechoNode._enter checks every change against TRANSITIONS; one it does
not list is a core bug).  `_STATUS` is what each state reports to the
adapter (`OrderingNode.status`)."""

from __future__ import annotations

import enum

__all__ = ["TRANSITIONS", "State", "wedged"]


class State(enum.Enum):
    FORMING = "forming"
    REJOINING = "rejoining"
    JOINING = "joining"
    CATCHING_UP = "catching-up"
    CATCHING_UP_WEDGED = "catching-up-wedged"
    ACTIVE = "active"
    WEDGED = "wedged"


_STATUS = {
    State.FORMING: "forming",
    State.REJOINING: "forming",
    State.JOINING: "joining",
    State.CATCHING_UP: "catching-up",
    State.CATCHING_UP_WEDGED: "catching-up",
    State.ACTIVE: "active",
    State.WEDGED: "wedged",
}
_CATCHING_UP = frozenset({State.CATCHING_UP, State.CATCHING_UP_WEDGED})

# The state machine: every change goes through `_enter`, and one this table
# does not list is a core bug (LocalProtocolError).  A new view (an INSTALL,
# a HINT) can take a member from any state to active, joining, rejoining or
# catching up; wedging and the end of a catch-up are the other edges.
_NEW_VIEW = frozenset({State.ACTIVE, State.JOINING, State.REJOINING, State.CATCHING_UP})
TRANSITIONS: dict[State, frozenset[State]] = {
    State.FORMING: _NEW_VIEW,
    State.REJOINING: _NEW_VIEW,
    State.JOINING: _NEW_VIEW,
    State.ACTIVE: _NEW_VIEW | {State.WEDGED},
    State.WEDGED: _NEW_VIEW,
    State.CATCHING_UP: _NEW_VIEW | {State.CATCHING_UP_WEDGED, State.WEDGED},
    State.CATCHING_UP_WEDGED: _NEW_VIEW | {State.WEDGED},
}


def wedged(state: State) -> bool:
    """A member in `state` is wedged: its view is over, or not begun (DerechoNode.wedged)."""
    return state is not State.ACTIVE and state is not State.CATCHING_UP
