"""The documentation's links and commands still point at something: every relative link and #anchor in the
repository's Markdown resolves (GitHub's anchor rules), and every command quoted in the README and docs/ that runs
a numbered script (or the preflight, or an sbatch file) names a script that exists and passes only flags that
script's argparse defines. Nothing is started: the flags are read from the scripts with ast."""
import ast
import json
import re
import shlex
import subprocess
from functools import cache
from urllib.parse import unquote

import pytest
from helpers import REPO
from markdown_it import MarkdownIt

PARSER = MarkdownIt("commonmark").enable("table")
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:|^//", re.IGNORECASE)  # http:, https:, mailto:, protocol-relative
HTML_LINK = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
HTML_ANCHOR = re.compile(r"""\b(?:id|name)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
LINE_ANCHOR = re.compile(r"L\d+(?:C\d+)?(?:-L\d+(?:C\d+)?)?")  # GitHub's anchors into a source file's lines
SCRIPT = re.compile(r"(?:^|/)(?:\d\d[a-z]?_\w+|preflight)\.py$")  # a numbered script, or the preflight
SBATCH = re.compile(r"(?:^|/)slurm/[\w.-]+\.sbatch$")
OPERATORS = {"|", "||", "&", "&&", ";", ";;", "(", ")", ">", ">>", "<", ">&", "<&", "|&"}


def markdown_files():
    """Every Markdown file of the repository: tracked, or new and not ignored (so a page is checked before it is
    committed, and an ignored download is not)."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", "*.md"],
                                cwd=REPO, capture_output=True, text=True, check=True).stdout.split("\0")
        files = {REPO / name for name in listed if name}
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every .md outside hidden folders
        files = {path for path in REPO.rglob("*.md")
                 if not any(part.startswith(".") for part in path.relative_to(REPO).parts)}
    return sorted(path for path in files if path.is_file())


def without_front_matter(text):
    """A lesson source starts with jupytext's YAML header between two `---` lines; blank it out (line numbers
    kept), or it would read as a heading."""
    if text.startswith("---\n"):
        end = text.find("\n---\n", 4)
        if end != -1:
            return "\n" * text[:end + 5].count("\n") + text[end + 5:]
    return text


@cache
def tokens(path):
    return PARSER.parse(without_front_matter(path.read_text(encoding="utf-8")))


