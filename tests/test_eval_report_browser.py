"""The report rendered by a real browser (headless Chromium): the trajectory viewer's elements exist
after the page's own script ran, the filter hides what it should, and nothing injected executes.

Needs a chromium binary (Debian: `apt-get install -y chromium`); skipped, with that reason, without one.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sleuth.eval.report import build_report  # noqa: E402
from test_eval_report import ANSWERS, write_eval_dir, write_training_run  # noqa: E402

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM = next((p for p in (shutil.which(n) for n in CHROMIUM_NAMES) if p), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium binary on PATH (Debian: apt-get install -y chromium)"
)


def chromium(args: list[str], profile: Path) -> subprocess.CompletedProcess:
    # Offline machine: switch off everything that would phone home or wait on the network.
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=False)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("browser") / "demo"
    write_training_run(run / "train")
    write_eval_dir(run / "eval_before", ANSWERS, {"s3": 2.0, "search_r1": 1.0})
    return build_report(run, notes=["Rendered by headless Chromium."])


def test_rendered_dom_has_viewer_and_filter_applies(report: Path, tmp_path: Path):
    result = chromium(["--dump-dom", report.as_uri() + "#filter=wrong&expand"], tmp_path / "profile")
    dom = result.stdout
    assert result.returncode == 0 and "<html" in dom, result.stderr[-2000:]

    cards = re.findall(r'<details class="traj" data-correct="(\w+)" data-source="[^"]*"([^>]*)>', dom)
    # 2 methods x 3 questions + first and last rollout step
    assert len(cards) == 8
    verdicts = [v for v, _ in cards]
    assert verdicts.count("wrong") == 4  # s3 misses Sydney; search_r1 misses two; rollout step 1
    # The page's script ran: correct cards hidden, wrong ones opened, the counter updated.
    for verdict, attrs in cards:
        if verdict == "correct":
            assert 'hidden=""' in attrs
        else:
            assert 'hidden=""' not in attrs and 'open=""' in attrs
    assert re.search(r'id="traj-count"[^>]*>4 of 8 shown<', dom)
    assert (
        'class="filter active" data-filter="wrong"' in dom
        or 'data-filter="wrong" class="filter active"' in dom
    )

    # Viewer content: question, document title (escaped), policy/env turns, gold marks.
    assert "Who wrote the novel Dune?" in dom
    assert "Title of q1 &lt;b&gt;bold&lt;/b&gt;" in dom
    assert 'class="turn policy"' in dom and 'class="turn env"' in dom
    assert '<mark class="gold">Frank Herbert</mark>' in dom
    # Injected markup stayed text: no extra script or img element exists in the live DOM.
    assert dom.count("<script") == 1 and "&lt;script&gt;alert(" in dom
    assert len(re.findall(r"<img ", dom)) == 6  # the six plots only (rewards, behaviour, optimisation, time, memory, scatter)


def test_screenshot_is_a_rendered_page(report: Path, tmp_path: Path):
    from PIL import Image

    shot = tmp_path / "page.png"
    result = chromium(
        ["--hide-scrollbars", "--window-size=1280,2400", f"--screenshot={shot}", report.as_uri()],
        tmp_path / "profile",
    )
    assert shot.exists(), result.stderr[-2000:]
    img = Image.open(shot).convert("RGB")
    assert img.size == (1280, 2400)
    # The dark header band is at the top, and the page below it is not blank (plots, tables).
    assert img.getpixel((640, 10)) == pytest.approx((0x1D, 0x23, 0x30), abs=3)
    colours = img.crop((0, 300, 1280, 2400)).resize((320, 525)).getcolors(maxcolors=100_000)
    assert colours is not None and len(colours) > 50
