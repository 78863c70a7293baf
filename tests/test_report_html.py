"""report.html renders in real headless Chromium (Debian's package): content present, scripts ran, no
console errors, no network fetches; the screenshot is kept in the test's temp dir."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest
from qualification.gates.mismatch import MismatchPanel
from runner_contracts import Evidence, GateResult, write_record
from test_contracts import PLAN

from runner.api import write_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0"]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    from runner_contracts import freeze_plan

    from runner.api import load_plan

    run = tmp_path / "run"
    write_record(run / "plan.json", freeze_plan(load_plan(PLAN)))
    evaluation = {"n": 48, "base_k": 28, "trained_k": 30, "base": "28/48", "trained": "30/48", "difference": 0.04,
                  "difference_ci": [-0.05, 0.13], "p_value": 0.69, "test": "exact McNemar (two-sided)",
                  "verdict": "inconclusive"}
    panel = MismatchPanel()  # the train stage's panel as audit_trace records it
    panel.add(1, [-1.0, -2.0], [-1.0, -2.0])
    panel.add(2, [-1.0 + math.log(1.2)], [-1.0])
    mismatch = msgspec.to_builtins(panel.summary())
    stages = {
        "probe": ([GateResult(name="probe:lock-match", passed=True, measured=0, threshold=0)], {}),
        "train": ([GateResult(name="trace:trained-equals-sampled", passed=True, measured=0, threshold=0),
                   GateResult(name="trace:logprob-agreement", passed=False, measured=0.02, threshold=0.001,
                              detail="max |trainer - sampling| <script>alert(1)</script>")],
                  {"reward_per_step": {"1": 0.25, "2": 0.5, "3": 0.625}, "episodes": 96, "trained_tokens": 2048,
                   "max_logprob_gap": 0.02, "groups": 24, "groups_with_variance": 17, "mismatch": mismatch}),
        "evaluate": ([GateResult(name="evaluate:heldout", passed=True, measured="inconclusive")],
                     {"heldout": evaluation}),
    }
    for stage, (gates, metrics) in stages.items():
        write_record(run / "stages" / stage / "evidence.json", Evidence(
            run_id="run", stack="trl", stage=stage, plan_id="x", status="passed" if all(g.passed for g in gates)
            else "failed", started_at="2026-11-30T03:00:00+00:00", finished_at="2026-11-30T03:00:09+00:00",
            gates=gates, metrics=metrics))
    write_report(run)
    return run


def test_report_html_is_self_contained(run_dir):
    page = (run_dir / "report.html").read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page), "the report must not fetch anything"
    assert "<script>alert(1)</script>" not in page, "gate details are escaped"
    assert "28/48" in page and "inconclusive" in page and "<svg" in page
    assert "Train-inference mismatch per training step" in page and "step 2: 1.200" in page
    summary = json.loads((run_dir / "summary.json").read_text())["mismatch"]
    assert summary["median_token_mult_prob_error"] == pytest.approx(1.1)  # median of 1.0 and 1.2
    assert summary["token_mult_prob_error_per_step"] == {"1": pytest.approx(1.0), "2": pytest.approx(1.2)}


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make test installs it)")
def test_report_html_renders_in_chromium(run_dir, tmp_path):
    url = (run_dir / "report.html").resolve().as_uri()
    profile = tmp_path / "profile"
    dom = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-ready="yes"' in dom.stdout, "the page's script did not run"
    assert "Held-out and retention success" in dom.stdout and "trace:logprob-agreement" in dom.stdout
    console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line]
    assert not console, console
    shot = tmp_path / "report.png"
    subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--window-size=1200,1800",
                    f"--screenshot={shot}", url], capture_output=True, timeout=120, check=True)
    assert shot.stat().st_size > 10_000


def test_provenance_names_the_checkout_the_families_and_the_chat_template(tmp_path):
    import hashlib

    from runner_contracts import freeze_plan

    from runner._provenance import provenance
    from runner.api import load_plan

    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "chat_template.jinja").write_text("{{ messages }}")
    plan = freeze_plan(load_plan(PLAN))
    plan = msgspec.structs.replace(plan, policy=msgspec.structs.replace(plan.policy, kind="path", path=str(policy)))
    found = provenance(plan)
    assert found.chat_template_sha256 == hashlib.sha256(b"{{ messages }}").hexdigest()
    assert set(found.task_families) == {"calc-tool", "german-arith"}
    if (Path(__file__).resolve().parents[1] / ".git").exists():
        assert len(found.git_commit) == 40 and isinstance(found.git_dirty, bool)
