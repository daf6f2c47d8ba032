"""`autotp serve` inside the test's process at tp 1: the HTTP app (api/http.py) in uvicorn's thread and the engine in
another, over fim_model's tiny GPT-BigCode (StarCoder's FIM tokens, a chat template). Requests take the server's own
path from the socket to the model and back, without a launcher, a second interpreter or a process group: a module's
server costs its model's build, not a server's start-up. The test can reach inside (the model, the engine) to make
one request fail, and reads what the server logs with capfd."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

import fim_model
from engine_driver import engine_for

from autotp.serve.api import router_api
from autotp.serve.api.boundary import Served
from autotp.serve.api.guard import host_policy
from autotp.serve.api.http import Frontend, HttpThread, build_app
from autotp.serve.api.metrics import Metrics
from autotp.serve.engine.scheduler import Limits
from autotp.serve.preflight import listen

LIMITS = Limits(8, 256, 4096)  # sequences, tokens per step, KV slots


class InProcess:
    """Serves on 127.0.0.1 (a free port) until `close`; `url` as serve_harness.Server's, for its `metrics`."""

    def __init__(self, directory: Path, context: int = 128):
        from transformers import AutoTokenizer

        import autotp

        model_dir = fim_model.build(directory, n_positions=context, chat_template=fim_model.CHAT_TEMPLATE)
        self.model = autotp.from_pretrained(model_dir, check_inputs=False)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.engine = engine_for(self.model, tokenizer, LIMITS)
        frontend = Frontend(Metrics(self.engine.load))
        self.model_id = Path(model_dir).name
        served = Served(self.model_id, tokenizer, context, int(time.time()), LIMITS.kv_tokens, len(tokenizer))
        facts = router_api.Facts(model_dir, model_dir, "gpt_bigcode", ("GPTBigCodeForCausalLM",), 1, 1,
                                 LIMITS.max_num_seqs, LIMITS.max_num_batched_tokens)
        app = build_app(served, self.engine, frontend, 2**20, host_policy("127.0.0.1", None), None, facts)
        sock = listen("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = HttpThread(app, sock, read_timeout=10)
        self.http.start()
        self.steps = threading.Thread(target=self.engine.run, args=(frontend.deliver,), daemon=True)
        self.steps.start()

    def post(self, path: str, raw: bytes) -> tuple[int, bytes]:
        """The body sent as it is (JSON the openai client cannot write: NaN), the status and the whole answer;
        http.client raises IncompleteRead where a chunked answer ends without its last chunk."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            connection.request("POST", path, raw, {"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def close(self) -> None:
        self.engine.stopping.set()
        self.steps.join(timeout=30)
        self.http.stop()


def events(answer: bytes) -> list[dict | str]:
    """A server-sent event stream's data, each JSON decoded ([DONE] as the string)."""
    out = []
    for block in answer.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
