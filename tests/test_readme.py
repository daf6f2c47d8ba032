"""README's "How it works" against the tree: it names every module and no module that is gone, so it
cannot go stale; and the layers it describes import one way. The README's cheap commands, run: the two
commands CI runs, the serve flags table against `--help`, the `plan` examples, the quickstart's server and
curl, and what the editor snippets make their editors send to that server."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "src" / "autotp"


def how_it_works() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index("## How it works"):text.index("\n## ", text.index("## How it works") + 1)]


def test_how_it_works_names_every_module_and_only_those():
    section = how_it_works()
    folders = {m.group(1) for m in re.finditer(r"`(\w+)/`", section)}
    named: set[str] = set()
    folder = ""
    for line in section.splitlines():
        if top := re.match(r"- `(\w+)/`", line):
            folder = top.group(1) + "/"
        elif re.match(r"- ", line):
            folder = ""
        # engine/loop.py: a module of a subpackage; tests/ and benchmarks/ are not the package's
        named |= {folder + m for m in re.findall(r"`((?:\w+/)*\w+\.py)`", line)
                  if not m.startswith(("tests/", "benchmarks/"))}
    modules = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py") and "demo_model" not in p.parts}
    family_plans = {m for m in modules if m.startswith("plans/") and m not in named}  # "one table per family"
    assert folders == {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert named - modules == set(), "README names modules that do not exist"
    assert modules - named - family_plans == set(), "README does not name these modules"


def test_the_checkpoint_reader_depends_on_errors_and_slices_alone():
    code = ("import sys, autotp.loading.checkpoint\n"
            "print(sorted(m for m in sys.modules if m.startswith('autotp') or m == 'transformers'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert eval(out.stdout) == ["autotp", "autotp.errors", "autotp.loading", "autotp.loading.checkpoint",
                                "autotp.parallel", "autotp.parallel.slices"]


# --- the README's commands, run as a newcomer would (the cheap ones) ---

README = (ROOT / "README.md").read_text()
FIRST_SCREEN = README[:README.index("\n## ")]


def blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def test_the_first_two_commands_are_what_ci_runs():
    """The first screen's two commands, each a line that works on a fresh machine (a venv, the install, the run):
    the demo first, then the tests. .ci/run runs both; they must stay the same text."""
    ci = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")
    ci = re.sub(r" +", " ", ci)
    one, two = [line for block in blocks("bash", FIRST_SCREEN) for line in block.splitlines()
                if line.startswith("python3 -m venv .venv && ")]
    assert " generate --tp 4 " in one and two.endswith(" -m pytest -q")
    assert two in ci
    setup, _, demo = one.rpartition(" && ")
    assert "\n" + demo + "\n" in ci
    assert setup.replace(" -e .", ' -e ".[test]"') in ci  # CI installs command 2's superset, then runs the demo
    # no torchrun command: its fixed port 29500 collides with anyone else's torchrun; --tp picks a free one
    assert not [block for block in blocks("bash", FIRST_SCREEN) if "torchrun" in block]


def test_the_serve_flags_table_is_made_from_the_parser_and_matches_help():
    import readme_flags

    assert readme_flags.section(README) == readme_flags.table(), "run: .venv/bin/python tests/readme_flags.py"
    in_table = set(re.findall(r"`(--[a-z][a-z-]*)", readme_flags.section(README)))
    out = subprocess.run([sys.executable, "-m", "autotp", "serve", "--help"], capture_output=True, text=True,
                         timeout=60)
    entries = [re.split(r"\s{2,}", line.strip())[0] for line in out.stdout.splitlines() if line.startswith("  -")]
    in_help = {flag for entry in entries for flag in re.findall(r"(--[a-z][a-z-]*)", entry)} - {"--help"}
    assert in_table == in_help, (in_table ^ in_help)


def test_the_plan_examples_print_what_the_readme_shows():
    for block in blocks(""):
        if not block.startswith("$ .venv/bin/autotp plan"):
            continue
        command, *shown = block.splitlines()
        out = subprocess.run([sys.executable, "-m", "autotp", *command.split()[2:]], capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        printed = iter(out.stdout.splitlines())
        for line in shown:  # in order, "..." standing for lines left out
            if line.strip() != "...":
                assert line in printed, (command, line)


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory):
    """The first screen's server: `autotp serve --tp 2 --port 8000`, here on a free port."""
    from serve_harness import Server

    [command] = [line for block in blocks("bash", FIRST_SCREEN) for line in block.splitlines() if " serve " in line]
    assert command == ".venv/bin/autotp serve --tp 2 --port 8000"
    server = Server(None, tmp_path_factory.mktemp("readme") / "server.log", tp_flag=True)
    yield server
    server.kill()


