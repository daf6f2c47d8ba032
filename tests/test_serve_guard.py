"""`autotp serve` against hostile and careless clients: a key, small limits, slow reads, random requests.

One 2-rank server for the module, started with an API key, a 64 KiB body limit and a 2 s read timeout;
the last test kills its launcher with SIGKILL and checks that the ranks go too.
"""

import json
import os
import random
import re
import signal
import socket
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import fim_model
import openai
import pytest
from serve_harness import Server, alive

from autotp.serve.api.guard import host_name, host_policy

KEY = "test-key-123"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = fim_model.build(tmp_path_factory.mktemp("fim"))
    s = Server(model_dir, tmp_path_factory.mktemp("serve") / "server.log", "--max-body-bytes", "65536",
               "--read-timeout", "2", "--api-key", KEY, api_key=KEY)
    yield s
    s.kill()


def test_host_policy():
    assert host_policy("127.0.0.1", None) == host_policy("::1", None) == {"localhost", "127.0.0.1", "::1"}
    assert host_policy("0.0.0.0", None) is None and host_policy("example.test", None) is None
    assert host_policy("127.0.0.1", ["*"]) is None and host_policy("127.0.0.1", ["A.test"]) == {"a.test"}
    assert [host_name(h) for h in ("[::1]:80", "LocalHost:1", "x.test", "[::1]")] == ["::1", "localhost", "x.test",
                                                                                      "::1"]


def test_the_api_key_is_required_on_v1_only(server):
    assert server.client.completions.create(model=server.model_id, prompt="x", max_tokens=1).usage.completion_tokens
    for key in ("", "wrong", KEY + "x"):
        status, error = server.post({"model": server.model_id, "prompt": "x"}, Authorization=f"Bearer {key}")
        assert (status, error["error"]["code"]) == (401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert server.health() == {"status": "ok"}  # probes need no key


def test_the_routes_a_router_reads_need_the_key_too(server):
    """sglang-router sends its --api-key to every worker route it calls; without it they are 401 like /v1/*.
    POST /flush_cache comes with no body and no Content-Type, as the router sends it; other POSTs still need JSON."""
    def ask(method: str, path: str, key: str) -> int:
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        answer = server.raw((head + ("Content-Length: 0\r\n" if method == "POST" else "") + "\r\n").encode())
        return int(answer.split(b" ", 2)[1])

    routes = [("GET", p) for p in ("/server_info", "/get_server_info", "/model_info", "/get_model_info",
                                   "/get_load")] + [("POST", "/flush_cache")]
    assert [ask(m, p, "wrong") for m, p in routes] == [401] * len(routes)
    assert [ask(m, p, KEY) for m, p in routes] == [200] * len(routes)
    assert ask("POST", "/v1/completions", KEY) == 415


def test_a_declared_length_over_the_limit_is_413_before_the_body(server):
    answer = server.raw(("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         f"Authorization: Bearer {KEY}\r\nContent-Length: 65537\r\n\r\n").encode(), timeout=10)
    assert answer.startswith(b"HTTP/1.1 413 ") and b"limit of 65536 bytes" in answer, answer[:300]


def test_a_chunked_body_is_refused_once_it_grows_over_the_limit(server):
    chunk = b"x" * 4096
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   f"Authorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n\r\n").encode())
        try:
            for _ in range(20):  # 80 KiB
                s.sendall(b"1000\r\n" + chunk + b"\r\n")
        except OSError:  # the server closed the connection after answering
            pass
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:300]


def closed_for_the_read_timeout(server, conn: socket.socket) -> bool:
    """Whether the server's log says it closed `conn` because its request was not read within --read-timeout 2."""
    return f"closed a connection from {conn.getsockname()!r}: request not read within 2s" in server.text()


