"""README's "How it works" against the tree: it names every module and no module that is gone, so it
cannot go stale; and the layers it describes import one way. The README's commands, run: the two commands CI
runs, the serve flags table against `--help`, every sample output against what its command prints (the
`generate` ones at their tp in a slow test), the quickstart's server and curl, and what the editor snippets make
their editors send to that server."""

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
    """The fenced blocks in language `lang`, as text (fences, below, reads them)."""
    return ["\n".join(lines) + "\n" for language, lines in fences(text) if language == lang]


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


# --- the README's sample outputs against what their commands print ---

def fences(text: str = README) -> list[tuple[str, list[str]]]:
    """Every fenced block as (its language, its lines), read fence by fence: an opening fence names the language (or
    none), a closing fence is bare, and a block indented under a list item is dedented by its fence's indent. (A
    pattern from ``` to ``` cannot tell a closing fence from the next opening one: it read prose as blocks.)"""
    found, current = [], None
    for line in text.splitlines():
        stripped = line.lstrip()
        if current is None and stripped.startswith("```"):
            current = (stripped[3:].strip(), len(line) - len(stripped), [])
        elif current is not None and stripped == "```":
            found.append((current[0], current[2]))
            current = None
        elif current is not None:
            current[2].append(line[current[1]:])
    assert current is None, "a fence is left open"
    return found


def samples() -> list[tuple[str, list[str]]]:
    """The README's sample outputs: plain blocks that open with the command that printed them (`$ ...`, continued
    by trailing backslashes) -> (the command, the lines shown)."""
    found = []
    for language, lines in fences():
        if language or not lines[0].startswith("$ "):
            continue
        end = next(i for i, line in enumerate(lines) if not line.endswith("\\"))
        command = " ".join(line.removesuffix("\\").strip() for line in lines[:end + 1]).removeprefix("$ ")
        found.append((command, lines[end + 1:]))
    return found


def difference(shown: list[str], printed: list[str]) -> str | None:
    """None where `printed` is what the README shows: its lines in order, each run between lines "..." (any indent:
    lines left out) consecutive; without "..." at an end the output starts or ends there. Else what differs.
    Trailing spaces and trailing empty lines are not compared."""
    shown = [line.rstrip() for line in shown]
    printed = [line.rstrip() for line in printed]
    while printed and not printed[-1]:
        printed.pop()
    runs, run = [], []
    for line in shown:
        if line.strip() == "...":
            runs.append(run)
            run = []
        else:
            run.append(line)
    runs.append(run)
    at = 0
    for i, run in enumerate(runs):
        if not run:
            continue
        starts = [j for j in range(at, len(printed) - len(run) + 1) if printed[j:j + len(run)] == run]
        if not starts or (i == 0 and starts[0] != 0):  # where the run's first line is, the first line that differs
            begin = 0 if i == 0 else next((j for j in range(at, len(printed)) if printed[j] == run[0]), None)
            if begin is None:
                return f"not printed: {run[0]!r}"
            k = next(k for k in range(len(run)) if begin + k >= len(printed) or printed[begin + k] != run[k])
            return f"shown {run[k]!r}, printed {printed[begin + k] if begin + k < len(printed) else 'nothing'!r}"
        at = starts[0] + len(run)
    if runs[-1] and at != len(printed):
        return f"printed after the last line shown: {printed[at]!r}"
    return None


def autotp_argv(command: str) -> list[str]:
    """A sample's `.venv/bin/autotp ARGS` as argv for autotp.cli.main, ~ expanded."""
    import os
    import shlex

    program, *args = shlex.split(command)
    assert program == ".venv/bin/autotp", command
    return [os.path.expanduser(a) for a in args]


