"""The stand-in hub fools the real huggingface_hub client: a download through it is byte-identical, lands in the
cache where offline mode finds it, and an unknown repo is a RepositoryNotFoundError. The client runs in a
subprocess because huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE when it is imported."""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from standin_hub import StandinHub

DEMO = Path(__file__).parents[1] / "src" / "autotp" / "demo_model"
PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model"]  # autotp.hub.WEIGHT_FILES
CLIENT = """
import json, sys
from huggingface_hub import hf_hub_download, snapshot_download
offline, patterns = sys.argv[1] == "offline", json.loads(sys.argv[2])
out = {"snapshot": snapshot_download("org/demo", allow_patterns=patterns, local_files_only=offline),
       "config": hf_hub_download("org/demo", "config.json", local_files_only=offline)}
if not offline:
    try:
        snapshot_download("org/missing", allow_patterns=["config.json"])
    except Exception as e:
        out["missing"] = type(e).__name__
print(json.dumps(out))
"""


def client(hub: StandinHub, hf_home: Path, mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(hf_home), HF_HUB_DISABLE_PROGRESS_BARS="1")
    if mode == "offline":
        env["HF_HUB_OFFLINE"] = "1"
    argv = [sys.executable, "-c", CLIENT, mode, json.dumps(PATTERNS)]
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def test_download_then_offline(tmp_path):
    with StandinHub({"org/demo": DEMO}) as hub:
        online = client(hub, tmp_path, "online")
        served = len(hub.requests)
        offline = client(hub, tmp_path, "offline")
        assert len(hub.requests) == served, hub.requests[served:]  # offline: not a single request
    expected = sorted(p.name for p in DEMO.iterdir() if p.suffix in (".json", ".safetensors", ".txt", ".model"))
    snapshot = Path(online["snapshot"])
    assert sorted(p.name for p in snapshot.iterdir()) == expected
    for name in expected:
        assert (snapshot / name).read_bytes() == (DEMO / name).read_bytes(), name
    assert Path(online["config"]) == snapshot / "config.json"
    assert online["missing"] == "RepositoryNotFoundError"
    assert offline == {"snapshot": online["snapshot"], "config": online["config"]}
    # each file body was sent once: hf_hub_download of config.json found it in the cache after its HEAD
    gets = [r for r in hub.requests if r.startswith("GET /org/demo/resolve/")]
    assert sorted(r.rsplit("/", 1)[1] for r in gets) == expected


def test_script_delay_and_failure(tmp_path):
    script = Path(__file__).with_name("standin_hub.py")
    proc = subprocess.Popen([sys.executable, str(script), "--repo", f"org/demo={DEMO}", "--delay", "1"],
                            stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        with urllib.request.urlopen(f"{url}/api/models/org/demo", timeout=10) as r:
            sha = json.load(r)["sha"]
        start = time.monotonic()
        with urllib.request.urlopen(f"{url}/org/demo/resolve/{sha}/config.json", timeout=10) as r:
            assert r.headers["X-Repo-Commit"] == sha and r.headers["ETag"].startswith('"')
            assert r.read() == (DEMO / "config.json").read_bytes()
        assert time.monotonic() - start >= 1.0
    finally:
        proc.kill()
        proc.wait(timeout=10)
    with StandinHub({"org/demo": DEMO}, fail_status=503) as hub, pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{hub.url}/api/models/org/demo", timeout=10)
    assert e.value.code == 503
