"""The flow-run page as a person sees it: a real `prefect server start`, the flow run on a slice of the example,
and the artifact pages rendered by headless Chromium. Screenshots of every page land in the test's tmp folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from browser_helpers import CHROMIUM, Browser
from test_deployment import REPO_ROOT, Stack

pytestmark = [pytest.mark.browser, pytest.mark.slow,
              pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (.ci/run installs it)")]

RUN_FLOW = """
import json, sys
from pathlib import Path
from common.flows import fast_config
from flows.retrain import retrain_drafter
state = retrain_drafter(config=fast_config(Path(sys.argv[1])), run_name="browser", data_source=sys.argv[2],
                        return_state=True)
print(json.dumps({"flow_run_id": str(state.state_details.flow_run_id), "state": state.type.value}))
"""

# Every picture on the page, with whether it decoded: a broken data: URI loads with naturalWidth 0.
PICTURES = """(() => {
  const imgs = [...document.querySelectorAll('img')].filter(i => i.src.startsWith('data:image/png;base64,'));
  if (!document.body) return {text: '', images: []};
  return {text: document.body.innerText, images: imgs.map(i => ({alt: i.alt, complete: i.complete,
          width: i.naturalWidth, height: i.naturalHeight, shown: Math.round(i.getBoundingClientRect().width)}))};
})()"""

CLICK_TAB = """const tab = [...document.querySelectorAll('button, a, li, [role=tab]')]
  .find(e => e.textContent.trim() === 'Artifacts'); if (tab) tab.click(); return !!tab;"""


@pytest.fixture
def served_run(tmp_path, example_assets):
    """A real server on loopback holding one completed flow run (a 300-record slice, 4 optimizer steps)."""
    data = tmp_path / "slice.jsonl"
    data.write_text("".join(line + "\n" for line in Path(example_assets.data).read_text().splitlines()[:300]))
    stack = Stack(tmp_path / "prefect-home")
    stack.start("server", "server", "start", "--host", "127.0.0.1", "--port", str(stack.port))
    try:
        stack.wait_healthy()
        env = {**stack.env, "PYTHONPATH": f"{REPO_ROOT}:{REPO_ROOT / 'tests'}"}
        ran = subprocess.run([sys.executable, "-c", RUN_FLOW, str(tmp_path / "store"), str(data)], env=env,
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
        assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
        run = json.loads(ran.stdout.strip().splitlines()[-1])
        artifacts = stack.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run["flow_run_id"]]}}})
        yield stack, run, {a["key"]: a["id"] for a in artifacts if a["key"]}, tmp_path / "store"
    finally:
        stack.close()


@pytest.fixture
def browser(tmp_path):
    browser = Browser(tmp_path / "chromium-profile")
    try:
        yield browser
    finally:
        browser.close()


def test_artifact_pages_render_pictures_and_verdict(served_run, browser, tmp_path):
    stack, run, keys, store = served_run
    verdict = json.loads((store / "runs" / "browser" / "report" / "report.json").read_text())["verdict"]
    ui = stack.api.removesuffix("/api")
    expected = {  # key -> (text the page must show, inline pictures it must hold)
        "stability-report": (f"Stability check: {verdict.upper()}", 1),
        "batch-interleaving": ("Batch plan", 1),
        "training-live": ("ETA", 1),
        "run-summary": (f"Stability: {verdict.upper()}", 1),
    }
    for key, (text, count) in expected.items():
        browser.goto(f"{ui}/artifacts/artifact/{keys[key]}")
        try:
            page = browser.wait_for(f"(() => {{ const p = {PICTURES}; return p.images.length >= {count} && "
                                    "p.images.every(i => i.complete) && p.text.includes("
                                    f"{json.dumps(text)}) ? p : null; }})()", timeout=90)
        finally:
            shot = browser.screenshot(tmp_path / f"{key}.png")
        assert page, f"{key}: no {count} decoded picture(s) and {text!r} on the page; see {shot}"
        for image in page["images"]:
            assert image["width"] > 0 and image["height"] > 0 and image["shown"] > 0, f"{key}: {image}; see {shot}"
        assert "file://" not in page["text"], f"{key}: a link that only works on the worker; see {shot}"

    # The run's page, Artifacts tab: every artifact listed with its key.
    browser.goto(f"{ui}/runs/flow-run/{run['flow_run_id']}")
    try:
        browser.wait_for(f"!!document.body && (() => {{ {CLICK_TAB} }})()", timeout=90)
        listed = browser.wait_for(f"!!document.body && {json.dumps(sorted(expected))}"
                                  ".every(k => document.body.innerText.includes(k))", timeout=90)
    finally:
        shot = browser.screenshot(tmp_path / "flow-run.png")
    assert listed, f"the flow run's Artifacts tab does not list {sorted(expected)}; see {shot}"