def test_every_plain_block_is_a_sample_or_another_tools_message():
    """A block of output names the command that printed it (`$ ...`), so a test can run it; the one other is
    DeepSpeed's error on StarCoder, whose numbers follow from StarCoder's config at mp_size 4: c_attn's
    n_embd + 2 * head_dim rows cut evenly, split as embed_dim / 4 query rows and one K/V head's 2 * head_dim."""
    others = [lines for language, lines in fences() if not language and not lines[0].startswith("$ ")]
    assert others == [["RuntimeError: split_with_sizes expects split_sizes to sum exactly to 1600 (input tensor's "
                        "size at dimension 2), but got split_sizes=[1536, 256]"]], others
    config = json.loads((ROOT / "examples" / "starcoder" / "config.json").read_text())
    head_dim = config["n_embd"] // config["n_head"]
    assert ((config["n_embd"] + 2 * head_dim) // 4, [config["n_embd"] // 4, 2 * head_dim]) == (1600, [1536, 256])
    kinds = {autotp_argv(command)[0] for command, _ in samples()}
    assert kinds == {"plan", "generate"}, kinds  # each kind is run below: a new one needs its test


def test_the_plan_samples_print_what_the_readme_shows(capsys):
    from test_cli import cli

    plans = [(c, shown) for c, shown in samples() if autotp_argv(c)[0] == "plan"]
    assert len(plans) == 5
    for command, shown in plans:
        code, out, err = cli(capsys, *autotp_argv(command))
        assert code == 0, err
        assert difference(shown, out.splitlines()) is None, (command, difference(shown, out.splitlines()))


def test_the_starcoder_sizes_per_rank_are_the_plans():
    """The table of StarCoder's bytes per rank, bf16 / int8 / int4 at tp 2 and 4: rank 0's total in each plan."""
    from autotp.report import format_report, plan_report

    table = README[README.index("| StarCoder 15.5B, per rank |"):].split("\n\n")[0].splitlines()[2:]
    for row in table:
        tp, *sizes = [cell.strip() for cell in row.strip("|").split("|")]
        for quantize, size in zip((None, "int8", "int4"), sizes, strict=True):
            report = format_report(plan_report(str(ROOT / "examples" / "starcoder"), int(tp.removeprefix("tp ")),
                                               quantize=quantize))
            rank_0 = next(line for line in report.splitlines() if line.startswith("rank 0:"))
            assert f", {size}, KV cache " in rank_0, (row, quantize, rank_0)


def test_the_first_screens_sample_is_what_one_process_prints(capsys):
    """The demo's sample is --tp 4's, which its README text says is tp 1's too: here at tp 1, in this process
    (the exact command, 4 ranks, is the slow test below)."""
    from test_cli import cli

    [(command, shown)] = [(c, shown) for c, shown in samples() if c in FIRST_SCREEN]
    argv = autotp_argv(command)
    assert argv[:3] == ["generate", "--tp", "4"]
    code, out, err = cli(capsys, "generate", *argv[3:])
    assert code == 0, err
    assert difference(shown, out.splitlines()) is None, difference(shown, out.splitlines())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_generate_samples_print_what_the_readme_shows():
    """Each `autotp generate` sample as written: the demo at tp 4, SmolLM2-135M at tp 3 (tests/real_model.py makes
    it once, as the README's command before the sample does)."""
    import real_model

    for command, shown in [(c, shown) for c, shown in samples() if autotp_argv(c)[0] == "generate"]:
        argv = [str(real_model.smollm2()) if a.endswith("/autotp-tests/smollm2-135m-instruct-f32") else a
                for a in autotp_argv(command)]
        out = subprocess.run([sys.executable, "-m", "autotp", *argv], capture_output=True, text=True, timeout=600,
                             cwd=ROOT)
        assert out.returncode == 0, out.stderr
        assert difference(shown, out.stdout.splitlines()) is None, (command, difference(shown, out.stdout.splitlines()))


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

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key is not None else {})}
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
    """What Continue, Tabby, llm-vscode, llama.vim and llama.vscode build from the README's settings, sent to the
    README's server: the model name, the address and the FIM tokens must be right as written (they once sent
    bigcode/starcoder: 404), and Continue's max tokens, 4096 where the settings give none (the fit rule: a 400 once)."""
    import yaml

    continues = [yaml.safe_load(on(readme_server, b))["models"] for b in blocks("yaml")]
    assert len(continues) == 2  # the first screen's and the Editors section's
    for model in (m for models in continues for m in models):
        if model["provider"] == "openai":  # renders its template into `prompt`, POSTs {apiBase}/completions
            prompt = model["promptTemplates"]["autocomplete"].replace("{{{prefix}}}", PREFIX).replace(
                "{{{suffix}}}", SUFFIX)
            for tokens in (model["defaultCompletionOptions"]["maxTokens"], 4096):
                code, raw = post(model["apiBase"] + "/completions", {
                    "model": model["model"], "prompt": prompt, "max_tokens": tokens, "temperature": 0.01,
                    "stream": True, "stop": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<|endoftext|>"]},
                    model["apiKey"])
                assert code == 200 and events(raw)[-1] == "[DONE]", (model["name"], tokens, raw[:300])
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

    recorded = json.loads((ROOT / "tests" / "fixtures" / "llama_vim_requests.json").read_text())["requests"]
    [vim] = blocks("vim")
    endpoint = re.search(r"'endpoint_fim': '([^']+)'", on(readme_server, vim)).group(1)
    for sent in (recorded[0], recorded[2]):  # a prepare request, then a completion, with llama.vim's empty key
        code, raw = post(endpoint, json.loads(sent["body"]), key=re.search(r"'api_key': '([^']*)'", vim).group(1))
        assert code == 200 and raw.decode().startswith("{"), raw[:300]
    [llama_vscode] = [json.loads(on(readme_server, b)) for b in blocks("json") if "llama-vscode.endpoint" in b]
    sent = json.loads((ROOT / "tests" / "fixtures" / "llama_vscode_requests.json").read_text())["requests"][1]
    code, raw = post(llama_vscode["llama-vscode.endpoint"] + "/infill", json.loads(sent["body"]),
                     key=llama_vscode["llama-vscode.api_key"])
    assert code == 200 and len(json.loads(raw)) == 3, raw[:300]


def urllib_open(url: str):
    import urllib.request

    return urllib.request.urlopen(url, timeout=30)


# what a reader cannot open: a tracker's number ("issue 26", "issue-26") or the session that wrote it; other projects'
# trackers ("pytorch issue 194167") are theirs to cite
CITED = re.compile(r"(?<!pytorch )(?<!FlashAttention )\bissues? \d+|\bissue-\d+|\bsessions?\b|\blent\b")


def test_the_readme_and_the_results_speak_of_the_project_alone():
    """No "issue 26" a reader cannot open, no session that wrote it: a figure names its benchmark or results run,
    and a run's label says what the work was, in RESULTS.md's quotes and in the results file alike ("issue 33:
    prefix sweep at 41bf72d" stood in both once)."""
    for path in (ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md"):
        cited = CITED.findall(" ".join(path.read_text().split()))  # a label may wrap over two lines
        assert cited == [], (path.name, cited)
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        results = json.loads(path.read_text())
        runs = results.get("runs", {}) if isinstance(results, dict) else {}
        assert [label for label in runs if CITED.search(label)] == [], path.name


def test_a_cited_issue_is_found_in_text_and_in_a_label():
    """The check can fail: a quoted label wrapped over two lines, and a bare number, are both found."""
    text = 'runs "issue\n38: one group" and issue 53\'s figures; pytorch issue 194167 is pytorch\'s'
    assert CITED.findall(" ".join(text.split())) == ["issue 38", "issue 53"]


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation other than - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_within_the_readme_lands_on_a_heading():
    """The contents and the cross-references (`[...](#anchor)`) name headings that exist, so that moving or renaming
    a section cannot leave a link that goes nowhere."""
    headings, fenced = [], False
    for line in README.splitlines():
        fenced ^= line.lstrip().startswith("```")  # a `# comment` in a bash block is no heading
        if not fenced and (m := re.match(r"#{1,4} (.+)$", line)):
            headings.append(m.group(1))
    anchors = {slug(heading) for heading in headings}
    links = set(re.findall(r"\]\(#([^)]+)\)", README))
    assert links - anchors == set(), sorted(links - anchors)
    assert slug("`autotp serve`'s flags") == "autotp-serves-flags"  # what GitHub makes of one
