"""The live map in a real headless browser (Debian's chromium through selenium): the page
loads with no console error, draws one cell per expert of every MoE layer, cells flash as
a generate runs, and a screenshot is kept as a test artifact (COLIBRI_ARTIFACTS, else the
test's temporary directory)."""

import os
import shutil
import time

import httpx
import pytest
from test_gateway import colibrid, gateway

from colibri.storage.demo import write_demo_model

webdriver = pytest.importorskip("selenium.webdriver")


def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not binary or not driver:
        pytest.skip("chromium and chromium-driver are not installed (./setup.sh --test installs them)")
    opts = Options()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,1000"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=opts)


def until(fn, timeout=30.0):
    end = time.time() + timeout
    while time.time() < end:
        got = fn()
        if got:
            return got
        time.sleep(0.1)
    return fn()


def test_the_map_draws_every_expert_and_flashes_the_routed_ones(tmp_path):
    model = write_demo_model(tmp_path / "demo")
    with colibrid(tmp_path, model) as sock, gateway(sock) as url:
        b = browser()
        try:
            b.get(url + "/")
            assert until(lambda: b.execute_script("return window.colibriMap.cells")) == 4 * 16  # 4 layers x 16
            canvas = b.find_element("id", "brain")
            assert canvas.get_attribute("data-cells") == "64"
            step0 = int(canvas.get_attribute("data-step"))
            flashes0 = b.execute_script("return window.colibriMap.flashes")
            r = httpx.post(url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 24,
                                                          "seed": 2, "temperature": 1.0}, timeout=60)
            assert r.status_code == 200
            assert until(lambda: int(canvas.get_attribute("data-step")) > step0)
            assert until(lambda: b.execute_script("return window.colibriMap.flashes") > flashes0)
            assert b.execute_script("return window.colibriMap.frames") > 0
            atlas = until(lambda: b.execute_script("return document.getElementById('atlasnote').textContent"))
            assert "clusters" in atlas
            out = os.environ.get("COLIBRI_ARTIFACTS") or str(tmp_path)
            os.makedirs(out, exist_ok=True)
            shot = os.path.join(out, "live-map.png")
            b.save_screenshot(shot)
            assert os.path.getsize(shot) > 10_000
            errors = [e for e in b.get_log("browser") if e["level"] == "SEVERE"]
            assert not errors, errors
        finally:
            b.quit()
