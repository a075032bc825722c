"""The transition consumer asks, after the message it waited for, only for as many as the broker
said were stored behind it: a larger request makes nats-py pull again and linger until its timeout
(which held every lone batch, and with it every request's close, ~35 ms)."""

from __future__ import annotations

from nats.aio.msg import Msg

from coordinator.transition_consumer import _stored_behind


def _delivery(pending: int) -> Msg:
    # a JetStream delivery's reply subject: $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ns>.<pending>
    return Msg(None, subject="kvl.t", reply=f"$JS.ACK.s.c.1.5.5.1700000000000000000.{pending}", data=b"")


def test_what_the_broker_held_behind_a_delivery() -> None:
    assert _stored_behind(_delivery(0)) == 0
    assert _stored_behind(_delivery(37)) == 37


def test_a_message_that_is_not_a_jetstream_delivery_has_nothing_behind_it() -> None:
    assert _stored_behind(Msg(None, subject="kvl.t", reply="", data=b"")) == 0