def on(server, text: str) -> str:
    return text.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")


def post(url: str, body: dict, key: str | None = None) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.timeout(300)
def test_the_quickstart_curl_answers(readme_server):
    [command] = [c for c in blocks("bash", FIRST_SCREEN) if "curl" in c]
    command = on(readme_server, command[command.index("curl"):])
    if shutil.which("curl"):
        out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        answer = json.loads(out.stdout)
    else:  # the same request without curl
        body = json.loads(re.search(r"-d '(.*)'", command, re.S).group(1))
        code, raw = post(re.search(r"(http://\S+)", command).group(1), body)
        assert code == 200, raw
        answer = json.loads(raw)
    assert answer["model"] == "autotp-demo" and answer["usage"]["completion_tokens"] == 16


PREFIX, SUFFIX = "def add(a, b):\n    ", "\n    return c\n"


def events(raw: bytes) -> list[str]:
    return [line[len("data:"):].strip() for line in raw.decode().splitlines() if line.startswith("data:")]


@pytest.mark.timeout(300)
def test_the_editor_snippets_work_against_that_server(readme_server):
    """What Continue, Tabby and llm-vscode build from the README's settings, sent to the README's server: the model
    name, the address and the FIM tokens must be right as written (they once sent bigcode/starcoder: 404)."""
    import yaml

    continues = [yaml.safe_load(on(readme_server, b))["models"] for b in blocks("yaml")]
    assert len(continues) == 2  # the first screen's and the Editors section's
    for model in (m for models in continues for m in models):
        if model["provider"] == "openai":  # renders its template into `prompt`, POSTs {apiBase}/completions
            prompt = model["promptTemplates"]["autocomplete"].replace("{{{prefix}}}", PREFIX).replace(
                "{{{suffix}}}", SUFFIX)
            code, raw = post(model["apiBase"] + "/completions", {
                "model": model["model"], "prompt": prompt, "max_tokens": 24, "temperature": 0.01, "stream": True,
                "stop": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<|endoftext|>"]}, model["apiKey"])
            assert code == 200 and events(raw)[-1] == "[DONE]", (model["name"], raw[:300])
        else:  # huggingface-tgi: GET /info, then POST /generate_stream
            assert model["provider"] == "huggingface-tgi"
            with urllib_open(model["apiBase"] + "/info") as info:
                assert json.loads(info.read())["model_id"] == model["model"]
            code, raw = post(model["apiBase"] + "/generate_stream", {
                "inputs": f"<fim_prefix>{PREFIX}<fim_suffix>{SUFFIX}<fim_middle>",
                "parameters": {"max_new_tokens": 24, "temperature": 0.01}})
            assert code == 200 and json.loads(events(raw)[-1])["generated_text"] is not None, raw[:300]

    [tabby] = blocks("toml")
    settings = dict(re.findall(r'^(\w+) = "([^"]*)"', on(readme_server, tabby), re.M))
    assert settings["kind"] == "openai/completion"
    code, raw = post(settings["api_endpoint"] + "/completions", {
        "model": settings["model_name"], "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 24, "temperature": 0.1,
        "stream": True}, settings["api_key"])
    assert code == 200 and events(raw)[-1] == "[DONE]", raw[:300]

    [vscode] = [json.loads(on(readme_server, b)) for b in blocks("json") if "llm.backend" in b]
    fim = (vscode["llm.fillInTheMiddle.prefix"] + PREFIX + vscode["llm.fillInTheMiddle.suffix"] + SUFFIX
           + vscode["llm.fillInTheMiddle.middle"])
    code, raw = post(vscode["llm.url"], {"inputs": fim, **vscode["llm.requestBody"]})
    assert code == 200 and isinstance(json.loads(raw)["generated_text"], str), raw[:300]


def urllib_open(url: str):
    import urllib.request

    return urllib.request.urlopen(url, timeout=30)
