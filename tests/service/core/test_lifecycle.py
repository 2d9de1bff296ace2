"""The bring-up's start-up path: what it imports, and the trunk's batch profile.

- The batch profile (`backbone.profile`) is measured at warm-up, kept in graph_cache/ next to the
  trunk checkpoint, loaded by the next start, shown as `trunk.profile` in the full /readyz and
  given by `Service.batch_profile`: on the pure-numpy fake runtime (tests.backbone.helpers), then
  once on the real trunk (TensorFlow, the session's checkpoint).
- A real `multihead serve` whose compiled OpenVINO trunk is in the cache becomes ready without
  importing TensorFlow (a stand-in compiled model: the start path is the subject, not the
  features).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from backbone.profile import BatchProfile
from backbone.runners import registry
from bench import prometheus
from heads import Head
from service.core.settings import Settings
from service.transports.http.app import SERVICE, create_app
from store import HeadStore
from tests.backbone.helpers import FAKE, FakeRunner, copy_graphs
from tests.support.builders import random_head

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def fake_runtime():
    with registry.registered(FAKE, FakeRunner):
        yield


@pytest.fixture
def fake_checkpoint(tmp_path) -> str:
    """A store whose trunk checkpoint the fake runtime 'loads' (only its files are looked at)."""
    trunk = tmp_path / "store" / "trunk"
    trunk.mkdir(parents=True)
    (trunk / "demo_inception_v4.ckpt").write_bytes(b"weights")
    HeadStore(tmp_path / "store").close()
    return str(trunk / "demo_inception_v4.ckpt")


def settings_for(tmp_path, **overrides) -> Settings:
    # The fake runtime's time is about proportional to the batch: its working batch size
    # would be any; only the test of it takes it from the profile.
    values = dict(store=str(tmp_path / "store"), auth="none", max_wait_ms=5.0, warmup=True,
                  max_batch_size=4, batch_from_profile=False)
    values.update(overrides)
    return Settings(**values)


async def ready(aiohttp_client, settings: Settings, trunk=None):
    """A started app, ready: (its client, its service, the full /readyz body)."""
    client = await aiohttp_client(create_app(settings, trunk=trunk))
    for _ in range(3000):
        resp = await client.get("/readyz")
        body = await resp.json()
        if resp.status == 200 or body["status"] == "failed":
            break
        await asyncio.sleep(0.02)
    assert body["status"] == "ready", body
    return client, client.server.app[SERVICE], body


async def restart(aiohttp_client, client, settings: Settings, trunk=None):
    await client.close()
    return await ready(aiohttp_client, settings, trunk)


def profiles(checkpoint: str) -> list[Path]:
    return sorted((Path(checkpoint).parent / "graph_cache").glob("batch-profile-*.json"))


# -- the batch profile, on the fake runtime -------------------------------------------------------

async def test_the_profile_is_measured_once_then_loaded(aiohttp_client, tmp_path, fake_runtime,
                                                        fake_checkpoint):
    settings = settings_for(tmp_path, runtime="fake", trunk_checkpoint=fake_checkpoint)
    client, service, body = await ready(aiohttp_client, settings)
    first = service.batch_profile
    assert isinstance(first, BatchProfile) and first.source == "measured"
    assert first.sizes == (1, 2, 4) and first.seconds_at(3) > 0
    shown = body["trunk"]["profile"]
    assert shown["source"] == "measured" and list(shown["batch_ms"]) == ["1", "2", "4"]
    assert shown["batch_ms"]["4"] == pytest.approx(first.seconds[4] * 1e3, abs=1e-3)
    assert {"import_s", "warmup_s", "ready_s"} <= set(body["timings"])
    assert len(profiles(fake_checkpoint)) == 1

    client, service, body = await restart(aiohttp_client, client, settings)
    assert service.batch_profile.source == "cached"
    assert service.batch_profile.seconds == first.seconds
    assert body["trunk"]["profile"]["source"] == "cached"
    assert body["trunk"]["profile"]["measured_at"] == first.measured_at
    await client.close()


async def test_the_batch_size_is_the_smallest_within_5_percent_of_the_profiles_best(
        aiohttp_client, tmp_path, fake_runtime, fake_checkpoint):
    """The batcher's batch size is the profile's working size (issue 32): the smallest size
    within 5 % of the best images/s, at most --max-batch-size; shown in the full /readyz and
    /metrics. --no-batch-from-profile keeps --max-batch-size."""
    settings = settings_for(tmp_path, runtime="fake", trunk_checkpoint=fake_checkpoint,
                            batch_from_profile=True)
    client, service, body = await ready(aiohttp_client, settings)
    (saved,) = profiles(fake_checkpoint)
    data = json.loads(saved.read_text())
    for seconds, working in (({"1": 0.010, "2": 0.012, "4": 0.040}, 2),   # 100, 167, 100 /s
                             ({"1": 0.010, "2": 0.0189, "4": 0.036}, 2),  # 100, 105.8, 111 /s
                             ({"1": 0.010, "2": 0.040, "4": 0.080}, 1),   # 100, 50, 50 /s
                             ({"1": 0.040, "2": 0.040, "4": 0.040}, 4)):  # 25, 50, 100 /s
        saved.write_text(json.dumps({**data, "seconds": seconds}))
        client, service, body = await restart(aiohttp_client, client, settings)
        assert service.batch_profile.source == "cached"
        assert service.engine.batcher.max_batch_size == working, seconds
        assert body["trunk"]["batch_size"] == working
        assert body["trunk"]["profile"]["working_batch_size"] == working
        text = await (await client.get("/metrics")).text()
        assert prometheus.value(text, "multihead_batch_size_working") == working
    client, service, body = await restart(
        aiohttp_client, client, settings_for(tmp_path, runtime="fake",
                                             trunk_checkpoint=fake_checkpoint))
    assert service.engine.batcher.max_batch_size == 4 and body["trunk"]["batch_size"] == 4
    client, service, body = await restart(
        aiohttp_client, client, settings_for(tmp_path, runtime="fake", max_batch_size=2,
                                             trunk_checkpoint=fake_checkpoint,
                                             batch_from_profile=True))
    assert service.engine.batcher.max_batch_size == 2  # the last profile says 4: capped
    await client.close()


async def test_shared_batches_take_what_the_profile_runs_within_the_slice(
        aiohttp_client, tmp_path, fake_runtime, fake_checkpoint):
    """While tenants share the trunk a batch takes at most what the profile runs within
    --shared-batch-ms (unset: 1.5 x its batch of one): in the batcher, the full /readyz and
    /metrics; 0 is off (the full batch size)."""
    settings = settings_for(tmp_path, runtime="fake", trunk_checkpoint=fake_checkpoint)
    client, service, body = await ready(aiohttp_client, settings)
    (saved,) = profiles(fake_checkpoint)
    data = json.loads(saved.read_text())
    saved.write_text(json.dumps({**data, "seconds": {"1": 0.010, "2": 0.014, "4": 0.030}}))
    # (slice, share, a batch carrying a light tenant's rows: within twice the slice; shares
    # off: the whole batch)
    for slice_ms, shared, light in ((None, 2, 4), (30.0, 4, 4), (12.0, 1, 3), (0, 4, 4)):
        client, service, body = await restart(aiohttp_client, client, settings_for(
            tmp_path, runtime="fake", trunk_checkpoint=fake_checkpoint,
            shared_batch_ms=slice_ms))
        assert service.engine.batcher.sharing.shared == shared, slice_ms
        assert body["trunk"]["shared_batch_size"] == shared
        assert body["trunk"]["light_batch_size"] == light, slice_ms
        text = await (await client.get("/metrics")).text()
        assert prometheus.value(text, "multihead_batch_size_shared") == shared
    await client.close()


async def test_metrics_and_readyz_give_the_trunks_time_alone_and_in_the_server(
        aiohttp_client, tmp_path, fake_runtime, fake_checkpoint):
    """/metrics has the profile as trunk_alone_seconds by batch size, and the batches run as
    trunk_batch_seconds/trunk_batches; /readyz's trunk.in_server has their mean, by size, and
    trunk.live_batch_ms the live profile the batcher's deadline cut reads (one batch: its
    time), and trunk.around_ms the work around a batch's trunk it allows (learnt from it)."""
    settings = settings_for(tmp_path, runtime="fake", trunk_checkpoint=fake_checkpoint)
    client, service, body = await ready(aiohttp_client, settings)
    assert "in_server" not in body["trunk"] and body["trunk"]["live_batch_ms"] == {}
    from service.core.schedule import ANSWER_S

    assert body["trunk"]["around_ms"] == 1000 * ANSWER_S  # nothing learnt yet
    text = await (await client.get("/metrics")).text()
    assert {int(n): s for n, s in prometheus.by_labels(text, "multihead_trunk_alone_seconds")
            .items()} == pytest.approx(service.batch_profile.seconds)
    w, b, labels = random_head(3, seed=1)
    head = Head("a", 1, tuple(labels), w, b)
    images = np.random.default_rng(0).uniform(-1, 1, (2, 299, 299, 3)).astype(np.float32)
    await service.engine.classify_arrays(images, [head], top_k=1)
    text = await (await client.get("/metrics")).text()
    assert prometheus.by_labels(text, "multihead_trunk_batches_total") == {"2": 1}
    took = prometheus.value(text, 'multihead_trunk_batch_seconds_total{batch_size="2"}')
    body = await (await client.get("/readyz")).json()
    assert body["trunk"]["in_server"] == {"batch_ms": {"2": pytest.approx(took * 1e3, abs=1e-3)},
                                          "batches": {"2": 1}}
    assert body["trunk"]["live_batch_ms"] == {"2": pytest.approx(took * 1e3, abs=1e-2)}
    # The work around that batch's trunk, as the event loop timed the batch.
    assert body["trunk"]["around_ms"] == pytest.approx(
        1000 * service.engine.batcher.deadlines.around_s(), abs=1e-3)
    assert service.engine.batcher.deadlines._around is not None  # noqa: SLF001 - learnt
    await client.close()


