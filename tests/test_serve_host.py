"""bench.serve_host, briefly: the server on its paced stand-in engine, each client, the ceiling and
the profile, so that the host-path benchmark keeps running (its numbers are not checked here)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("client, extra", [("raw", ["--ceiling", "--profile", "--top", "5"]), ("httpx", [])])
def test_serve_host_runs_briefly(tmp_path, client, extra):
    out = tmp_path / "levels.json"
    run = subprocess.run([sys.executable, "-m", "bench.serve_host", "--concurrency", "1", "3", "--rounds", "1",
                          "--min-requests", "2", "--step-ms", "1", "--client", client, "--json", str(out), *extra],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    levels = json.loads(out.read_text())["levels"]
    assert [(r["c"], r["requests"]) for r in levels] == [(1, 2), (3, 3)]
    for r in levels:
        assert 0 < r["of_engine"] <= 1.05 and r["steps_per_s"] > 0 and r["server_us_per_token"] > 0, r
    assert run.stdout.count("server   c") == 2
    if "--ceiling" in extra:
        assert run.stdout.count("ceiling  c") == 2 and "tottime" in run.stdout
