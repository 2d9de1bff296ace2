"""The web page in a real headless browser: Debian's chromium, driven by Selenium through
Debian's chromedriver (same build as the browser; nothing is downloaded), against a real aiohttp
server on loopback around the session's real trunk and a real store.

Each test loads the page, acts like a user (tick bots, choose or drop an image) and reads what
the page renders; the answer is checked against the API's own answer for the same image.

NOTE: the WebDriver client blocks, so every browser step runs in a worker thread
(`asyncio.to_thread`) while the test's event loop stays free: the page's requests are served by
the test's server (`make_client`) on that loop, or by the session's shared one in its thread.

Set MULTIHEAD_SCREENSHOT_DIR to a folder to keep a PNG of each page the tests look at.
"""
from __future__ import annotations

import asyncio
import base64
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.backbone.helpers import encode, pattern
from tests.support.builders import random_head
from tests.support.servers import BOTS

pytestmark = pytest.mark.timeout(180)

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALL_HINT = ("install Debian's browser and its driver: `make browser-deps` "
                "(apt-get update && apt-get install -y chromium chromium-driver)")
WAIT_S = 30
# Closed network, running as root: no sandbox, no GPU, and nothing that phones home.
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-quic", "--no-first-run", "--no-default-browser-check",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--disable-extensions", "--no-proxy-server",
                  "--window-size=1280,1000")


@pytest.fixture(scope="module")
def browser():
    """One headless chromium for the module (about 1.5 s to start), with a fresh profile."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail(f"the browser test needs {' and '.join(missing)}: {INSTALL_HINT}",
                    pytrace=False)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("the browser test needs selenium: pip install -e '.[test]'", pytrace=False)

    profile = tempfile.mkdtemp(prefix="multihead-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    # An explicit driver path: Selenium Manager (which would download one) never runs.
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)),
                              options=options)
    driver.set_page_load_timeout(WAIT_S)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


# -- browser steps (blocking: run them with asyncio.to_thread) -----------------------------------

def _css(driver, selector):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def _wait_for(driver, selector, what):
    """Waits for `selector` to match; fails with what the page shows instead."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(
            lambda d: _css(d, selector) or _css(d, "#error:not([hidden])"))
    except TimeoutException:
        pytest.fail(f"{what}: nothing matched {selector!r} within {WAIT_S} s; page says:\n"
                    f"{_css(driver, 'body')[0].text}")
    errors = _css(driver, "#error:not([hidden])")
    if errors and not _css(driver, selector):
        pytest.fail(f"{what}: the page shows an error: {errors[0].text}")
    return _css(driver, selector)


