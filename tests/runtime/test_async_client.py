"""AsyncClient's waits give way to cancellation: the HTTP server cancels a request's reader when
its client disconnects, and a reader that ignored that ran the request to its end."""

import asyncio

import pytest

from runtime.client import AsyncClient


def test_a_cancel_that_lands_as_a_reply_arrives_is_not_lost():
    async def main():
        client = AsyncClient("tcp://127.0.0.1:9")  # nothing is sent: the queue is fed by hand
        try:
            queue = client._open("r1")
            reader = asyncio.ensure_future(client._next("r1", queue, timeout=30))
            await asyncio.sleep(0)  # the reader now waits on the queue
            queue.put_nowait("a reply")  # a reply and a cancel in the same loop turn,
            reader.cancel()  # before the reader has resumed: the cancel must win
            with pytest.raises(asyncio.CancelledError):
                await reader
        finally:
            client.close()

    asyncio.run(main())


def test_a_wait_with_no_reply_still_times_out():
    from runtime.client import ClientTimeout

    async def main():
        client = AsyncClient("tcp://127.0.0.1:9")
        try:
            with pytest.raises(ClientTimeout):
                await client._next("r1", client._open("r1"), timeout=0.05)
        finally:
            client.close()

    asyncio.run(main())
