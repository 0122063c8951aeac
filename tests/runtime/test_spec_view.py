"""The browser page shows what speculation does, checked in headless Chromium (Playwright, driving
Debian's chromium): the shipped SmolLM2 behind `overlap serve` with n-gram drafting and the
websocket bridge; every token coloured by its depth (0 = the target's own token, d = a draft
accepted at depth d), live tok/s and TTFT, the model and the speculation mode, and the compare
toggle rerunning the same prompt with speculation off. The screenshot is kept as an artifact
($OVERLAP_ARTIFACTS, default runs/artifacts/spec_view.png)."""

import os
import shutil
from pathlib import Path

import pytest

from overlap.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from runtime.client import Client
from runtime.daemon import Daemon

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("OVERLAP_ARTIFACTS", REPO / "runs" / "artifacts"))
TOKEN = "page-token"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Debian's chromium, not a Playwright download (those cannot be fetched here): headless, and
# nothing that reaches for the network on its own.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Code that repeats itself: n-gram drafting finds the continuation in the context, so drafts
# are accepted, several per step.
PROMPT = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\nclass Point3D:\n"
MAX_TOKENS = 32
WAIT_MS = 300_000  # two loaded CPU cores: generous, never a timing claim

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian: apt-get install chromium)")


@pytest.fixture(scope="module")
def daemon(smol_dir):
    config = EngineConfig(model=str(smol_dir), spec=SpecConfig(method="ngram", num_spec_tokens=3, controller="off"),
                          cache=CacheConfig(page_size=16, num_pages=128),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_batched_tokens=256))
    with Daemon(config, "tcp://127.0.0.1:*", ready_timeout_s=600, ws_listen="127.0.0.1:0", ws_token=TOKEN) as d:
        yield d


@pytest.fixture
def page():
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (pip install playwright)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": 1280, "height": 900})
        finally:
            browser.close()


def _depths(page, output: str) -> list[int]:
    return page.eval_on_selector_all(f"#{output} span.tok", "els => els.map((e) => Number(e.dataset.depth))")


@pytest.mark.slow  # the shipped model in a daemon of its own, and three generations of it
def test_page_colours_tokens_by_origin_and_compares_with_speculation_off(page, daemon):
    with Client(daemon.endpoint, timeout=300) as client:
        want = client.generate(PROMPT, max_tokens=MAX_TOKENS)
    base = daemon.ws_endpoint.replace("ws://", "http://")
    page.goto(f"{base}?token={TOKEN}")
    # The server line: the model and the speculation mode, from the bridge's info answer.
    page.wait_for_function("document.getElementById('server').textContent.includes('ngram')", timeout=WAIT_MS)
    server_line = page.text_content("#server")
    assert "SmolLM2" in server_line and "ngram, 3 drafts per step" in server_line, server_line

    # 1. Type the prompt and run it with the server's speculation.
    page.fill("#prompt", PROMPT)
    page.fill("#max_tokens", str(MAX_TOKENS))
    page.click("#go")
    page.wait_for_selector("#stats-spec[data-finished]", timeout=WAIT_MS)
    assert page.text_content("#output") == want.text
    depths = _depths(page, "output")
    assert {0, 1, 2} <= set(depths), depths  # target tokens and drafts accepted at depths 1 and 2
    assert page.locator("#output span.tok.d1").count() > 0 and page.locator("#output span.tok.d0").count() > 0
    stats = page.text_content("#stats-spec")
    assert "tok/s" in stats and "TTFT" in stats and "acceptance length" in stats, stats
    assert page.is_hidden("#run-off")

    # 2. The compare toggle reruns the same prompt with speculation off, shown beside the first.
    page.check("#compare")
    page.wait_for_selector("#stats-off[data-finished]", timeout=WAIT_MS)
    assert page.is_visible("#run-off")
    # Greedy speculative output is the greedy output: the two runs read the same...
    assert page.text_content("#output-off") == want.text
    # ...but without speculation every token is the target's own.
    assert set(_depths(page, "output-off")) == {0}
    assert "acceptance length" not in page.text_content("#stats-off")
    for run in ("spec", "off"):
        assert float(page.get_attribute(f"#stats-{run}", "data-tok-per-s")) > 0
    speedup = page.text_content("#speedup")
    assert "speculation on:" in speedup and "off:" in speedup and "×" in speedup, speedup

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "spec_view.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"screenshot: {shot}")