async def test_no_warmup_measures_nothing_but_loads_a_saved_profile(aiohttp_client, tmp_path,
                                                                    fake_runtime,
                                                                    fake_checkpoint):
    off = settings_for(tmp_path, runtime="fake", trunk_checkpoint=fake_checkpoint, warmup=False)
    client, service, body = await ready(aiohttp_client, off)
    assert service.batch_profile is None and "profile" not in body["trunk"]
    assert profiles(fake_checkpoint) == []
    on = settings_for(tmp_path, runtime="fake", trunk_checkpoint=fake_checkpoint)
    client, service, _ = await restart(aiohttp_client, client, on)
    assert service.batch_profile.source == "measured"
    client, service, body = await restart(aiohttp_client, client, off)
    assert service.batch_profile.source == "cached" and body["trunk"]["profile"]
    await client.close()


async def test_without_the_graph_cache_the_profile_is_measured_and_not_kept(
        aiohttp_client, tmp_path, fake_runtime, fake_checkpoint):
    settings = settings_for(tmp_path, runtime="fake", trunk_checkpoint=fake_checkpoint,
                            graph_cache=False)
    client, service, _ = await ready(aiohttp_client, settings)
    assert service.batch_profile.source == "measured" and profiles(fake_checkpoint) == []
    await client.close()


