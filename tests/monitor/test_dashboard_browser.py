"""The dashboard in headless Chromium (DevTools protocol over a pipe; see services/monitor/browser.py).

Needs the system's Chromium: `apt-get install -y --no-install-recommends chromium`. Skipped when
it is missing, so a laptop without it still runs the rest; `.ci/run` installs it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kairos.up import Cluster
from services.monitor.browser import Chromium, find_chromium
from tests.monitor.conftest import LoadInBackground, monitor_url

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240),
              pytest.mark.skipif(find_chromium() is None, reason="needs Chromium (apt-get install -y chromium)")]

UPDATES = "Number(document.getElementById('updated').dataset.updates)"
WORKERS = "[...document.querySelectorAll('#workers tbody tr[data-worker]')].map(r => r.dataset.worker)"
RECENT = "document.querySelectorAll('#recent tbody tr').length"
COMPLETED = "document.getElementById('window-note').textContent"


def test_dashboard_shows_the_cluster_and_follows_the_load(monitored_cluster: Cluster, tmp_path: Path) -> None:
    c = monitored_cluster
    with Chromium(width=1400, height=1000) as browser:
        browser.open(monitor_url(c) + "/")
        browser.wait_for(f"{UPDATES} > 0")
        workers = browser.wait_for(f"{WORKERS}.length === 4 && {WORKERS}")
        assert sorted(workers) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
        assert browser.evaluate(RECENT) == 0  # nothing sent yet
        assert browser.evaluate("document.getElementById('router').textContent").startswith("router ok")
        before = browser.evaluate(UPDATES)
        note_before = browser.evaluate(COMPLETED)

        with LoadInBackground(c.spec.api, clients=4) as load:
            # pushed by the event stream, not reloaded: the counter of renders keeps growing
            browser.wait_for(f"{UPDATES} >= {before + 3}", timeout=20)
            browser.wait_for(f"{RECENT} > 0", timeout=20)
            browser.wait_for("document.querySelector('#reasons tbody tr') !== null", timeout=20)
            browser.wait_for("document.querySelectorAll('#chart-ttft path').length > 0", timeout=20)
            time.sleep(1.5)
            shot = tmp_path / "dashboard.png"
            browser.screenshot(shot)
        assert load.sent > 0
        assert browser.evaluate(COMPLETED) != note_before
        kpi = browser.evaluate("document.getElementById('kpi-ttft').textContent")
        assert "ms" in kpi or " s" in kpi, kpi
        errors = browser.evaluate("document.getElementById('kpi-errors').textContent")
        assert errors == "0"
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
