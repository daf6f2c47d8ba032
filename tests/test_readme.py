"""README's "How it works" against the tree: it names every module and no module that is gone, so it
cannot go stale; and the layers it describes import one way."""

import re
import subprocess
import sys
from pathlib import Path

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
        named |= {folder + m for m in re.findall(r"`(\w+\.py)`", line)}
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
