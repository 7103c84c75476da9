"""`/docs` (Swagger UI) and `/redoc` render with no internet: a real headless chromium, which may
resolve no host but loopback, loads each page from a live server, runs its scripts (which fetch
`/openapi.json` and draw the operations), and the test reads the drawn DOM and a screenshot.
FastAPI's default pages, whose scripts come from a CDN, leave both blank here."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from PIL import Image

CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Debian's chromium is not installed (`apt-get install chromium`; `make test` installs it)")

# Without the background-networking flags chromium's own connections are refused by a closed
# network; the resolver rule makes every host but loopback unresolvable, as on an offline machine.
_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
          "--disable-background-networking", "--disable-component-update", "--disable-sync",
          "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
          # The DOM is dumped (or the screenshot taken) after 10 s of the page's virtual time, which
          # stands still while a fetch is pending: Swagger UI and ReDoc have drawn by then.
          "--virtual-time-budget=10000", "--window-size=1280,2000")
GENERATE_PATH = "/{tenant_id}/deployments/v2/llms/{deployment_name}/generate"


def _chromium(url: str, profile_dir: Path, *action: str) -> str:
    """Run chromium on `url` once with `action` (`--dump-dom`, `--screenshot=...`); its stdout."""
    command = [CHROMIUM, *_FLAGS, f"--user-data-dir={profile_dir}", *action, url]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    return result.stdout


def _assert_drawn(screenshot: Path) -> None:
    """A blank page is one colour; a drawn one has text, badges and borders in thousands."""
    num_colours = len(Image.open(screenshot).convert("RGB").getcolors(1 << 24))
    assert num_colours > 100, f"{screenshot} looks blank ({num_colours} colours)"


@needs_chromium
@pytest.mark.parametrize("page, drawn_markers", [
    # Swagger UI draws one `opblock` per operation, tagged with its path.
    ("docs", ('data-path="/health"', f'data-path="{GENERATE_PATH}"')),
    # ReDoc draws each operation's summary and path.
    ("redoc", ("/health", "Generate text in one response", GENERATE_PATH)),
])
def test_docs_page_renders_offline(live, tmp_path, page, drawn_markers):
    url = f"{live.base_url}/{page}"
    dom = _chromium(url, tmp_path / "profile", "--dump-dom")
    for marker in drawn_markers:
        assert marker in dom, f"{page}: {marker!r} not drawn; DOM starts {dom[:500]!r}"
    screenshot = tmp_path / f"{page}.png"
    _chromium(url, tmp_path / "profile", f"--screenshot={screenshot}")
    _assert_drawn(screenshot)


def test_docs_assets_come_from_this_server(live):
    """The pages name no outside host: every script, style and icon is served under the app."""
    for page in ("docs", "redoc"):
        html = httpx.get(f"{live.base_url}/{page}").text
        assert "http://" not in html and "https://" not in html, html