async def test_a_larger_max_batch_size_is_measured_again(aiohttp_client, tmp_path, fake_runtime,
                                                         fake_checkpoint):
    settings = settings_for(tmp_path, runtime="fake", trunk_checkpoint=fake_checkpoint)
    client, service, _ = await ready(aiohttp_client, settings)
    bigger = settings_for(tmp_path, runtime="fake", trunk_checkpoint=fake_checkpoint,
                          max_batch_size=8)
    client, service, body = await restart(aiohttp_client, client, bigger)
    assert service.batch_profile.source == "measured"
    assert list(body["trunk"]["profile"]["batch_ms"]) == ["1", "2", "4", "8"]
    await client.close()


async def test_a_trunk_given_is_warmed_but_not_profiled(aiohttp_client, tmp_path, fake_runtime,
                                                        fake_checkpoint):
    from backbone import Trunk

    trunk = Trunk.from_checkpoint(fake_checkpoint, device="cpu", runtime="fake",
                                  warmup_batch_sizes=())
    calls = []
    original = trunk.features

    def features(images):
        calls.append(len(images))
        return original(images)

    trunk.features = features
    client, service, body = await ready(aiohttp_client, settings_for(tmp_path), trunk)
    assert calls == [1]  # the CPU warm-up: batch 1, as before
    assert service.batch_profile is None and "profile" not in body["trunk"]
    await client.close()


# -- the batch profile, on the real trunk --------------------------------------------------------

async def test_the_real_trunks_profile_is_measured_saved_and_loaded(
        aiohttp_client, tmp_path, trunk_checkpoint, serving_graph_cache):
    """The session's checkpoint (linked) with its saved TF graph (copied): TensorFlow fp32,
    batch sizes 1 and 2; the second start loads what the first measured."""
    trunk_dir = tmp_path / "store" / "trunk"
    trunk_dir.mkdir(parents=True)
    source = Path(trunk_checkpoint)
    for path in source.parent.glob(f"{source.name}.*"):
        (trunk_dir / path.name).symlink_to(path)
    copy_graphs(serving_graph_cache, trunk_dir / "graph_cache")
    HeadStore(tmp_path / "store").close()
    settings = settings_for(tmp_path, runtime="tf", precision="fp32", max_batch_size=2)
    client, service, body = await ready(aiohttp_client, settings)
    first = service.batch_profile
    assert body["trunk"]["runtime"] == "tf" and service.trunk.graph_from_cache
    assert first.source == "measured" and first.sizes == (1, 2)
    assert 0 < first.seconds[1] < first.seconds[2] * 2
    saved = profiles(str(trunk_dir / source.name))
    assert len(saved) == 1
    assert json.loads(saved[0].read_text())["identity"]["runtime"] == "tf"

    client, service, body = await restart(aiohttp_client, client, settings)
    assert service.batch_profile.source == "cached"
    assert service.batch_profile.seconds == first.seconds
    assert body["trunk"]["profile"]["batch_ms"] == first.report()["batch_ms"]
    await client.close()


