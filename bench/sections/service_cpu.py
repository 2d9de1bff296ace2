"""The arithmetic of the service section's "keeps up with its trunk" targets (issue 31, item
2): pure functions of numbers the section measured, so the tests can feed them numbers.

Per closed-loop load point of a server the section records (`measure_points`):

- `server_cpu_ms_per_image`: the server process's CPU time (utime + stime, all threads) over
  the point / the images its trunk ran in it (cache off: every image served);
- `client_cpu_ms_per_image`: the bench process's own CPU time over the point (it runs the load
  client in-process) / the same images;
- `trunk_ms_per_batch_in_server` and `mean_batch`: the server's `multihead_trunk_seconds` and
  `multihead_batch_size` histograms over the point (sum / count);
- `cores` and `machine_bound_images_per_s` = cores / (server + client CPU per image): what the
  machine could serve were every core busy with nothing but this server and its client.

Against the raw trunk of the server's runtime x precision (its "sizes" table: ms per batch and
CPU ms per image at batch 1, 2, 4, ... up to the max batch size), once measured:

- `trunk_ms_alone_at_mean_batch`: the raw trunk's ms per batch at the point's mean batch,
  linear between the two measured sizes around it;
- `trunk_in_server_ratio` = trunk ms per batch in the server / that;
- `raw_trunk_cpu_ms_per_image`: the raw trunk's CPU per batch at the mean batch (linear
  likewise) / the mean batch;
- `request_path_cpu_ms_per_image` = server CPU per image - that: what decoding, HTTP, the
  heads and every hand-off cost on top of the trunk;
- `bound_ratio` = served images/s / the machine's bound.

Both raw quantities are interpolated per BATCH, not per image: a trunk's time per batch is
close to affine in its rows, so the mean of a server's batch times is the time at its mean
batch only in that form.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from backbone.profile import profile_sizes
from bench.stats import num


def needed_sizes(max_batch_size: int) -> tuple[int, ...]:
    """Batch sizes the raw trunk is measured at to compare a server of `max_batch_size` with:
    the sizes of the server's own warm-up profile (`backbone.profile.profile_sizes`: the powers
    of two below it, and it: 1, 2, 4, 8, 16 for 16; 1, 2, 4, 6 for 6)."""
    return profile_sizes(max_batch_size)


def interpolate(xy: Sequence[tuple[float, float]], x: float) -> float:
    """y at `x` on the polyline through the points `xy` (any order, distinct x): linear
    between the two around it, the end value beyond either end; NaN when `x` is NaN or there
    is no point."""
    x = num(x)
    pts = sorted((float(a), float(b)) for a, b in xy)
    if not pts or math.isnan(x):
        return math.nan
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


def alone_at(sizes: Sequence[Mapping], batch: float) -> tuple[float, float]:
    """(ms per batch, CPU ms per image) of the raw trunk at `batch` rows, from its "sizes"
    table ({batch_size, ms_per_batch, cpu_ms_per_image}): both interpolated per batch.
    NaN where the table has no such numbers."""
    batch = num(batch)
    ms = [(s["batch_size"], num(s.get("ms_per_batch"))) for s in sizes]
    cpu = [(s["batch_size"], num(s.get("cpu_ms_per_image")) * s["batch_size"]) for s in sizes]
    ms_at = interpolate([p for p in ms if not math.isnan(p[1])], batch)
    cpu_batch = interpolate([p for p in cpu if not math.isnan(p[1])], batch)
    return ms_at, cpu_batch / batch if batch > 0 else math.nan


def per_image_ms(cpu_s: float, images: float) -> float:
    """CPU seconds spent over `images` images, in ms per image (NaN without images)."""
    cpu_s, images = num(cpu_s), num(images)
    return 1000.0 * cpu_s / images if images > 0 else math.nan


def machine_bound(cores: float, server_cpu_ms: float, client_cpu_ms: float) -> float:
    """Images/s the machine can serve with the client on it: `cores` seconds of CPU per second
    / the CPU seconds one image costs the server and the client together (NaN when a number
    is missing or the cost is not positive)."""
    cost_ms = num(server_cpu_ms) + num(client_cpu_ms)
    cores = num(cores)
    return 1000.0 * cores / cost_ms if cost_ms > 0 else math.nan


def request_path_cpu_ms(server_cpu_ms: float, raw_cpu_ms: float) -> float:
    """The server's CPU per served image less the raw trunk's per image: the request path's."""
    return num(server_cpu_ms) - num(raw_cpu_ms)


def load_figures(cpu_server_s: float, cpu_client_s: float, images: float,
                 cores: int) -> dict:
    """What a load point records of CPU (see the module's text): from the server's and the
    client's CPU seconds over the point and the images the server's trunk ran in it."""
    server = per_image_ms(cpu_server_s, images)
    client = per_image_ms(cpu_client_s, images)
    return {"images_served": images, "cores": cores, "server_cpu_ms_per_image": server,
            "client_cpu_ms_per_image": client,
            "machine_bound_images_per_s": machine_bound(cores, server, client)}


def against_raw(point: Mapping, raw: Mapping) -> dict:
    """A load point's figures against the raw trunk `raw` (its "sizes" table; see the
    module's text); NaN for whatever either does not have."""
    batch = num(point.get("mean_batch", point.get("mean_batch_size")))
    alone_ms, raw_cpu = alone_at(raw.get("sizes") or [], batch)
    in_server = num(point.get("trunk_ms_per_batch_in_server"))
    served = num(point.get("throughput_images_per_s"))
    bound = num(point.get("machine_bound_images_per_s"))
    server_cpu = num(point.get("server_cpu_ms_per_image"))
    return {"trunk_ms_alone_at_mean_batch": alone_ms,
            "trunk_in_server_ratio": in_server / alone_ms if alone_ms > 0 else math.nan,
            "raw_trunk_cpu_ms_per_image": raw_cpu,
            "request_path_cpu_ms_per_image": request_path_cpu_ms(server_cpu, raw_cpu),
            "bound_ratio": served / bound if bound > 0 else math.nan}
