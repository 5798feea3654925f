"""The report rendered by a real browser (headless Chromium): the trajectory viewer's elements exist
after the page's own script ran, the filter hides what it should, nothing injected executes, and every plot
(the health panel included, also in the report `sleuth demo --fast` writes) decodes to an image.

Needs a chromium binary (Debian: `apt-get install -y chromium`); skipped, with that reason, without one.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sleuth.eval.report import build_report  # noqa: E402
from test_eval_report import ANSWERS, write_eval_dir  # noqa: E402
from test_eval_report_health import EVENTS, _healthy_run  # noqa: E402

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
    _healthy_run(run / "train", EVENTS)  # health metrics, guard thresholds and two guard events
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
    plots = re.findall(r'<img class="plot" data-plot="(\w+)"', dom)  # the plots only
    assert plots == ["rewards", "behaviour", "optimisation", "health", "time", "memory", "scatter"]
    assert len(re.findall(r"<img ", dom)) == len(plots)


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


# Appended to a copy of a report: once the page has loaded, each plot records whether Chromium decoded it
# (naturalWidth x naturalHeight, or "no"), so --dump-dom shows what was drawn, not only what was written.
RENDER_PROBE = """<script>window.addEventListener("load", function () {
  document.querySelectorAll("img.plot").forEach(function (img) {
    img.dataset.rendered = img.complete && img.naturalWidth > 0 ? img.naturalWidth + "x" + img.naturalHeight : "no";
  });
});</script>"""


def rendered_plots(report: Path, tmp_path: Path) -> dict[tuple[str, str], str]:
    """(plot name, img alt) -> what Chromium decoded: "WxH" or "no"."""
    probed = tmp_path / "probed.html"
    html = report.read_text()
    assert html.count("</body>") == 1
    probed.write_text(html.replace("</body>", RENDER_PROBE + "</body>"))
    result = chromium(["--dump-dom", probed.as_uri()], tmp_path / "profile")
    assert result.returncode == 0 and "<html" in result.stdout, result.stderr[-2000:]
    imgs = re.findall(
        r'<img class="plot" data-plot="(\w+)" alt="([^"]*)" src="[^"]*" data-rendered="([^"]*)"',
        result.stdout,
    )
    assert len(imgs) == result.stdout.count('<img class="plot"'), "a plot the probe did not reach"
    return {(name, alt): size for name, alt, size in imgs}


def _decoded(size: str) -> bool:
    return bool(re.fullmatch(r"[1-9]\d*x[1-9]\d*", size))


def test_every_plot_decodes_in_the_browser(report: Path, tmp_path: Path):
    plots = rendered_plots(report, tmp_path)
    assert [name for name, _ in plots] == [
        "rewards",
        "behaviour",
        "optimisation",
        "health",
        "time",
        "memory",
        "scatter",
    ]
    assert all(_decoded(size) for size in plots.values()), plots
    # the check can fail: a health panel whose PNG is corrupt is reported as not drawn
    broken = tmp_path / "broken" / "report.html"
    broken.parent.mkdir()
    broken.write_text(
        re.sub(r'(data-plot="health"[^>]*src="data:image/png;base64,)', r"\1AAAA", report.read_text())
    )
    assert rendered_plots(broken, tmp_path / "broken")[("health", "health plot for train")] == "no"


@pytest.fixture(scope="module")
def demo_report(fast_demo_run: tuple[Path, dict]) -> Path:
    """The report of `sleuth demo --fast` (the run tests/test_demo.py checks; tests/conftest.py runs it once)."""
    out, demo = fast_demo_run
    assert demo["returncode"] == 0, demo["stdout"][-2000:] + demo["stderr"][-2000:]
    return out / "report.html"


def test_demo_report_draws_the_health_panel(demo_report: Path, tmp_path: Path):
    plots = rendered_plots(demo_report, tmp_path)
    # the RL run (train/) has its health panel, drawn; the SFT run before it has none
    assert _decoded(plots[("health", "health plot for train")]), plots
    assert [alt for name, alt in plots if name == "health"] == ["health plot for train"]
    assert all(_decoded(size) for size in plots.values()), plots
    # the panel's guard thresholds are the recipe's (run.json), which the demo leaves at the defaults
    guards = json.loads((demo_report.parent / "train" / "run.json").read_text())["recipe"]["trainer"][
        "guards"
    ]
    assert {g["name"] for g in guards} >= {"entropy_collapse", "stopped_searching"}
    html = demo_report.read_text()
    verdicts = re.findall(r"<h3>([^<]*)</h3>.*?<p class=\"verdict\">Health: ([^<]*)</p>", html, flags=re.S)
    assert [(label, v.split(" (")[0]) for label, v in verdicts] == [
        ("train", "too few steps to judge"),
        ("train/sft", "no RL steps"),
    ]  # 2 RL steps, guards needing 5

    # the health panel alone, as Chromium paints it: not blank
    from PIL import Image

    uri = re.search(r'data-plot="health" alt="health plot for train" src="([^"]+)"', html).group(1)
    page = tmp_path / "health.html"
    page.write_text(f'<html><body style="margin:0"><img src="{uri}"></body></html>')
    shot = tmp_path / "health.png"
    result = chromium(
        ["--hide-scrollbars", "--window-size=990,1050", f"--screenshot={shot}", page.as_uri()],
        tmp_path / "profile",
    )
    assert shot.exists(), result.stderr[-2000:]
    colours = Image.open(shot).convert("RGB").getcolors(maxcolors=1_000_000)
    assert colours is not None and len(colours) > 50