# -- a restart with the compiled trunk in the cache imports no TensorFlow --------------------------

def fake_compiled_trunk(cache_dir: Path, prefix: str) -> None:
    """Writes a compiled OpenVINO model where `serve` finds the compiled fp32 trunk of `prefix`:
    the mean colour of the image times a fixed matrix, [N, 299, 299, 3] -> [N, 1536]."""
    import openvino as ov
    from openvino import opset13 as ops

    from backbone.runners.base import Layout
    from backbone.runners.openvino import CompiledCache, compile_config

    images = ops.parameter([-1, 299, 299, 3], np.float32, name="input")
    mean = ops.reduce_mean(images, np.array([1, 2], np.int64), False)
    weights = np.random.default_rng(0).standard_normal((3, 1536)).astype(np.float32)
    model = ov.Model([ops.matmul(mean, ops.constant(weights), False, False)], [images], "fake")
    compiled = ov.Core().compile_model(model, "CPU", compile_config("fp32"))
    CompiledCache(cache_dir, prefix=prefix, precision="fp32", with_logits=False).save(
        compiled, Layout([], {"PreLogitsFlatten": [None, 1536]}, 0).to_json())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_until_ready(store: Path, *flags: str) -> tuple[dict, str]:
    """Runs `multihead serve` until /readyz says ready, then SIGTERM: (the full /readyz, what
    the process printed, ending with whether it had imported TensorFlow)."""
    port = free_port()
    code = ("import atexit, sys\n"
            "atexit.register(lambda: print('tensorflow imported:', 'tensorflow' in sys.modules,"
            " flush=True))\n"
            "from cli.main import main\n"
            f"sys.exit(main(['serve', '--store', {str(store)!r}, '--port', '{port}', "
            f"'--auth', 'none', *{list(flags)!r}]))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    body, deadline = None, time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
                    body = json.load(r)
                    break
            except OSError:
                time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert body is not None, out
    return body, out


def stand_in_store(tmp_path: Path) -> Path:
    """A store whose demo checkpoint's compiled OpenVINO fp32 trunk is a stand-in
    (`fake_compiled_trunk`; the checkpoint's files are placeholders)."""
    store = tmp_path / "store"
    trunk = store / "trunk"
    trunk.mkdir(parents=True)
    prefix = trunk / "demo_inception_v4.ckpt"
    Path(f"{prefix}.index").write_bytes(b"the index of a checkpoint")
    Path(f"{prefix}.data-00000-of-00001").write_bytes(b"its weights")
    fake_compiled_trunk(trunk / "graph_cache", str(prefix))
    return store


@pytest.mark.subprocess
def test_a_restart_with_the_compiled_trunk_cached_imports_no_tensorflow(tmp_path):
    pytest.importorskip("openvino")
    store = stand_in_store(tmp_path)
    flags = ("--runtime", "openvino", "--precision", "fp32", "--max-batch-size", "4")
    body, out = serve_until_ready(store, *flags)
    assert body["status"] == "ready" and body["trunk"]["runtime"] == "openvino"
    assert body["timings"]["build_s"] == 0 and body["timings"]["restore_s"] == 0
    assert body["trunk"]["profile"]["source"] == "measured"
    assert "no TensorFlow: the trunk loads without it" in out
    assert out.strip().splitlines()[-1] == "tensorflow imported: False", out

    body, out = serve_until_ready(store, *flags)  # the profile now loads too
    assert body["trunk"]["profile"]["source"] == "cached"
    assert out.strip().splitlines()[-1] == "tensorflow imported: False", out


def fresh_blas_threads() -> int:
    """The BLAS threads numpy gets in a new interpreter here (its default on this machine)."""
    code = ("import numpy, threadpoolctl; print(max(p['num_threads'] for p in "
            "threadpoolctl.threadpool_info() if p['user_api'] == 'blas'))")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout)


@pytest.mark.subprocess
def test_a_cpu_trunk_owns_the_cores_and_the_heads_blas_runs_on_one_thread(tmp_path):
    """`multihead serve` on a CPU trunk (a stand-in compiled model): /readyz says the trunk owns
    the cores and the process's BLAS has one thread; with --no-own-cores, numpy's default."""
    pytest.importorskip("openvino")
    store = stand_in_store(tmp_path)
    flags = ("--runtime", "openvino", "--precision", "fp32", "--max-batch-size", "2")

    body, _ = serve_until_ready(store, *flags)
    assert body["trunk"]["cores"] == {"owned": True, "blas_threads": 1}
    body, _ = serve_until_ready(store, *flags, "--no-own-cores")
    assert body["trunk"]["cores"] == {"owned": False, "blas_threads": fresh_blas_threads()}
