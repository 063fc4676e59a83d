"""A Deliveries subscription keeps answers that come before anyone waits for them.

A ring (client/driver.py) starts a step before the client asks for it, so the first node's
answer often reaches the client first; it must still be there when the client asks, and
the buffer must stay bounded when nobody ever asks.
"""

from __future__ import annotations

import asyncio

import pytest

from client.channels import ChannelPool
from client.deliveries import EARLY_ANSWERS, DeliveryLost, Subscription
from protos.tessera.v1 import client_api_pb2, common_pb2, stage_pb2


def delivery(step: int, *, error: str = "") -> stage_pb2.Delivery:
    message = stage_pb2.Delivery(step=step, layers=common_pb2.LayerRange(start=0, end=2))
    if error:
        message.error_code = 9  # FAILED_PRECONDITION
        message.error_message = error
    else:
        message.response.step = step
    return message


@pytest.fixture
async def subscription():
    channels = ChannelPool()
    # Nobody listens there: the stream ends at once, and answers already in stay usable.
    sub = Subscription("n1", "127.0.0.1:9", channels, "s1", client_api_pb2.SignedCapability())
    yield sub
    sub.close()
    await channels.close()


async def test_an_answer_that_came_first_is_handed_to_whoever_asks_for_it(subscription) -> None:
    subscription._on(delivery(3))
    subscription._on(delivery(4, error="the cache is gone"))
    response, _ = await asyncio.wait_for(subscription.expect(3, 0, 2), 1)
    assert response.step == 3
    with pytest.raises(DeliveryLost, match="the cache is gone"):
        await asyncio.wait_for(subscription.expect(4, 0, 2), 1)
    # Taken once: asking again waits for a new answer (here the stream has ended).
    await asyncio.sleep(0.2)
    with pytest.raises(DeliveryLost):
        await asyncio.wait_for(subscription.expect(3, 0, 2), 1)


async def test_only_the_newest_early_answers_are_kept(subscription) -> None:
    for step in range(1, EARLY_ANSWERS + 11):
        subscription._on(delivery(step))
    assert len(subscription._early) == EARLY_ANSWERS
    newest, _ = await asyncio.wait_for(subscription.expect(EARLY_ANSWERS + 10, 0, 2), 1)
    assert newest.step == EARLY_ANSWERS + 10
    subscription.forget(11, 0, 2)
    assert (11, 0, 2) not in subscription._early
    await asyncio.sleep(0.2)
    with pytest.raises(DeliveryLost):  # the oldest aged out
        await asyncio.wait_for(subscription.expect(1, 0, 2), 1)