def _screenshot(driver, name):
    folder = os.environ.get("MULTIHEAD_SCREENSHOT_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(folder) / f"{name}.png"))


def _open_classify_page(driver, url):
    driver.get(url)
    _wait_for(driver, "#bots[data-state='ready']", "the bot list")
    _wait_for(driver, "#trunk[data-state='ready']", "the trunk status")


def _tick(driver, bot_ids, top_k):
    for bot_id in bot_ids:
        box = _css(driver, f"#bot-list li[data-bot='{bot_id}'] input[type='checkbox']")
        assert box, f"bot {bot_id!r} is not offered on the page"
        if not box[0].is_selected():
            _css(driver, f"#bot-list li[data-bot='{bot_id}'] label")[0].click()
        assert box[0].is_selected()
    field = _css(driver, "#top-k")[0]
    field.clear()
    field.send_keys(str(top_k))


def _read_results(driver, what):
    """{bot_id: [(label, score from data-score, displayed percentage)]} and the latency line."""
    _wait_for(driver, "#results[data-state='done']", what)
    rendered = {}
    for card in _css(driver, "#result-cards .card"):
        rows = card.find_elements("css selector", ".predictions li")
        rendered[card.get_attribute("data-bot")] = [
            (row.find_element("css selector", ".label").text,
             float(row.get_attribute("data-score")),
             row.find_element("css selector", ".score").text) for row in rows]
    latency = _css(driver, "#latency")[0]
    return rendered, latency.text if latency.is_displayed() else ""


def classify_with_file_input(driver, url, bot_ids, top_k, image_path):
    """Opens the page, ticks the bots, chooses the file: the page sends it on its own."""
    _open_classify_page(driver, url)
    _tick(driver, bot_ids, top_k)
    _css(driver, "#file")[0].send_keys(str(image_path))
    _wait_for(driver, "#preview:not([hidden])", "the preview")
    result = _read_results(driver, "the classification")
    _screenshot(driver, "classify")
    return result


DROP_JS = """
const [data, name, type] = arguments;
const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
const transfer = new DataTransfer();
transfer.items.add(new File([bytes], name, {type}));
const zone = document.getElementById("drop");
for (const kind of ["dragenter", "dragover", "drop"]) {
  zone.dispatchEvent(new DragEvent(kind, {bubbles: true, cancelable: true,
                                          dataTransfer: transfer}));
}
"""


def drop_file(driver, data: bytes, name: str, content_type: str):
    driver.execute_script(DROP_JS, base64.b64encode(data).decode(), name, content_type)


def classify_by_drop(driver, url, data, top_k):
    """Opens the page with bots preselected by `?bots=`, drops the image on the drop zone."""
    _open_classify_page(driver, url)
    _tick(driver, [], top_k)
    drop_file(driver, data, "dropped.jpg", "image/jpeg")
    result = _read_results(driver, "the classification of the dropped image")
    _screenshot(driver, "classify-several")
    return result


def error_after_upload(driver, url, bot_id, path):
    _open_classify_page(driver, url)
    _tick(driver, [bot_id], 3)
    _css(driver, "#file")[0].send_keys(str(path))
    _wait_for(driver, "#results[data-state='error']", "the error")
    _screenshot(driver, f"error-{path.suffix[1:]}")
    return _css(driver, "#error")[0].text


def read_bots_page(driver, url):
    driver.get(url)
    _wait_for(driver, "#bot-table[data-state='ready']", "the bots page")
    _wait_for(driver, "#trunk[data-state='ready']", "the trunk status")
    rows = {}
    for row in _css(driver, "table.bots tbody tr"):
        rows[row.get_attribute("data-bot")] = {
            "version": row.find_element("css selector", ".version").text,
            "n_classes": row.find_element("css selector", ".n-classes").text,
            "labels": [chip.get_attribute("textContent")
                       for chip in row.find_elements("css selector", ".chips li")],
        }
    _screenshot(driver, "bots")
    return rows, _css(driver, "#trunk")[0].text


def read_int8_agreements(driver, url):
    """The Bots page's INT8 agreement cells once ready: bot -> (text, below the bound)."""
    driver.get(url)
    _wait_for(driver, "#bot-table[data-state='ready']", "the bots page")
    return {row.get_attribute("data-bot"): (cell.text, "below" in cell.get_attribute("class"))
            for row in _css(driver, "table.bots tbody tr")
            for cell in row.find_elements("css selector", "td.int8")}


def read_trunk_status(driver, url):
    """The page's trunk line once ready: (its text, its tooltip)."""
    driver.get(url)
    node = _wait_for(driver, "#trunk[data-state='ready']", "the trunk status")[0]
    _screenshot(driver, "trunk")
    return node.text, node.get_attribute("title")


# -- tests -----------------------------------------------------------------------------------

def _api_predictions(body):
    return [(p["label"], p["score"]) for p in body["results"][0]["predictions"]]


def assert_rendered(rendered, want):
    """Same labels in the same order, the exact scores behind the bars, percentages shown."""
    assert [r[0] for r in rendered] == [w[0] for w in want]
    for (label, score, shown), (_, want_score) in zip(rendered, want):
        assert score == pytest.approx(want_score, abs=1e-6), label
        assert shown.endswith("%") and abs(float(shown[:-1]) - 100 * want_score) <= 0.0501, \
            (label, shown, want_score)


async def _weights(client) -> str:
    resp = await client.get("/readyz")
    return (await resp.json())["trunk"]["weights"]


async def test_one_bot_through_the_file_input_matches_the_api(browser, shared_client, tmp_path):
    client = shared_client
    image = encode(pattern(42, size=(400, 300)), "PNG")
    path = tmp_path / "pattern.png"
    path.write_bytes(image)

    rendered, latency = await asyncio.to_thread(
        classify_with_file_input, browser, str(client.make_url("/")), ["charlie"], 3, path)

    resp = await client.post("/classify/charlie?top_k=3", data=image,
                             headers={"Content-Type": "image/png"})
    assert resp.status == 200, await resp.text()
    assert list(rendered) == ["charlie"]
    assert_rendered(rendered["charlie"], _api_predictions(await resp.json()))
    assert latency.startswith("Latency ") and " ms" in latency, latency
    trunk_text = await asyncio.to_thread(lambda: _css(browser, "#trunk")[0].text)
    assert await _weights(client) in trunk_text


async def test_the_trunk_line_shows_its_time_per_batch_in_the_server(browser, shared_client):
    """After a classification, the trunk line gives the trunk's time per batch inside the
    server at the batch size it ran most, as /readyz reports it."""
    client = shared_client
    image = encode(pattern(44, size=(320, 240)), "PNG")
    resp = await client.post("/classify/charlie", data=image,
                             headers={"Content-Type": "image/png"})
    assert resp.status == 200, await resp.text()
    text, _ = await asyncio.to_thread(read_trunk_status, browser, str(client.make_url("/")))
    here = (await (await client.get("/readyz")).json())["trunk"]["in_server"]
    size = max(here["batches"], key=lambda n: (here["batches"][n], -int(n)))
    assert f"batch {size}: {here['batch_ms'][size]:.0f} ms here" in text, text
    batch_size = (await (await client.get("/readyz")).json())["trunk"]["batch_size"]
    assert f"batches ≤ {batch_size}" in text, text


async def test_several_bots_by_drag_and_drop_match_the_api(browser, shared_client):
    client = shared_client
    image = encode(pattern(43, size=(640, 480)), "JPEG", quality=90)
    url = str(client.make_url("/").with_query(bots="alpha,echo"))

    rendered, _ = await asyncio.to_thread(classify_by_drop, browser, url, image, 2)

    resp = await client.post("/classify?bots=alpha,echo&top_k=2", data=image,
                             headers={"Content-Type": "image/jpeg"})
    assert resp.status == 200, await resp.text()
    results = (await resp.json())["results"]
    assert list(rendered) == ["alpha", "echo"]
    for bot_id in ("alpha", "echo"):
        assert_rendered(rendered[bot_id], _api_predictions(results[bot_id]))


@pytest.mark.parametrize("name, data, content_type", [
    ("broken.png", b"\x89PNG\r\n\x1a\n but not really", "image/png"),
    ("notes.txt", b"just some text", "text/plain"),
])
async def test_api_errors_are_shown_as_readable_messages(browser, shared_client, tmp_path,
                                                         name, data, content_type):
    client = shared_client
    path = tmp_path / name
    path.write_bytes(data)

    shown = await asyncio.to_thread(error_after_upload, browser, str(client.make_url("/")),
                                    "bravo", path)

    resp = await client.post("/classify/bravo?top_k=3", data=data,
                             headers={"Content-Type": content_type})
    body = await resp.json()
    assert resp.status in (400, 415)
    assert body["error"] in shown and str(resp.status) in shown and body["code"] in shown


async def test_bots_page_lists_every_bot_with_version_and_classes(browser, make_client, store):
    # A second version, and a bot with more classes than the page shows unfolded.
    store.register("bravo", *random_head(BOTS["bravo"], seed=21))
    store.register("foxtrot", *random_head(100, seed=22))
    bots = {**BOTS, "foxtrot": 100}
    client = await make_client()
    rows, trunk_text = await asyncio.to_thread(
        read_bots_page, browser, str(client.make_url("/static/bots.html")))

    assert sorted(rows) == sorted(bots)
    assert rows["bravo"]["version"] == "v2"
    for bot_id, n_classes in bots.items():
        resp = await client.get(f"/bots/{bot_id}")
        info = await resp.json()
        assert rows[bot_id] == {"version": f"v{info['version']}", "n_classes": str(n_classes),
                                "labels": info["labels"]}
        assert info["labels"] == list(store.get(bot_id).labels)
    assert await _weights(client) in trunk_text


async def test_the_page_shows_the_int8_trunks_calibration_set_and_date(browser, make_client,
                                                                       int8_trunk):
    client = await make_client(trunk_obj=int8_trunk)
    text, title = await asyncio.to_thread(read_trunk_status, browser,
                                          str(client.make_url("/")))
    calibration = int8_trunk.calibration
    assert "openvino int8" in text, text
    assert f"calibrated on {calibration.images} images, {calibration.date[:10]}" in text, text
    assert calibration.description in title and calibration.digest[:16] in title, title
    assert calibration.date in title and f"float layers {int8_trunk.float_precision}" in title
    assert f"precision {int8_trunk.choice.why}" in title
    # The Bots page: each bot's agreement with the INT8 trunk, as GET /bots/{id} gives it.
    cells = await asyncio.to_thread(read_int8_agreements, browser,
                                    str(client.make_url("/static/bots.html")))
    assert sorted(cells) == sorted(BOTS)
    for bot_id, (text, below) in cells.items():
        share = (await (await client.get(f"/bots/{bot_id}")).json())["int8_agreement"]
        assert (text, below) == (f"{100 * share:.2f} %", share < 0.99), bot_id


def classify_after_giving_the_key(driver, url, token, bot_id, image_path):
    """On a server with API keys: the page says it needs a key; the key typed in, it lists
    the key's tenant's bots and classifies. Returns (error shown first, bots offered, results)."""
    from selenium.webdriver.common.keys import Keys

    driver.get(url)
    try:
        error = _wait_for(driver, "#error:not([hidden])", "the refusal without a key")[0].text
        _css(driver, "#api-key")[0].send_keys(token + Keys.TAB)  # change: the page reloads
        _open_classify_page(driver, url)
        offered = [li.get_attribute("data-bot") for li in _css(driver, "#bot-list li")]
        _tick(driver, [bot_id], 2)
        _css(driver, "#file")[0].send_keys(str(image_path))
        rendered, _ = _read_results(driver, "the key's classification")
        return error, offered, rendered
    finally:
        driver.execute_script("sessionStorage.clear()")  # the next test's page has no key


async def test_with_api_keys_the_page_asks_for_a_key_and_shows_its_tenants_bots_only(
        browser, make_client, store, tmp_path):
    store.add_tenant("acme")
    store.register("acme-bot", *random_head(3, seed=31), tenant="acme")
    _, token = store.add_key("acme", "infer")
    client = await make_client(auth="keys")
    image = encode(pattern(43, size=(320, 240)), "PNG")
    path = tmp_path / "pattern.png"
    path.write_bytes(image)

    error, offered, rendered = await asyncio.to_thread(
        classify_after_giving_the_key, browser, str(client.make_url("/")), token, "acme-bot",
        path)
    assert "needs an API key" in error, error
    assert offered == ["acme-bot"]  # the other tenant's five bots are not offered
    resp = await client.post("/classify/acme-bot?top_k=2", data=image,
                             headers={"Content-Type": "image/png",
                                      "Authorization": f"Bearer {token}"})
    assert_rendered(rendered["acme-bot"], _api_predictions(await resp.json()))


def read_candidates(driver, url, token):
    """The bots page without a key, then with `token` (a manager's): (the column names
    without, the column names with, {bot: what its candidate cell shows})."""
    driver.get(url)
    _wait_for(driver, "#bot-table[data-state='ready']", "the bots page")
    anonymous = [th.text for th in _css(driver, "table.bots thead th")]
    driver.execute_script("sessionStorage.setItem('multihead-api-key', arguments[0])", token)
    try:
        driver.get(url)
        _wait_for(driver, "#bot-table[data-state='ready']", "the bots page with the key")
        columns = [th.text for th in _css(driver, "table.bots thead th")]
        cells = {}
        for row in _css(driver, "table.bots tbody tr"):
            cell = row.find_element("css selector", "td.candidate")
            cells[row.get_attribute("data-bot")] = {
                "version": cell.get_attribute("data-version"),
                "mode": cell.get_attribute("data-mode"),
                "text": cell.get_attribute("textContent"),
                "disagreements": [
                    (li.get_attribute("data-live"), li.get_attribute("data-candidate"),
                     int(li.get_attribute("data-images")))
                    for li in cell.find_elements("css selector", ".disagreements li")]}
        _screenshot(driver, "bots-candidates")
        return anonymous, columns, cells
    finally:
        driver.execute_script("sessionStorage.clear()")  # the next test's page has no key


async def test_the_bots_page_shows_a_candidate_and_its_stats_to_a_manager(browser, make_client,
                                                                          store, jpegs):
    store.register("alpha", *random_head(4, seed=71), candidate="canary:50")
    client = await make_client(admin_token="page-operator")
    auth = {"Authorization": "Bearer page-operator"}
    for i, image in enumerate(jpegs[:4]):
        resp = await client.post("/classify/alpha", data=image,
                                 headers={"Content-Type": "image/jpeg",
                                          "X-Multihead-Route-Key": f"user-{i}"})
        assert resp.status == 200
    info = await (await client.get("/bots/alpha", headers=auth)).json()
    stats = info["candidate"]["stats"]
    assert stats["images"] == 4

    anonymous, columns, cells = await asyncio.to_thread(
        read_candidates, browser, str(client.make_url("/static/bots.html")), "page-operator")
    assert "Candidate" not in anonymous  # an anonymous caller is not shown candidates
    assert columns == ["Bot", "Version", "Classes", "Labels", "Candidate", "Created (UTC)"]
    shown = cells.pop("alpha")
    assert (shown["version"], shown["mode"]) == ("2", "canary")
    assert "v2 · canary 50 %" in shown["text"]
    assert f"4 images compared · {100 * stats['agreement']:.1f} % agree" in shown["text"]
    assert f"mean |Δp| {stats['mean_abs_diff']:.3f} · {stats['answered']} answered" \
        in shown["text"]
    assert shown["disagreements"] == [(d["live"], d["candidate"], d["images"])
                                      for d in stats["disagreements"]]
    assert all(cell["text"] == "none" for cell in cells.values())  # the other bots


async def test_the_page_and_its_assets_are_served(shared_client):
    client = shared_client
    for path, content_type in (("/", "text/html"), ("/static/bots.html", "text/html"),
                               ("/static/app.js", "javascript"), ("/static/style.css", "text/css")):
        resp = await client.get(path)
        assert resp.status == 200, path
        assert content_type in resp.headers["Content-Type"], (path, resp.headers["Content-Type"])
    # Everything is local: no CDN, no third-party host in the page or its assets.
    for path in ("/", "/static/bots.html", "/static/app.js", "/static/style.css"):
        text = await (await client.get(path)).text()
        assert "http://" not in text and "https://" not in text, path
