"""`kdsync status` names a fenced peer (a clean stop of the clock protocol,
kdsync.core.fence): in the peer table and in the topic's members."""

from types import SimpleNamespace

from kdsync.core.types import View
from kdsync.status import member_status, problems, render


def test_a_fenced_peer_is_shown_fenced_in_the_view():
    view = View(3, ("dc1", "dc2", "dc3"), (1, 1, 1), ("dc1", "dc2", "dc3"), 0)
    node = SimpleNamespace(view=view, status="active", fenced={"dc3": 12}, leads=None)
    pipe = SimpleNamespace(topic="events", global_topic="events-global", node=node, writer=None, durable_end=40,
                           own_waiting=lambda: 0)
    transport = SimpleNamespace(peers={"dc2": 0, "dc3": 0}, path=lambda p: "tcp" if p == "dc2" else None)
    snap = member_status("dc1", "clock", None, 0.0, (1, 1), [pipe], transport, None, [], None)
    assert snap["topics"][0]["fenced"] == ["dc3"]
    assert [(p["peer"], p["in_view"], p["fenced"]) for p in snap["peers"]] == [("dc2", True, False),
                                                                              ("dc3", True, True)]
    text = render([snap])
    assert "dc3   none  fenced" in text and "dc1,dc2,dc3(fenced)" in text
    assert problems(snap) == ["dc1: no link to dc3"]  # the region is down: still reported
