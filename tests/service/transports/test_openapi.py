"""The API description served: /openapi.json from a real server, the docs page in a browser, and
Schemathesis over every operation against a real server on loopback (the document itself, without
a server: tests/service/codecs/test_openapi_document.py).

The Schemathesis run is bounded (few examples per operation, fewer for the ones that reach the
trunk) so it stays well under a minute on 2 cores; MULTIHEAD_SCHEMATHESIS_EXAMPLES and
MULTIHEAD_SCHEMATHESIS_SEED widen or move it (`make`-style: set them for a longer hunt).
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import textwrap
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import aiohttp
import pytest

from service.codecs import openapi
from service.codecs.routes import ENDPOINTS
from tests.service.codecs.test_openapi_document import document
from tests.support.builders import random_head
from tests.support.prometheus import metric
from tests.support.servers import BOTS

# The operations that change bots: Schemathesis runs them on scratch bots only.
BOT_CHANGES = ("put_bot", "delete_bot", "rollback_bot", "promote_candidate", "discard_candidate")

pytestmark = pytest.mark.timeout(300)

TOKEN = "schemathesis-token"
EXAMPLES = int(os.environ.get("MULTIHEAD_SCHEMATHESIS_EXAMPLES", "6"))
SEED = int(os.environ.get("MULTIHEAD_SCHEMATHESIS_SEED", "20261130"))
# Operations that decode images (or a head checkpoint): few examples, since a schema-valid body
# can be a real image that goes through the trunk, and the body's content (an image, a
# checkpoint) is more than a schema can say, so a schema-valid body may still be refused.
CONTENT_OPERATIONS = ("classify", "classify_many", "put_bot", "oip_infer", "oip_infer_version",
                      "tfs_predict", "tfs_predict_version")
SCRATCH_BOTS = ("scratch-1", "scratch-2")


# -- served by the real server ----------------------------------------------------------------------

async def test_openapi_json_is_the_generated_document(shared_client):
    client = shared_client
    resp = await client.get("/openapi.json")
    assert resp.status == 200 and resp.content_type == "application/json"
    assert await resp.json() == json.loads(json.dumps(document()))


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.urls += [v for k, v in attrs if k in ("src", "href") and v]


async def test_the_docs_page_and_all_it_loads_come_from_this_server(shared_client):
    client = shared_client
    resp = await client.get("/docs")
    assert resp.status == 200 and resp.content_type == "text/html"
    assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
    page = await resp.text()
    links = _Links()
    links.feed(page)
    assert links.urls and all(not re.match(r"^([a-z]+:)?//", u) for u in links.urls), links.urls
    want = {".css": "text/css", ".js": "text/javascript", ".png": "image/png",
            ".json": "application/json"}
    for url in links.urls:
        asset = await client.get(f"/{url}")  # relative to /docs
        assert asset.status == 200, url
        assert asset.content_type == want[os.path.splitext(url)[1]], url
        body = await asset.read()
        assert body, url
    bundle = await (await client.get("/docs/swagger-ui-bundle.js")).read()
    assert len(bundle) > 500_000 and b"SwaggerUIBundle" in bundle
    init = await (await client.get("/docs/docs.js")).text()
    assert "openapi.json" in init and "validatorUrl: null" in init
    assert "http://" not in init and "https://" not in init
    for name in ("nope.js", "..%2Fapp.py", "swagger-ui-bundle.js.map"):
        missing = await client.get(f"/docs/{name}")
        assert missing.status == 404 and (await missing.json())["code"] == "not_found", name


async def test_the_docs_page_renders_every_operation_in_a_browser(shared_client):
    from tests.service.transports.test_browser import CHROMEDRIVER, CHROMIUM, CHROMIUM_FLAGS

    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.fail("needs Debian's chromium and chromium-driver (make browser-deps)",
                    pytrace=False)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as DriverService
    from selenium.webdriver.support.ui import WebDriverWait

    url = str(shared_client.make_url("/docs"))

    def render() -> tuple[str, list[str], list[dict]]:
        """Blocking WebDriver steps (run in a thread: the test's loop stays free)."""
        profile = tempfile.mkdtemp(prefix="multihead-chromium-")
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(service=DriverService(executable_path=str(CHROMEDRIVER)),
                                  options=options)
        try:
            driver.set_page_load_timeout(30)
            driver.get(url)
            blocks = WebDriverWait(driver, 30).until(
                lambda d: d.find_elements("css selector", ".opblock"))
            title = driver.find_element("css selector", ".info .title").text
            return title, [b.get_attribute("id") for b in blocks], driver.get_log("browser")
        finally:
            driver.quit()
            shutil.rmtree(profile, ignore_errors=True)

    title, blocks, console = await asyncio.to_thread(render)
    assert title.startswith("multihead")
    # One block per operation, each named after its operation id.
    assert len(blocks) == len(ENDPOINTS)
    assert all(any(b.endswith(e.name) for b in blocks) for e in ENDPOINTS), blocks
    # Nothing blocked by the page's Content-Security-Policy, nothing failed to load.
    assert [e for e in console if e["level"] == "SEVERE"] == []


# -- what Schemathesis found (each failed before its fix) -----------------------------------------

@pytest.mark.parametrize("datatype,shape", [
    ("BYTES", [2**70]),  # was: OverflowError in np.prod(shape, dtype=int64) -> 500
    ("BYTES", [2**63, 1]),
    ("FP32", [2**64, 299, 299, 3]),
    ("FP32", [2**62, 299, 299, 3]),  # wraps around in int64 (a negative count) if not exact
])
async def test_an_oip_shape_too_big_for_int64_is_a_400(shared_client, datatype, shape):
    client = shared_client
    body = {"inputs": [{"name": "x", "datatype": datatype, "shape": shape, "data": []}]}
    resp = await client.post("/v2/models/alpha/infer", json=body)
    assert resp.status == 400, await resp.text()
    assert (await resp.json())["code"] == "bad_request"


def _upload(labels: bytes, index: bytes = b"not an index") -> aiohttp.FormData:
    form = aiohttp.FormData()
    form.add_field("index", index, filename="head.ckpt.index")
    form.add_field("data", b"not data", filename="head.ckpt.data-00000-of-00001")
    form.add_field("labels", labels, filename="labels.txt")
    return form


@pytest.mark.parametrize("labels", [b"\xff\xfe not utf-8", b"cat\ndog\n"])
async def test_a_refused_head_upload_names_no_server_path(make_client, labels):
    # was: 422 "labels file '/tmp/multihead-upload-.../labels.txt' is not UTF-8 text"
    client = await make_client(admin_token=TOKEN)
    resp = await client.put("/bots/newbie", data=_upload(labels),
                            headers={"Authorization": f"Bearer {TOKEN}"})
    body = await resp.json()
    assert resp.status == 422 and body["code"] in ("invalid_head",), body
    assert "multihead-upload" not in body["error"] and tempfile.gettempdir() not in body["error"]
    assert "<labels part>" in body["error"] or "<uploaded checkpoint>" in body["error"], body


# -- Schemathesis over every operation ------------------------------------------------------------

HOOKS = '''
"""Checks of this project, added to Schemathesis' own (loaded through SCHEMATHESIS_HOOKS)."""
import json
import os

import schemathesis

FORBIDDEN = [p for p in os.environ["MULTIHEAD_FORBIDDEN_TEXT"].split(os.pathsep) if p]


@schemathesis.check
def error_body_is_json_and_names_no_server_path(ctx, response, case):
    if response.status_code < 400:
        return None
    text = response.content.decode("utf-8", "replace")
    for bad in FORBIDDEN:
        if bad in text:
            raise AssertionError(f"the answer names a server path or internals ({bad!r}): "
                                 f"{text[:300]}")
    try:
        body = json.loads(text)
    except ValueError:
        raise AssertionError(f"a {response.status_code} answer without a JSON body: "
                             f"{text[:200]!r}") from None
    # /readyz and OIP readiness answer 503 with their own report; every other error, the
    # JSON error body.
    if not ({"status", "ready"} & set(body)):
        if not (isinstance(body.get("error"), str) and isinstance(body.get("code"), str)):
            raise AssertionError(f"not the JSON error body: {text[:200]}")
    return None
'''


def schemathesis_config(examples: int, seed: int) -> str:
    bots = ", ".join(json.dumps(b) for b in BOTS)
    scratch = ", ".join(json.dumps(b) for b in SCRATCH_BOTS)
    return textwrap.dedent(f"""\
        seed = {seed}
        workers = 1
        request-timeout = 60
        headers = {{ Authorization = "Bearer {TOKEN}" }}

        [generation]
        database = "none"
        max-examples = {examples}

        # Bot ids come from the dictionaries below (half the time) or are generated, never
        # learnt from answers: a learnt id could be deleted before the operations that need it.
        [phases.coverage]
        extra-data-sources.responses = false
        [phases.fuzzing]
        extra-data-sources.responses = false
        [phases.stateful]
        max-steps = 6

        [dictionaries.bots]
        values = [{bots}]
        [dictionaries.scratch]
        values = [{scratch}]
        [dictionaries.versions]
        values = ["1"]

        [parameters."path.bot_id"]
        dictionary = "bots"
        probability = 0.5
        [parameters."path.version"]
        dictionary = "versions"
        probability = 0.5

        # The admin routes register, roll back and remove scratch bots, not the ones the other
        # operations classify with.
        [[operations]]
        include-operation-id = {list(BOT_CHANGES)}
        parameters."path.bot_id" = {{ dictionary = "scratch", probability = 0.5 }}

        # GET /tenants lists `default`, which the stateful phase then tries to remove: the
        # server refuses it by rule (400 invalid_tenant), not for its form.
        [[operations]]
        include-operation-id = ["delete_tenant"]
        checks.positive_data_acceptance.expected-statuses = [
            "2xx", "400", "401", "403", "404", "409"]

        # The WebSocket's upgrade request: Schemathesis sends none (no `Upgrade` header), so a
        # request that passes the checks (credential, bot, top_k) is a 400, not a 101.
        [[operations]]
        include-operation-id = ["classify_ws"]
        checks.positive_data_acceptance.expected-statuses = [
            "101", "400", "401", "403", "404"]

        [[operations]]
        include-operation-id = {list(CONTENT_OPERATIONS)}
        generation.max-examples = {max(2, examples // 2)}
        checks.positive_data_acceptance.expected-statuses = [
            "2xx", "400", "401", "403", "404", "413", "422", "5xx"]
        """)


async def test_schemathesis_finds_no_server_error_and_no_answer_off_its_schema(
        make_client, store, trunk_checkpoint, tmp_path):
    for bot_id in SCRATCH_BOTS:
        store.register(bot_id, *random_head(3, seed=9))
    # With API keys, as served by default: Schemathesis calls with the operator token and
    # checks that every operation the document secures refuses a call without it.
    client = await make_client(auth="keys", admin_token=TOKEN, max_body_bytes=4 * 2**20,
                               max_images_per_request=4)
    work = tmp_path / "schemathesis"
    work.mkdir()
    # The document as the server serves it, read from a file: Schemathesis leaves out the
    # operation that served the document it loaded, and GET /openapi.json must be tested too.
    served = await client.get("/openapi.json")
    (work / "openapi.json").write_bytes(await served.read())
    (work / "schemathesis.toml").write_text(schemathesis_config(EXAMPLES, SEED))
    (work / "multihead_checks.py").write_text(HOOKS)
    junit = work / "junit.xml"
    forbidden = [str(tmp_path / "store"), trunk_checkpoint,
                 os.path.join(tempfile.gettempdir(), "multihead-upload-"), "Traceback"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "multihead_checks", "PYTHONPATH": str(work),
           "MULTIHEAD_FORBIDDEN_TEXT": os.pathsep.join(forbidden), "NO_COLOR": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "schemathesis.cli", "--config-file", "schemathesis.toml", "run",
        "openapi.json", "--url", str(client.make_url("/")).rstrip("/"), "--checks", "all",
        "--report", "junit",
        "--report-junit-path", str(junit), cwd=work, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=240)
    finally:
        if proc.returncode is None:  # timed out: stop it, the server goes away next
            proc.kill()
            await proc.wait()
    report = out.decode("utf-8", "replace")
    assert proc.returncode == 0, report[-8000:]

    cases = ET.parse(junit).getroot().iter("testcase")
    outcome = {c.get("name"): [child.tag for child in c] for c in cases}
    every = {f"{method} {path}" for method, path, _ in openapi.operations(document())}
    assert every <= set(outcome), sorted(every - set(outcome))
    assert {name: tags for name, tags in outcome.items() if tags} == {}, report[-4000:]
    # The bot dictionaries took requests past the 404s: images went through the trunk.
    metrics = await (await client.get("/metrics",
                                      headers={"Authorization": f"Bearer {TOKEN}"})).text()
    assert metric(metrics, 'multihead_requests_total{route="classify",status="200"}') >= 1, \
        report[-3000:]
