"""The /ui pages in a real browser: Debian's Chromium driven by selenium (the system chromedriver; nothing
downloads a browser) against the Serve application on loopback (the session's local Ray, as
tests/e2e/test_serve_e2e.py serves it), with API-key auth on, over the suite's
small store (tests/support/store_factory.py) plus one document whose id and text are hostile HTML.

One server and one browser serve the whole module; each browser test saves a screenshot in its tmp dir.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import httpx
import pytest
from PIL import Image

from pipeline.store import Store
from schemas.config import ModelSpec
from schemas.modes import Variant
from tests.support.ray_fixtures import free_port, ray_session  # noqa: F401  (fixture)
from tests.support.store_factory import DOCUMENTS, build_store, serving_store  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.browser]
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
MODEL = ModelSpec(path="tiny-qwen", device="cpu")  # the serving store's (tests/support/store_factory.py)
WAIT_S = 120
API_KEY = "ui-test-key"
HOSTILE_DOC = "<img src=x onerror=window.__pwned=1>"
HOSTILE_TEXT = "<script>window.__pwned = 2</script> Hostile markup <b>bold</b> & the order ships Friday."
QUERY = "When does part XK-4471-B ship?"
NUM_CHUNKS = sum(map(len, DOCUMENTS.values())) + 1
COMPARED = ("qvpic", "text_pic", "image_pic", "full_image")  # the modes compare-modes runs (inspector.js)
AUTH = {"Authorization": f"Bearer {API_KEY}"}

@pytest.fixture(scope="module")
def ui_store(serving_store, tmp_path_factory) -> str:
    """The suite's documents plus a hostile one, compiled with the session's model and embedder."""
    root = tmp_path_factory.mktemp("ui-store")
    build_store(root, serving_store.vlm, serving_store.embedder, {**DOCUMENTS, HOSTILE_DOC: [HOSTILE_TEXT]},
                variants=(Variant.TEMPLATE, Variant.PLAIN, Variant.TEXT))  # what the compared modes link
    return str(root)


@pytest.fixture(scope="module")
def base_url(ray_session, ui_store) -> str:
    """The Serve application `qvpic serve` deploys, on the session's local Ray, with one API key configured."""
    from ray import serve

    from serve.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    auth = {"api_key_sha256": {hashlib.sha256(API_KEY.encode()).hexdigest(): "ui"}}
    serve.run(build_app({"store": {"uri": ui_store}, "model": MODEL.model_dump(mode="json"),
                         "ingress": {"governance": {"auth": auth}}}), name="qvpic-ui", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):  # `make` installs both (APT_PACKAGES)
        if os.environ.get("CI"):  # .ci/run: a browser test that skips there proves nothing
            pytest.fail(f"CI is set and {CHROMIUM} or {CHROMEDRIVER} is missing (make installs them)")
        pytest.skip("needs Debian's chromium and chromium-driver (make installs them)")
    webdriver = pytest.importorskip("selenium.webdriver")  # in requirements-dev.lock
    os.environ["SE_MANAGER_PATH"] = "/bin/false"  # selenium-manager must never run (it would download a driver)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,2400", "--disable-extensions"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=webdriver.ChromeService(str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