def slug(text):
    """GitHub's heading anchor: lowercase, punctuation dropped except hyphens and spaces, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def heading_anchors(stream):
    """The anchors of the headings in a token stream, a repeated heading getting -1, -2, ... as on GitHub, plus
    any explicit HTML id or name."""
    anchors, seen = set(), {}
    for index, token in enumerate(stream):
        if token.type == "heading_open":
            inline = stream[index + 1]
            text = "".join(child.content for child in inline.children or () if child.type in ("text", "code_inline"))
            base = slug(text)
            anchor = base if base not in seen else f"{base}-{seen[base]}"
            seen[base] = seen.get(base, 0) + 1
            anchors.add(anchor)
        if token.type in ("html_block", "html_inline", "inline"):
            for child in [token, *(token.children or ())]:
                if child.type.startswith("html"):
                    anchors.update(HTML_ANCHOR.findall(child.content))
    return anchors


@cache
def anchors(path):
    if path.suffix == ".ipynb":  # GitHub renders a notebook's markdown cells, headings and all
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        text = "\n\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "markdown")
        return heading_anchors(PARSER.parse(text))
    return heading_anchors(tokens(path))


def links(path):
    """(line, target) of every link, image and HTML href/src; nothing inside code."""
    for token in tokens(path):
        line = token.map[0] + 1 if token.map else 0
        for child in [token, *(token.children or ())]:
            if child.type == "link_open":
                yield line, child.attrGet("href")
            elif child.type == "image":
                yield line, child.attrGet("src")
            elif child.type in ("html_block", "html_inline"):
                for target in HTML_LINK.findall(child.content):
                    yield line, target


def broken(path, target):
    """Why `target`, linked from `path`, does not resolve; None when it does (or is not ours to check)."""
    if SCHEME.match(target):
        return None  # no internet here: the web's links are not checked
    address, _, anchor = target.partition("#")
    address, anchor = unquote(address), unquote(anchor)
    destination = path if not address else (REPO / address.lstrip("/") if address.startswith("/")
                                            else path.parent / address)
    if not destination.exists():
        return f"{address} does not exist"
    if not anchor:
        return None
    if destination.is_file() and destination.suffix in (".md", ".ipynb"):
        found = anchor in anchors(destination.resolve())
        return None if found else f"no heading gives #{anchor} in {address or 'this file'}"
    if destination.is_file() and LINE_ANCHOR.fullmatch(anchor):
        return None
    return f"#{anchor} cannot point into {address}"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda path: str(path.relative_to(REPO)))
def test_relative_links_and_anchors_resolve(path):
    problems = [f"{path.relative_to(REPO)}:{line}: ({target}) {why}" for line, target in links(path)
                if (why := broken(path, target))]
    assert not problems, "\n".join(problems)


# --- commands quoted in the README and docs/ ---------------------------------------------------------------------

@cache
def script_flags(script):
    """The option strings a script's argparse defines, read with ast (as tests/test_repository.py does), plus
    argparse's own --help."""
    tree = ast.parse((REPO / script).read_text(encoding="utf-8"))
    defined = {"--help", "-h"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            defined |= {arg.value for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                        and arg.value.startswith("-")}
    return defined


def words(command):
    try:
        lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        return list(lexer)  # comments (`# ...`) dropped, quotes removed, operators separate words
    except ValueError:  # an unbalanced quote: a fragment rather than a command
        return command.split()


def script_run_by(sbatch):
    """The script an sbatch file runs (its extra arguments go to that script)."""
    found = re.search(r"\b(?:\d\d[a-z]?_\w+|preflight)\.py\b", (REPO / sbatch).read_text(encoding="utf-8"))
    return found.group(0) if found else None


def command_problems(command):
    """What is wrong with one quoted command: a numbered script (or sbatch file) that does not exist, or a
    --flag after it that its script does not define. What comes before the script (python, torchrun and
    torchrun's own flags, sbatch's flags) is not the script's."""
    problems, segment = [], []
    for word in [*words(command), ";"]:
        if word not in OPERATORS:
            segment.append(word)
            continue
        script = None
        for word_in_segment in segment:
            name = word_in_segment.removeprefix("./")
            if SCRIPT.search(name) or SBATCH.search(name):
                if not (REPO / name).is_file():
                    problems.append(f"{name} does not exist")
                    script = None
                elif SCRIPT.search(name):
                    script = name if "/" not in name else None  # flags: the numbered scripts and the preflight
                else:
                    script = script_run_by(name)
            elif script and word_in_segment.startswith("--") and word_in_segment != "--":  # `--`: the end of options
                flag = word_in_segment.split("=", 1)[0]
                if flag not in script_flags(script):
                    problems.append(f"{script} has no {flag}")
        segment = []
    return problems


def quoted_commands(path):
    """(line, command) for every line of every code block and every inline code span."""
    for token in tokens(path):
        line = token.map[0] + 1 if token.map else 0
        if token.type in ("fence", "code_block"):
            for offset, command in enumerate(token.content.replace("\\\n", " ").splitlines()):
                yield line + 1 + offset, command
        for child in token.children or ():
            if child.type == "code_inline":
                yield line, child.content


DOCUMENTED = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", DOCUMENTED, ids=lambda path: str(path.relative_to(REPO)))
def test_quoted_commands_run_scripts_that_exist_with_flags_they_define(path):
    problems = [f"{path.relative_to(REPO)}:{line}: `{command}`: {problem}"
                for line, command in quoted_commands(path) for problem in command_problems(command)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text, found", [
    ("[a](#nowhere)", "no heading gives #nowhere in this file"),
    ("[a](no/such/file.md)", "no/such/file.md does not exist"),
    ("[a](README.md#not-a-heading)", "no heading gives #not-a-heading in README.md"),
    ("## Fault tolerance: 04_fault_tolerant.py\n## Fault tolerance: 04_fault_tolerant.py\n"
     "[a](#fault-tolerance-04_fault_tolerantpy-1) [b](#fault-tolerance-04_fault_tolerantpy-2)",
     "no heading gives #fault-tolerance-04_fault_tolerantpy-2 in this file"),
    ("`[x](#nowhere)` and\n```\n[y](missing.md)\n```\n[web](https://example.com/#x)", None),
])
def test_the_link_check_can_fail(tmp_path, text, found):
    """The check itself: a broken link or anchor is reported, one in code or on the web is not."""
    page = tmp_path / "page.md"
    page.write_text(text)
    (tmp_path / "README.md").write_text((REPO / "README.md").read_text())
    reasons = [why for _, target in links(page) if (why := broken(page, target))]
    assert reasons == ([found] if found else [])


@pytest.mark.parametrize("command, found", [
    ("torchrun --standalone --nproc_per_node=2 02_torchrun.py --epochs 1", []),
    ("torchrun --standalone --nproc_per_node=2 02_torchrun.py --no-such-flag=1",
     ["02_torchrun.py has no --no-such-flag"]),
    ("python 09_gone.py", ["09_gone.py does not exist"]),
    ("python 02_torchrun.py --nproc 2", ["02_torchrun.py has no --nproc"]),  # 01's flag, gone in 02
    ("torchrun --standalone --nproc_per_node=1 01_mp_spawn.py -- --nproc 2 --bogus", ["01_mp_spawn.py has no --bogus"]),
    ("sbatch --wait slurm/preflight.sbatch --timeout 30", []),
    ("sbatch --wait slurm/02_torchrun.sbatch --epochs 1 --bogus  # comment --also-bogus",
     ["02_torchrun.py has no --bogus"]),
])
def test_the_command_check_can_fail(command, found):
    assert command_problems(command) == found
