"""Connection limits (issue 34, item 5): a client that sends its request head or its body too
slowly is answered 408 `request_timeout` and its connection closed, while other clients are
served meanwhile. A real aiohttp server on loopback, raw sockets as the slow clients."""
from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from PIL import Image

from service.core.errors import HEAD_TIMEOUT_ERROR
from tests.backbone.helpers import encode

pytestmark = pytest.mark.timeout(120)
PNG = {"Content-Type": "image/png"}
# Generous: the configured bounds below are about 1 s; a slow CI runner may add seconds.
BOUND_S = 20.0


async def _trickle(writer: asyncio.StreamWriter, head: bytes, drip: bytes) -> None:
    """Sends `head`, then one byte of `drip` every 0.2 s, until the server closes."""
    with contextlib.suppress(ConnectionError):
        writer.write(head)
        await writer.drain()
        for byte in drip:
            await asyncio.sleep(0.2)
            writer.write(bytes([byte]))
            await writer.drain()


async def _slow_client(client, head: bytes, drip: bytes) -> bytes:
    """Everything the server sends a slow client until it closes the connection."""
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    sender = asyncio.ensure_future(_trickle(writer, head, drip))
    try:
        return await asyncio.wait_for(reader.read(), BOUND_S)  # read(): until EOF
    finally:
        sender.cancel()
        writer.close()


async def _served_meanwhile(client, slow: asyncio.Future) -> int:
    """Classifications by another client while `slow` runs: each must be a 200."""
    body, served = encode(Image.new("RGB", (64, 64), (9, 9, 9))), 0
    while not slow.done() or served == 0:
        resp = await client.post("/classify/alpha", data=body, headers=PNG)
        assert resp.status == 200, await resp.text()
        served += 1
    return served


def _answer(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)


async def test_a_request_head_sent_too_slowly_is_answered_408_and_its_connection_closed(
        make_client):
    client = await make_client(header_timeout_s=1.0)
    head = b"POST /classify/alpha HTTP/1.1\r\nHost: x\r\n"
    slow = asyncio.ensure_future(_slow_client(client, head, b"X-Slow: " + b"a" * 500))
    served = await _served_meanwhile(client, slow)
    status, body = _answer(await slow)  # the connection closed (EOF) within BOUND_S
    assert status == 408 and body["code"] == "request_timeout", body
    assert body["error"] == HEAD_TIMEOUT_ERROR  # told from a late body (bench.hostile's label)
    assert served >= 1


async def test_a_body_sent_below_the_minimum_rate_is_answered_408_and_its_connection_closed(
        make_client):
    client = await make_client(body_min_rate_bytes_s=1000, body_grace_s=0.5)
    head = (b"POST /classify/alpha HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
            b"Content-Length: 20000000\r\n\r\n")
    slow = asyncio.ensure_future(_slow_client(client, head, b"\x89" * 1000))
    served = await _served_meanwhile(client, slow)
    status, body = _answer(await slow)
    assert status == 408 and body["code"] == "request_timeout", body
    assert body["error"] != HEAD_TIMEOUT_ERROR and "body too slow" in body["error"], body
    assert served >= 1


async def test_a_body_at_a_good_pace_is_not_timed_out(make_client):
    client = await make_client(body_min_rate_bytes_s=1000, body_grace_s=0.5)
    body = encode(Image.new("RGB", (64, 64), (1, 2, 3)))

    async def steady():
        for start in range(0, len(body), 400):
            yield body[start:start + 400]
            await asyncio.sleep(0.05)  # 8 kB/s, above the minimum

    resp = await client.post("/classify/alpha", data=steady(),
                             headers={**PNG, "Content-Length": str(len(body))})
    assert resp.status == 200, await resp.text()