@pytest.mark.timeout(60)
def test_slow_clients_are_closed_after_the_read_timeout(server):
    """slowloris: connections that trickle headers (or send nothing) are closed for --read-timeout 2, the log naming
    each. Trickling does not extend the deadline: a connection it kept open would run this test into its timeout."""
    conns = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(5)]
    idle = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    for c in conns:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    trickling = set(range(len(conns)))
    while trickling:
        for i in sorted(trickling):
            try:
                conns[i].sendall(b"X-Slow: 1\r\n")
            except OSError:  # the server has closed it: the write after its close is reset
                trickling.discard(i)
        assert server.health() == {"status": "ok"}
        time.sleep(0.5)
    assert idle.recv(1) == b""  # closed too, having sent nothing
    for c in [*conns, idle]:
        assert closed_for_the_read_timeout(server, c), c.getsockname()
        c.close()


FUZZ_REQUESTS = 300
FUZZ_VALUES = {  # boundary values for every accepted parameter, valid and not
    "seed": [0, -1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -2**63, -2**63 - 1, 10**40, 1.5, "7", True, None],
    "temperature": [0, 0.0, -0.0, 1e-40, 5e-324, 9.99e-6, 1e-5, 0.5, 1, 2, 2.0000001, -1e-300, 1e308, "1", None],
    "top_p": [5e-324, 1e-300, 0.5, 1, 1.0000001, 0, -1, None],
    "max_tokens": [1, 2, 8, 60, 127, 128, 0, -1, 2**70, None],
    "stop": ["", "x", "\n", ["a", "b"], ["a"] * 5, [""], "\ud800", "é", 5, None],
    "suffix": ["", "x", "\ud800", "🙂" * 10, "\x00", None],
    "stream": [True, False, None],
    "prompt": ["x", "", [], ["a"], ["def f(x):"] * 3, ["a", "b"] * 10, "🙂", "\x00", "\ud800", "é" * 200, "x" * 7000,
               ["", "x"], [1, 2], "\u202e\ufeff\U0010ffff"],
}


def fuzz_body(rng: random.Random, i: int, model: str) -> bytes:
    if i % 3 == 0:  # a well-formed request between the odd ones
        return json.dumps({"model": model, "prompt": f"def f{i}(x):", "max_tokens": 4, "seed": i}).encode()
    body = {"model": model}
    for name, values in FUZZ_VALUES.items():
        if name == "prompt" or rng.random() < 0.5:
            body[name] = rng.choice(values)
    return json.dumps(body).encode()


def answer_of(server, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(server.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


ANSWERED = re.compile(r"^autotp serve: cmpl-\w+ status=(\d+) ", re.MULTILINE)  # one line per request answered


@pytest.mark.timeout(90)
def test_fuzz_every_request_is_answered_and_the_server_stays_healthy(server):
    rng = random.Random(10)
    bodies = [fuzz_body(rng, i, server.model_id) for i in range(FUZZ_REQUESTS)]
    before = len(ANSWERED.findall(server.text()))
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda b: answer_of(server, b), bodies))
    for body, (status, raw) in zip(bodies, answers, strict=True):
        if status == 200 and raw.startswith(b"data: "):  # a stream: no error event, and it is complete
            assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw, (body[:300], raw[-300:])
        elif status == 200:
            assert json.loads(raw)["choices"], body[:300]
        else:
            error = json.loads(raw)["error"]
            assert 400 <= status < 500 and set(error) == {"message", "type", "param", "code"}, (body[:300], raw)
    assert sum(s == 200 for s, _ in answers) >= FUZZ_REQUESTS // 3
    assert server.health() == {"status": "ok"}
    # the server logged each request as answered, with the status its client got (a stream logs its line once
    # its last event is sent: wait for them; the pytest timeout bounds the wait)
    while len(logged := ANSWERED.findall(server.text())[before:]) < FUZZ_REQUESTS:
        time.sleep(0.1)
    assert Counter(map(int, logged)) == Counter(s for s, _ in answers)


@pytest.mark.timeout(60)
def test_the_ranks_exit_when_the_launcher_is_killed(server):
    """SIGKILL cannot be forwarded by torchrun: each rank learns of it as its parent's death."""
    assert len(server.ranks) == 2 and all(alive(p) for p in server.ranks)
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while any(alive(p) for p in server.ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in server.ranks if alive(p)], server.text()[-2000:]
