"""Hostile input over HTTP against a real server: every malformed request gets a 4xx with the
JSON error body (or 503/504 when overloaded), the server stays alive and correct, and its
memory does not grow with what it refused. Its logs, in JSON meanwhile, stay one object per
line with the keys every line has, and hold none of the credentials the cases sent (the
operator token, a tenant's API key) nor the image bytes (a marker inside the PNG).

`make test` runs MULTIHEAD_FUZZ_CASES=2000 (the default); `make fuzz` runs 20,000.
"""
from __future__ import annotations

import asyncio
import collections
import json
import os

import aiohttp
import pytest
import yarl
from PIL import Image, PngImagePlugin

from accounts.tenants import SECRET_CHARS
from bench.stats import rss_bytes
from service.core import logs
from tests.backbone.helpers import encode
from tests.fuzz.cases import Generator
from tests.support.logcapture import Captured

CASES = int(os.environ.get("MULTIHEAD_FUZZ_CASES", "2000"))
SEED = int(os.environ.get("MULTIHEAD_FUZZ_SEED", "0"))
TOKEN = "fuzz-token"
CONCURRENCY = 8
# RSS may grow by allocator arenas and caches warming up, not with the number of requests.
RSS_GROWTH_LIMIT = 200 * 2**20
# Inside every (unmutated or bit-rotten) image the cases send: never in a log line.
MARKER = "MULTIHEAD-IMAGE-MARKER-q7Zx"

pytestmark = pytest.mark.timeout(3600)


def png_with_marker() -> bytes:
    info = PngImagePlugin.PngInfo()
    info.add_text("Comment", MARKER)
    return encode(Image.new("RGB", (48, 48), (200, 40, 90)), pnginfo=info)


async def test_malformed_requests_get_4xx_json_and_the_server_survives(make_client, store):
    _, api_key = store.add_key("default", "infer")
    client = await make_client(admin_token=TOKEN, max_body_bytes=2 * 2**20,
                               max_inflight_bytes=64 * 2**20, max_ws_message_bytes=2**20)
    image = png_with_marker()
    assert MARKER.encode() in image
    base = str(client.make_url("/")).rstrip("/")
    cases = Generator(SEED, image, TOKEN, api_key)
    statuses: collections.Counter = collections.Counter()
    bad: list[str] = []
    unsendable = 0

    warm = await client.post("/classify/alpha", data=image, headers={"Content-Type": "image/png"})
    assert warm.status == 200
    reference = (await warm.json())["results"][0]["predictions"]
    rss_start = rss_bytes()

    async def one(case) -> None:
        nonlocal unsendable
        try:
            url = yarl.URL(base + case.path, encoded=True)
            async with client.session.request(case.method, url, data=case.body,
                                              headers=case.headers) as resp:
                body = await resp.read()
                status = resp.status
                ctype = resp.headers.get("Content-Type", "")
        except (ValueError, aiohttp.InvalidURL, aiohttp.ClientPayloadError):
            unsendable += 1  # the client library itself refused to send it
            return
        except aiohttp.ClientResponseError as exc:
            # A HEAD whose request line the server could not parse: the server cannot know it
            # was a HEAD and sends its JSON error body, which the client refuses to read.
            if case.method == "HEAD" and 400 <= exc.status < 500:
                statuses[exc.status] += 1
                return
            bad.append(f"{case.kind} {case.method} {case.path[:80]}: {exc}")
            return
        except aiohttp.ServerDisconnectedError:
            bad.append(f"{case.kind} {case.method} {case.path[:80]}: server disconnected")
            return
        statuses[status] += 1
        if status >= 500 and status not in (503, 504):
            bad.append(f"{case.kind} {case.method} {case.path[:80]} -> {status} {body[:200]!r}")
        elif status >= 400 and case.method != "HEAD":
            try:
                error = json.loads(body)
                ok = set(error) >= {"error", "code"} and "json" in ctype
            except ValueError:
                ok = False
            if not ok:
                bad.append(f"{case.kind} {case.method} {case.path[:80]} -> {status} "
                           f"non-JSON error {body[:120]!r}")

    it = iter(cases)
    with Captured("json") as captured:
        for start in range(0, CASES, CONCURRENCY):
            batch = [next(it) for _ in range(min(CONCURRENCY, CASES - start))]
            await asyncio.gather(*(one(case) for case in batch))
    rss_end = rss_bytes()
    print(f"\nfuzz: {CASES} cases, seed {SEED}: statuses {dict(sorted(statuses.items()))}, "
          f"not sendable by the client {unsendable}, RSS {rss_start / 1e6:.0f} -> "
          f"{rss_end / 1e6:.0f} MB")

    assert bad == [], "\n".join(bad[:20])
    # The logs: one JSON object per line, each with every key; an access line per request
    # (but those aiohttp could not parse); no credential, no image bytes.
    lines = captured.lines()
    for line in lines:
        assert set(logs.JSON_KEYS) <= set(json.loads(line)), line
    access = captured.access()
    assert len(access) >= sum(statuses.values()) - statuses[400], len(access)
    text = captured.text()
    for secret in (TOKEN, api_key, api_key[-SECRET_CHARS:], MARKER):
        assert secret not in text, f"{secret[:12]}... in the logs"
    assert sum(statuses.values()) + unsendable == CASES
    assert unsendable < CASES // 20, unsendable
    assert sum(n for s, n in statuses.items() if 400 <= s < 500) > CASES // 2, statuses
    # Alive and still right: the same image gives the same answer as before the storm.
    health = await client.get("/healthz")
    assert health.status == 200
    again = await client.post("/classify/alpha", data=image, headers={"Content-Type": "image/png"})
    assert again.status == 200
    assert (await again.json())["results"][0]["predictions"] == reference
    assert rss_end - rss_start < RSS_GROWTH_LIMIT, (rss_start, rss_end)


async def test_bad_websocket_frames_get_an_error_or_the_right_close_code(make_client):
    client = await make_client(max_ws_message_bytes=10_000)
    image = encode(Image.new("RGB", (32, 32), (1, 2, 3)))
    async with client.ws_connect("/ws/classify/alpha") as ws:
        for frame in ("text, not an image", "", "{\"json\": true}"):
            await ws.send_str(frame)
            reply = await ws.receive_json()
            assert (reply["code"], reply["status"]) == ("bad_request", 400)
        for frame in (b"", b"\x00" * 100, b"\x89PNG\r\n\x1a\n broken"):
            await ws.send_bytes(frame)
            reply = await ws.receive_json()
            assert reply["status"] == 400 and reply["code"] in ("invalid_image", "bad_request")
        await ws.send_bytes(image)  # still usable
        assert (await ws.receive_json())["bot_id"] == "alpha"
        await ws.send_bytes(b"\x00" * 20_000)  # over the message limit
        closing = await ws.receive()
        assert closing.type == aiohttp.WSMsgType.CLOSE and closing.data == 1009
    resp = await client.get("/ws/classify/nobody")  # unknown bot: 404 JSON before any upgrade
    assert resp.status == 404 and (await resp.json())["code"] == "unknown_bot"
