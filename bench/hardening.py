"""Bench sections of the hardening issue: memory under hostile upload load.

    overload   N concurrent uploads of a 640x480 JPEG followed by 10 MB of trailing bytes to
               one `multihead serve` (default settings: 256 MiB of request bytes in flight):
               server RSS at start, peak and after; how many were answered and how many
               refused (503 + Retry-After) before their body was read
    soak       minutes of mixed traffic (valid uploads over several bots, malformed bodies,
               OIP v2 and TF Serving requests, oversized bodies) from a few clients; server
               RSS sampled throughout: it must stay flat

"start" is the server's RSS after a warm-up burst of distinct images (full trunk batches have
run, so the trunk's working memory is part of it). Both report the server process's own RSS
(VmRSS), sampled every 20 ms by a thread of this process, plus VmHWM after its reset through
/proc/<pid>/clear_refs where the kernel allows it.
"""
from __future__ import annotations

import asyncio
import base64
import json
import random
import threading
import time
from pathlib import Path

from bench.stats import rss_bytes

MIB = 1024 * 1024
TRAILING_BYTES = 10 * 1000 * 1000
INFLIGHT_BUDGET_BYTES = 256 * MIB  # the server's default max_inflight_bytes


class RssSampler:
    """Samples a process's VmRSS every `period_s` in a thread; `peak` and `series` after."""

    def __init__(self, pid: int, period_s: float = 0.02) -> None:
        self.pid, self.period_s = pid, period_s
        self.series: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            self.series.append((time.monotonic() - t0, rss_bytes(self.pid)))
            self._stop.wait(self.period_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak(self) -> int:
        return max((r for _, r in self.series), default=0)


def reset_peak(pid: int) -> bool:
    """Resets VmHWM (Linux: write 5 to clear_refs); False where not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def vm_hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


async def _settle_rss(pid: int, seconds: float) -> int:
    """RSS after the burst: the lowest of the samples over `seconds` (the server may still be
    freeing the last buffers when the last answer arrives)."""
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        samples.append(rss_bytes(pid))
        await asyncio.sleep(0.1)
    return min(samples)


async def overload(url: str, pid: int, jpegs: list[bytes], uploads: int, bot: str) -> dict:
    from bench.load import client_session

    jpeg = jpegs[0]
    body = jpeg + b"\0" * TRAILING_BYTES  # one buffer shared by every upload of the client
    statuses: dict[str, int] = {}
    wrong = 0
    retry_after_missing = 0
    async with client_session(limit=0) as session:
        async def classify(image: bytes) -> list:
            async with session.post(f"{url}/classify/{bot}", data=image,
                                    headers={"Content-Type": "image/jpeg"}) as resp:
                return (await resp.json())["results"][0]["predictions"]

        # Warm-up: distinct images at once, so full trunk batches have run and the trunk's
        # working memory at max_batch_size is part of "start" (it is steady state, not load).
        reference = (await asyncio.gather(*(classify(j) for j in jpegs)))[0]
        await asyncio.sleep(1.0)
        rss_start = await _settle_rss(pid, 1.0)
        hwm_reset = reset_peak(pid)

        async def one() -> None:
            nonlocal wrong, retry_after_missing
            async with session.post(f"{url}/classify/{bot}", data=body,
                                    headers={"Content-Type": "image/jpeg"}) as resp:
                payload = await resp.read()
                statuses[str(resp.status)] = statuses.get(str(resp.status), 0) + 1
                if resp.status == 200:
                    got = json.loads(payload)["results"][0]["predictions"]
                    wrong += [p["label"] for p in got] != [p["label"] for p in reference]
                elif resp.status == 503 and "Retry-After" not in resp.headers:
                    retry_after_missing += 1

        t0 = time.monotonic()
        with RssSampler(pid) as sampler:
            await asyncio.gather(*(one() for _ in range(uploads)), return_exceptions=False)
            elapsed = time.monotonic() - t0
            rss_after = await _settle_rss(pid, 3.0)
    peak = max(sampler.peak, vm_hwm(pid) if hwm_reset else 0)
    return {
        "uploads": uploads, "upload_bytes": len(body), "statuses": statuses,
        "wrong_answers": wrong, "refused_without_retry_after": retry_after_missing,
        "elapsed_s": elapsed, "rss_start_bytes": rss_start, "rss_peak_bytes": peak,
        "rss_after_bytes": rss_after, "budget_bytes": INFLIGHT_BUDGET_BYTES,
        "peak_over_start_bytes": peak - rss_start,
        "peak_limit_bytes": int(INFLIGHT_BUDGET_BYTES * 1.25),
        "after_over_start": (rss_after - rss_start) / rss_start if rss_start else None,
    }


def _soak_request(rng: random.Random, jpegs: list[bytes], bots: list[str]):
    """(method, path, headers, body) of one soak request: mostly valid, some hostile."""
    jpeg = rng.choice(jpegs)
    bot = rng.choice(bots)
    kind = rng.randrange(10)
    if kind < 5:
        return "POST", f"/classify/{bot}?top_k=3", {"Content-Type": "image/jpeg"}, jpeg
    if kind == 5:
        body = json.dumps({"inputs": [{"name": "image_bytes", "datatype": "BYTES",
                                       "shape": [1],
                                       "data": [base64.b64encode(jpeg).decode()]}]}).encode()
        return "POST", f"/v2/models/{bot}/infer", {"Content-Type": "application/json"}, body
    if kind == 6:
        body = json.dumps({"instances": [{"b64": base64.b64encode(jpeg).decode()}]}).encode()
        return "POST", f"/v1/models/{bot}:predict", {"Content-Type": "application/json"}, body
    if kind == 7:  # broken multipart
        return ("POST", f"/classify/{bot}", {"Content-Type": "multipart/form-data; boundary=x"},
                b"--x\r\nContent-Disposition: form-data; name=\"image\"\r\n\r\n" + jpeg[:500])
    if kind == 8:  # deep JSON
        return ("POST", f"/v2/models/{bot}/infer", {"Content-Type": "application/json"},
                b'{"inputs": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
    return ("POST", f"/classify/{bot}", {"Content-Type": "image/jpeg"},  # corrupt image
            jpeg[:len(jpeg) // 3])


async def soak(url: str, pid: int, jpegs: list[bytes], bots: list[str], duration_s: float,
               clients: int, seed: int) -> dict:
    from bench.load import client_session

    rng = random.Random(seed)
    statuses: dict[str, int] = {}
    async with client_session(limit=0) as session:
        for jpeg in jpegs[:4]:  # warm the path before the first RSS sample
            async with session.post(f"{url}/classify/{bots[0]}", data=jpeg,
                                    headers={"Content-Type": "image/jpeg"}) as resp:
                await resp.read()
        rss_start = await _settle_rss(pid, 1.0)
        end = time.monotonic() + duration_s

        async def client() -> None:
            while time.monotonic() < end:
                method, path, headers, body = _soak_request(rng, jpegs, bots)
                async with session.request(method, f"{url}{path}", data=body,
                                           headers=headers) as resp:
                    await resp.read()
                    statuses[str(resp.status)] = statuses.get(str(resp.status), 0) + 1

        with RssSampler(pid, period_s=1.0) as sampler:
            await asyncio.gather(*(client() for _ in range(clients)))
        rss_end = await _settle_rss(pid, 2.0)
    series = sampler.series
    tail = [r for t, r in series if t >= duration_s / 2] or [rss_end]
    head = [r for t, r in series if t < duration_s / 2] or [rss_start]
    return {
        "duration_s": duration_s, "clients": clients, "requests": sum(statuses.values()),
        "statuses": statuses, "rss_start_bytes": rss_start, "rss_end_bytes": rss_end,
        "rss_max_bytes": max(r for _, r in series) if series else rss_end,
        "rss_first_half_mean_bytes": sum(head) / len(head),
        "rss_second_half_mean_bytes": sum(tail) / len(tail),
        "rss_series": [(round(t, 1), r) for t, r in series],
    }
