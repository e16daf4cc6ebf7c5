"""Every ```python block of README.md and docs/*.md runs as written, assertions included, on the CPU.

Blocks of one file share a namespace and run in order, as a reader runs them. A block preceded by
``<!-- skip: REASON -->`` (it needs CUDA, or several processes) is reported as skipped with that
reason; other fences (bash, text) are not run. The README's form is checked too: its lines fit 100
columns outside tables and code, its links to docs/ resolve, and its test command is CI's.
"""

import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# A fenced block, with the comment that may precede it (blank lines between are allowed).
FENCE = re.compile(r"(?:<!--\s*skip:\s*(?P<skip>.*?)\s*-->\s*\n)?^```(?P<lang>[\w-]*)\n(?P<code>.*?)^```",
                   re.S | re.M)


def _name(page: pathlib.Path) -> str:
    return page.relative_to(ROOT).as_posix()


def python_blocks(page: pathlib.Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, skip reason or None)`` of each python block of a page, in order."""
    text = page.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start("code")) + 1, m["code"], m["skip"])
            for m in FENCE.finditer(text) if m["lang"] == "python"]


BLOCKS = [(page, i) for page in PAGES for i in range(len(python_blocks(page)))]


class _Namespaces:
    """One namespace per page, holding the blocks run so far (in order)."""

    def __init__(self):
        self.state: dict[pathlib.Path, tuple[int, dict]] = {}

    def before(self, page: pathlib.Path, index: int) -> dict:
        """The namespace after every runnable block of ``page`` before block ``index``."""
        done, namespace = self.state.get(page, (0, {}))
        if done > index:  # run out of order (-k, a rerun): start again
            done, namespace = 0, {}
        for line, code, skip in python_blocks(page)[done:index]:
            if skip is None:
                try:
                    exec(compile(code, f"{page}:{line}", "exec"), namespace)
                except Exception as e:
                    self.state.pop(page, None)
                    pytest.fail(f"an earlier block of {_name(page)} (line {line}) failed: {e!r}")
        self.state[page] = (index, namespace)
        return namespace

    def ran(self, page: pathlib.Path, index: int, namespace: dict) -> None:
        self.state[page] = (index + 1, namespace)


NAMESPACES = _Namespaces()


@pytest.mark.parametrize("page,index", BLOCKS, ids=[f"{_name(p)}#{i + 1}" for p, i in BLOCKS])
def test_python_block_runs(page, index):
    line, code, skip = python_blocks(page)[index]
    if skip is not None:
        pytest.skip(f"{_name(page)}:{line}: {skip}")
    namespace = NAMESPACES.before(page, index)
    exec(compile(code, f"{page}:{line}", "exec"), namespace)
    NAMESPACES.ran(page, index, namespace)


def test_every_page_is_collected():
    # A page with no python block is fine; the pages themselves must be the ones on disk.
    assert README in PAGES and len(PAGES) >= 2
    assert {_name(p) for p in PAGES} >= {"README.md", "docs/semantics.md", "docs/bench.md", "docs/models.md",
                                         "docs/performance.md", "docs/development.md"}


def test_skip_comments_say_why():
    for page in PAGES:
        for line, _code, skip in python_blocks(page):
            if skip is not None:
                assert re.search(r"needs (CUDA|a process group|several processes|vLLM)", skip), (
                    f"{_name(page)}:{line}: a skipped block says what it needs: {skip!r}")


def test_drop_in_example_runs():
    """The README's first example: a non-trivial gain, so that its bitwise assertion against the
    reference class would see a wrong cast order (with a gain of ones both orders agree)."""
    page_blocks = python_blocks(README)
    line, code, skip = page_blocks[0]
    assert skip is None and "reference_norm = " in code  # every name it uses is defined in it
    namespace: dict = {}
    exec(compile(code, f"{README}:{line}", "exec"), namespace)
    torch = namespace["torch"]
    x, residual, norm = namespace["x"], namespace["residual"], namespace["norm"]
    assert x.shape == residual.shape == (8, 1, 7168) and norm.weight.shape == (7168,)
    weight = namespace["reference_norm"].weight
    assert torch.equal(norm.weight, weight) and not torch.equal(weight, torch.ones_like(weight))
    # The same gain rounded before the multiply (Hugging Face's order) gives other bits here.
    with torch.no_grad():
        hf_order = namespace["dsnorm"].rms_norm(x, norm.weight, cast="hf")
        assert not torch.equal(hf_order, namespace["reference_norm"](x))


def _lines_outside_code_and_tables(page: pathlib.Path):
    in_code = False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if not in_code and not line.startswith("|"):
            yield number, line


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_lines_fit_100_columns(page):
    long = [(n, len(line)) for n, line in _lines_outside_code_and_tables(page) if len(line) > 100]
    assert not long, f"{_name(page)}: lines over 100 characters (line, length): {long}"


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= 250, f"README has {lines} lines: details belong in docs/"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_local_links_resolve(page):
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)  # code, such as kernel[grid](...), holds no links
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.is_file(), f"{_name(page)} links to {target}, which does not exist"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file), f"{_name(page)} links to {target}: no such heading"


def _anchors(page: pathlib.Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    headings = re.findall(r"^#+ (.*)$", FENCE.sub("", page.read_text(encoding="utf-8")), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def _readme_commands() -> list[str]:
    text = README.read_text(encoding="utf-8").split("## Set-up", 1)[1]
    block = re.search(r"```bash\n(.*?)```", text, flags=re.S)[1]
    joined = block.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_the_readme_test_command():
    """.ci/run installs what set-up command 2 installs and runs its pytest line, word for word."""
    first, second = _readme_commands()
    pytest_line = [part.strip() for part in second.split("&&") if "pytest" in part]
    assert len(pytest_line) == 1, second
    ci_run = ROOT / ".ci" / "run"
    if not ci_run.is_file():
        pytest.skip("no .ci/run here: the sdist ships the tests, not the repository's CI script")
    ci = ci_run.read_text(encoding="utf-8").splitlines()
    assert pytest_line[0] in [line.strip() for line in ci], f".ci/run does not run {pytest_line[0]!r}"
    ci_installs = [shlex.split(line)[-1] for line in ci if "pip install" in line]
    assert "torch==2.13.0" in ci_installs and "torch==2.13.0" in first
    assert "-e" in second and "'.[test]'" in second and ".[test]" in ci_installs


def test_first_command_installs_the_bench_extra_and_runs_the_bench():
    first, _second = _readme_commands()
    steps = [part.strip() for part in first.split("&&")]
    assert "pip install torch==2.13.0" in steps  # the CPU build first: a bare torch pulls CUDA
    assert "pip install -e '.[bench]'" in steps and steps[-1].startswith("dsnorm bench")
    assert "[test]" not in first


def test_manifest_ships_the_docs():
    assert "graft docs" in (ROOT / "MANIFEST.in").read_text(encoding="utf-8").splitlines()