def wait(driver, condition, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(lambda d: condition(d), message=what)


def console_errors(driver) -> list[str]:
    """Errors the page logged since the last call (reading the log empties it)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def by_css(driver, selector: str) -> list:
    return driver.find_elements("css selector", selector)


def open_page(driver, base_url: str, path: str, key: str | None = API_KEY) -> None:
    """Load a /ui page and, unless `key` is None, type the API key into it. Both pages ask their data
    endpoints (`/ui/api/store`, `/v1/store`) as they load, before any key is typed: that 401 is drained from
    the console log here."""
    driver.get(base_url + path)
    wait(driver, lambda d: d.execute_script("return document.readyState") == "complete", "page load")
    if path in ("/ui", "/ui/store"):
        wait(driver, lambda d: d.find_element("id", "error").text.startswith("401"), "the keyless 401")
        console_errors(driver)
    if key is not None:
        driver.find_element("id", "key").send_keys(key)
        driver.find_element("id", "key-form").submit()
        wait(driver, lambda d: d.find_element("id", "key-state").text == "key set", "key set")
    if path == "/ui" and key is not None:  # the mode list comes from GET /v1/store, which needs the key
        wait(driver, lambda d: by_css(d, "#mode option"), "modes")


def ask(driver, top_k: int = NUM_CHUNKS) -> None:
    """Submit the inspector's form and wait until the answer's cards are drawn."""
    query = driver.find_element("id", "query")
    query.clear()
    query.send_keys(QUERY)
    top = driver.find_element("id", "top_k")
    top.clear()
    top.send_keys(str(top_k))
    driver.find_element("id", "go").click()
    wait(driver, lambda d: len(by_css(d, "[data-testid=chunk-card]")) == top_k or d.find_element("id", "error").text,
         "chunk cards")


def decoded(img) -> bool:
    return bool(img.get_attribute("src")) and img.parent.execute_script(
        "return arguments[0].complete && arguments[0].naturalWidth > 0", img)


def test_each_chunk_says_where_its_kv_came_from(base_url, ui_store):
    """A fresh request reads its chunks from the store; the same one again finds them on the device."""
    body = {"query": QUERY, "chunk_ids": ["manual#00000", "manual#00001"], "mode": "image_pic", "max_new_tokens": 2}
    with httpx.Client(base_url=base_url, timeout=120, headers={**AUTH, "Cache-Control": "no-cache"}) as http:
        first, again = (http.post("/v1/answer", json=body).json() for _ in range(2))
    shapes = {r["chunk_key"]: r["shape"] for r in Store.open(ui_store).index().to_pylist()
              if r["variant"] == Variant.PLAIN.value}
    keys = {c["chunk_id"]: c["chunk_key"] for c in Store.open(ui_store).chunks().to_pylist()}
    assert [c["kv_source"] for c in first["chunks"]] == ["store", "store"]
    assert [c["kv_source"] for c in again["chunks"]] == ["device", "device"]
    for chunk in first["chunks"]:  # float32 KV of the stored shape [layers, 2, kv_heads, tokens, head_dim]
        layers, two, heads, tokens, head_dim = shapes[keys[chunk["chunk_id"]]]
        assert chunk["kv_nbytes"] == layers * two * heads * tokens * head_dim * 4
        assert chunk["tier_reason"] == "mode"


def test_the_api_is_401_without_the_key_and_answers_with_it(base_url, browser, tmp_path):
    with httpx.Client(base_url=base_url, timeout=120) as http:
        page = http.get("/ui")  # the page holds no data; its data endpoints need the key
        assert page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
        assert "'unsafe-inline'" not in page.headers["content-security-policy"]
        assert http.get("/ui/api/store").status_code == 401
        assert http.get("/ui/api/page", params={"chunk_id": "invoices#00000", "tier": "low"}).status_code == 401
        assert http.post("/v1/answer", json={"query": QUERY, "top_k": 1}).status_code == 401
        assert http.get("/ui/api/store", headers=AUTH).status_code == 200
    open_page(browser, base_url, "/ui", key=None)
    ask(browser, top_k=2)
    assert browser.find_element("id", "error").text.startswith("401")
    assert by_css(browser, "[data-testid=chunk-card]") == []
    browser.save_screenshot(str(tmp_path / "no-key.png"))
    console_errors(browser)  # the refused request's own console line; later tests start from an empty log
    open_page(browser, base_url, "/ui")
    ask(browser, top_k=2)
    assert browser.find_element("id", "error").text == ""
    assert console_errors(browser) == []


def test_an_answer_streams_with_the_context_the_model_saw(base_url, browser, tmp_path):
    open_page(browser, base_url, "/ui")
    # Count every change the stream makes to the answer before the cards are drawn (deltas, then the whole).
    browser.execute_script("""
        window.__answerChanges = 0;
        new MutationObserver(() => { window.__answerChanges += 1; })
            .observe(document.getElementById('answer'), {childList: true, characterData: true, subtree: true});""")
    ask(browser)
    assert browser.find_element("id", "error").text == ""
    assert browser.execute_script("return window.__answerChanges") >= 3  # ≥ 2 deltas and the final answer
    assert browser.find_element("id", "answer").text.strip()
    cards = by_css(browser, "[data-testid=chunk-card]")
    assert len(cards) == len(by_css(browser, "[data-testid=relevance-bar]")) == NUM_CHUNKS
    assert len(by_css(browser, "[data-testid=tau-cut]")) == 1
    assert len(by_css(browser, "[data-testid=waterfall-bar]")) == 7  # route … decode
    images = by_css(browser, "[data-testid=page]")
    assert len(images) == NUM_CHUNKS  # every chunk is served as pages in qvpic
    wait(browser, lambda d: all(decoded(img) for img in images), "page images decoded")
    first = cards[0].find_element("css selector", "[data-testid=page]")
    served_tier, served_src, served_width = (first.get_attribute(a) for a in ("data-tier", "src", "naturalWidth"))
    cards[0].find_element("css selector", "[data-testid=toggle]").click()
    wait(browser, lambda d: (img := cards[0].find_element("css selector", "[data-testid=page]"))
         .get_attribute("data-tier") != served_tier and decoded(img), "the other tier's page")
    swapped = cards[0].find_element("css selector", "[data-testid=page]")
    assert swapped.get_attribute("src") != served_src
    assert swapped.get_attribute("naturalWidth") != served_width  # another DPI, another size
    browser.save_screenshot(str(tmp_path / "inspector.png"))
    assert console_errors(browser) == []


def test_compare_modes_draws_a_bar_pair_per_mode(base_url, browser, tmp_path):
    open_page(browser, base_url, "/ui")
    driver_query = browser.find_element("id", "query")
    driver_query.send_keys(QUERY)
    browser.find_element("id", "compare").click()
    wait(browser, lambda d: len(by_css(d, "[data-testid=compare-bar]")) == 2 * len(COMPARED)
         or d.find_element("id", "error").text, "compare bars")
    assert browser.find_element("id", "error").text == ""
    widths = [bar.size["width"] for bar in by_css(browser, "[data-testid=compare-bar]")]
    assert len(widths) == 2 * len(COMPARED) and min(widths) > 0
    browser.save_screenshot(str(tmp_path / "compare.png"))
    assert console_errors(browser) == []


def test_hostile_html_in_the_corpus_is_shown_as_text_and_runs_nothing(base_url, browser, tmp_path):
    from selenium.common.exceptions import NoAlertPresentException

    open_page(browser, base_url, "/ui")
    ask(browser)
    docs = [d.text for d in by_css(browser, "[data-testid=chunk-card] .doc")]
    assert any(HOSTILE_DOC in text for text in docs), docs  # its characters, as text
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text  # noqa: B018  nothing opened one
    assert browser.execute_script("return window.__pwned") is None  # neither the onerror nor the script ran
    injected = "return document.querySelectorAll('img[src=\"x\"], main script, main b').length"
    assert browser.execute_script(injected) == 0
    browser.save_screenshot(str(tmp_path / "hostile.png"))
    # Negative control: the same id parsed as markup does make the element this test looks for.
    browser.execute_script("const d = document.createElement('div'); d.innerHTML = arguments[0];"
                           "document.querySelector('main').appendChild(d);", HOSTILE_DOC)
    assert browser.execute_script(injected) == 1
    console_errors(browser)  # the control's own broken image and CSP report


def test_the_store_page_shows_the_store(base_url, browser, ui_store, tmp_path):
    open_page(browser, base_url, "/ui/store")
    wait(browser, lambda d: len(by_css(d, "#entries tr")) > 1 or d.find_element("id", "error").text, "entries")
    facts = browser.find_element("id", "facts").text
    assert Store.open(ui_store).load_manifest_or_raise().fingerprint in facts
    # TEMPLATE at both tiers, PLAIN at the lowest, TEXT: four (variant, tier) groups (a header row above them)
    assert len(by_css(browser, "#entries tr")) == 1 + 4
    assert len(by_css(browser, "#caches tr")) == 1 + 2 and len(by_css(browser, "#quarantine tr")) == 1
    browser.save_screenshot(str(tmp_path / "store.png"))
    assert console_errors(browser) == []


def test_the_page_endpoint_serves_the_pixels_ingest_compiled_and_refuses_bad_ids(base_url, ui_store):
    store = Store.open(ui_store)
    key = next(c["chunk_key"] for c in store.chunks().to_pylist() if c["chunk_id"] == "invoices#00000")
    compiled = {r["tier"]: r["image_sizes_px"] for r in store.index().to_pylist()
                if r["chunk_key"] == key and r["variant"] == Variant.TEMPLATE.value}
    with httpx.Client(base_url=base_url, timeout=120, headers=AUTH) as http:
        for tier in ("low", "high"):
            response = http.get("/ui/api/page", params={"chunk_id": "invoices#00000", "tier": tier})
            assert response.status_code == 200 and response.headers["content-type"] == "image/png"
            image = Image.open(io.BytesIO(response.content))
            assert [list(image.size)] == [list(size) for size in compiled[tier]]  # the page size compile recorded
        for params, status in [({"chunk_id": "no-such-chunk", "tier": "low"}, 404),
                               ({"chunk_id": "../manifest.json", "tier": "low"}, 404),
                               ({"chunk_id": "/etc/passwd", "tier": "low"}, 404),
                               ({"chunk_id": "invoices#00000", "tier": "ultra"}, 404),
                               ({"chunk_id": "invoices#00000", "tier": "low", "page": "7"}, 404),
                               ({"chunk_id": "a\x00b", "tier": "low"}, 422),
                               ({"chunk_id": "invoices#00000", "tier": "../low"}, 422),
                               ({"chunk_id": "invoices#00000", "tier": "low", "page": "-1"}, 422),
                               ({"tier": "low"}, 422)]:
            assert http.get("/ui/api/page", params=params).status_code == status, params
        assert http.get("/ui/static/../../app.py").status_code == 404
        assert http.get("/ui/static/routes.py").status_code == 404  # only the listed assets
