"""One page says what has and has not run on a GPU: docs/gpu-runs/README.md, the index of the GPU runs, which links
every run's folder. Every other page, lesson source, docstring and comment links to it instead of saying so itself,
so that the next GPU run cannot leave a stale sentence behind.

The detector reads every sentence of the repository's Markdown files (the lessons' .md sources too, and the comments
in their code) and of its Python files' docstrings and comments, outside docs/gpu-runs/, .venv*, diffs/ and this
file (which quotes what it looks for). It flags a sentence that names a GPU (GPU, CUDA, cuDNN, NCCL, H200) and gives
a run status, of whatever: a perfect of run, test, verify, measure, check, try or exercise ("has run", "have not
been tested", "has trained on one GPU"), "passed on" a GPU, a past ("was measured"; "ran" within 60 characters of
the GPU word), a negation ("not run", "never tested", "not yet"; not "does not run", which is what code does),
"untested", "unverified" or "untried", or the reason once given ("no GPU machine was available", "these sessions had
no GPU", "(no GPU)"). What the code does on a GPU ("picks NCCL", "runs out of memory") is not flagged, nor a finding
quoted with its source ("seen on the H200"), nor a pointer to the page: "what has run on a GPU" followed, within 6
words, by a link to it. Nothing is started: the files are read."""
import ast
import io
import re
import subprocess
import tokenize

import pytest
from helpers import REPO

PAGE = REPO / "docs" / "gpu-runs" / "README.md"
EXCLUDED = ("docs/gpu-runs/", "diffs/", "tests/test_gpu_runs_page.py")

# a GPU word; not `make test-gpu` (a target's name) nor a path (docs/gpu-runs/, test_gpu.py)
GPU = re.compile(r"(?<!test-)(?<![/_.])\b(?:GPUs?|CUDA|cuDNN|NCCL\w*|H200)\b", re.IGNORECASE)
VERB = r"(?:run|ran|tested|verified|measured|checked|tried|exercised)"
STATUS = re.compile("|".join([
    # a perfect, with or without a negation: has run, have not been tested, has never been verified, has only run
    rf"\b(?:has|have|had)\s+(?:(?:not|never|only|yet|so far|once|already|now|ever)\s+)*(?:been\s+)?{VERB}\b",
    # has trained on one GPU, has passed on a GPU node (not "the ranks have trained on")
    r"\b(?:has|have|had)\s+(?:(?:not|never|only|once|already)\s+)*(?:trained|passed)\b[^.;]{0,40}?"
    r"\b(?:GPUs?|CUDA|H200)\b",
    # passed on an H200, passed on one GPU (a result, whoever passed)
    r"\bpassed\s+on\s+(?!to\b)[^.;]{0,30}?\b(?:GPUs?|CUDA|H200)\b",  # not "passed on to the GPU"
    # have not been able to measure
    r"\bnot\s+(?:yet\s+)?been\s+able\s+to\b",
    # a past: was measured, were tested, was not checked (and "ran", below)
    rf"\b(?:was|were)\s+(?:(?:not|never|only|once|yet|ever)\s+)*{VERB}\b",
    # a negation: not run, never tested, not (yet) verified, is not checked; but not "does not run" (behaviour)
    rf"(?<!\bdoes )(?<!\bdo )(?<!\bwould )(?<!\bwill )(?<!\bcan )(?<!\bcould )(?<!\bmay )(?<!\bmust )"
    rf"\b(?:not|never)\s+(?:yet\s+)?(?:been\s+)?{VERB}\b",
    r"\bnot\s+yet\b",
    r"\b(?:untested|unverified|unmeasured|untried)\b",
    # the reason given: no GPU (machine) was available, these sessions had no GPU, no GPU here, no GPU run
    r"\b(?:was|were|been)\s+available\b",
    r"\b(?:had|has|have)\s+no\s+(?:GPUs?|CUDA)\b",
    r"\bno\s+GPUs?\s+(?:here|run|machine)\b",
    r"(?:\(|:\s*)no\s+GPUs?\s*[).]",  # (no GPU), : no GPU.
    # is measured here, are not run here
    rf"\b(?:is|are)\s+(?:not\s+)?{VERB}\s+here\b",
]), re.IGNORECASE)

# "ran" is common in other senses ("the solutions ran"): it counts only within 60 characters of a GPU word
RAN = re.compile(r"\bran\b", re.IGNORECASE)
NEAR = 60

# A link to the index, and the pointer phrase that leads to it, at most 6 words before it ("what has run on a GPU:
# [GPU runs](...)", "what has run on a GPU is on one page, [GPU runs](...)")
INDEX_LINK = re.compile(r"\[([^\]]*)\]\((?:\.\./|\./)*(?:docs/)?gpu-runs/(?:README\.md)?(?:#[^)]*)?\)")
POINTER = re.compile(r"\bwhat\s+(?:has|have)\s+(?:(?:and|or)\s+(?:has|have)\s+not\s+|not\s+)?(?:been\s+)?"
                     r"(?:run|tested)(?:\s+on\s+(?:a\s+|the\s+)?GPUs?)?(?:,?\s+and\s+what\s+has\s+not)?"
                     r"[\s:,(]*(?:[\w'-]+[\s:,(]+){0,6}INDEXLINK", re.IGNORECASE)
LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
SENTENCE_END = re.compile(r"(?<=[.!?])[*_`)\]\"']*\s+(?=[^a-z\s])")


def files():
    """Every tracked (or new, not ignored) .md and .py file outside the excluded folders."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--",
                                 "*.md", "*.py"], cwd=REPO, capture_output=True, text=True, check=True).stdout
        names = [name for name in listed.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        names = [str(path.relative_to(REPO)) for path in [*REPO.rglob("*.md"), *REPO.rglob("*.py")]]
    return sorted(name for name in names
                  if not name.startswith(EXCLUDED) and not any(part.startswith(".") for part in name.split("/"))
                  and (REPO / name).is_file())


def markdown_blocks(text):
    """The prose of a Markdown file as blocks of (line number, text): a paragraph, a list item, a heading, a table
    cell; in fenced code, the comments. Jupytext's YAML header is skipped."""
    lines, blocks, block, fence, start = text.split("\n"), [], [], None, 0
    if text.startswith("---\n") and "---" in lines[1:]:
        start = lines.index("---", 1) + 1

    def flush():
        if block:
            blocks.append(block.copy())
            block.clear()
    for number, line in enumerate(lines[start:], start + 1):
        stripped = line.strip()
        if fence:
            if stripped.startswith(fence):
                fence = None
                flush()
            elif comment := re.search(r"(?:^|\s)#+\s?(.*)", line):
                block.append((number, comment.group(1)))
            else:
                flush()
        elif stripped.startswith(("```", "~~~")):
            flush()
            fence = stripped[:3]
        elif not stripped:
            flush()
        elif stripped.startswith("|"):
            flush()
            blocks.extend([(number, cell)] for cell in re.split(r"(?<!\\)\|", stripped) if cell.strip())
        elif stripped.startswith("#") or re.match(r"(?:[-*+]|\d+\.)\s", stripped):
            flush()
            block.append((number, stripped.lstrip("#").strip()))
            if stripped.startswith("#"):
                flush()
        else:
            block.append((number, stripped))
    flush()
    return blocks


def python_blocks(text):
    """The docstrings (paragraph by paragraph) and comments (runs of consecutive lines) of a Python file."""
    blocks = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                block = []
                for number, line in enumerate(first.value.value.split("\n"), first.lineno):
                    if line.strip():
                        block.append((number, line.strip()))
                    elif block:
                        blocks.append(block)
                        block = []
                if block:
                    blocks.append(block)
    block, last = [], None
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            number = token.start[0]
            if block and number != last + 1:
                blocks.append(block)
                block = []
            block.append((number, token.string.lstrip("#").strip()))
            last = number
    if block:
        blocks.append(block)
    return blocks


def sentences(block):
    """A block's sentences, each with the line it starts on."""
    text, starts = "", []
    for number, line in block:
        starts.append((len(text), number))
        text += line + " "
    begin = 0
    for end in [match.start() for match in SENTENCE_END.finditer(text)] + [len(text)]:
        sentence = text[begin:end].strip()
        if sentence:
            yield max(number for offset, number in starts if offset <= begin), sentence
        begin = end


def claim(sentence):
    """The run status the sentence gives beside a GPU word ("has not run"), or None."""
    plain = INDEX_LINK.sub("INDEXLINK", sentence)
    plain = LINK.sub(lambda match: match.group(1), POINTER.sub("", plain))
    gpus = [match.span() for match in GPU.finditer(plain)]
    if not gpus:
        return None
    if status := STATUS.search(plain):
        return status.group(0)
    for ran in RAN.finditer(plain):
        if any(start - NEAR <= ran.end() and ran.start() <= end + NEAR for start, end in gpus):
            return ran.group(0)
    return None


def findings():
    found = []
    for name in files():
        text = (REPO / name).read_text(encoding="utf-8")
        blocks = python_blocks(text) if name.endswith(".py") else markdown_blocks(text)
        for block in blocks:
            for number, sentence in sentences(block):
                if claim(sentence):
                    found.append(f"{name}:{number}: {sentence}")
    return found


def test_no_page_but_the_gpu_runs_page_says_what_has_run_on_a_gpu():
    found = findings()
    assert not found, ("these say what has or has not run on a GPU; say it in docs/gpu-runs/README.md only, and "
                       "link to it ([GPU runs](docs/gpu-runs/README.md)):\n" + "\n".join(found))


STALE = [  # sentences the repository had, each of which a later GPU run could make false: caught
    "**The GPU path has run once, on one GPU** (an H200, with torch 2.11.0: [what ran and what it found]"
    "(docs/gpu-runs/2026-11-28-h200/README.md)); several GPUs, NCCL between them, and the pinned torch 2.15.0 on "
    "a GPU have not run, so what is said of those is not verified.",
    "On a GPU machine, `make test-gpu PYTHON=/path/to/its/python OUT=folder` runs the GPU claims and the GPU "
    "benchmark with that machine's own torch and writes a report; none has run on a GPU yet ([Tests](docs/tests.md)).",
    "One GPU, for a few minutes: on 2026-11-28 `make test-gpu` ran on one NVIDIA H200 with that machine's torch "
    "2.11.0 (not the pinned 2.15.0).",
    "What has not run: two or more GPUs (NCCL carrying gradients between processes, FSDP sharding across GPUs, the "
    "sbatch files on GPU nodes) and torch 2.15's ProcessGroupNCCL2; every notebook output and every other figure "
    "here comes from CPUs with gloo.",
    "Everything runs on their laptops' CPUs (Linux; WSL on Windows, untested; macOS on Apple silicon untested, on "
    "Intel not at all: [On a laptop](laptop.md)); GPUs are not needed, and nothing here has run on one.",
    "- The GPU path (NCCL, CUDA random states, fp16 with GradScaler) is written but **has not been verified: no GPU "
    "machine was available**.",
    "**They ran once, on one H200 with torch 2.11.0** (2026-11-28, [the report](gpu-runs/2026-11-28-h200/README.md), "
    "three calls, as the first stopped at limits that were too short): all 15 passed.",
    "The GPU path has run once, on one GPU (an H200 with torch 2.11.0, 2026-11-28: [what ran and what it found]"
    "(gpu-runs/2026-11-28-h200/README.md)); several GPUs have not.",
    "Neither has run here (no GPU).",
    "NCCL computes the mean itself, so on GPUs the gloo bug does not apply; on a GPU nothing has run.",
    "None of it has run on a GPU.",
    "No run with two or more GPUs has tested any of this: NCCL's collectives, CUDA memory per rank.",
    "On a GPU, with its caching allocator, this has not been measured.",
    "A machine with more cores than processes, or GPUs, may not pay these costs the same way; we have not been able "
    "to measure one yet.",
    "What this guide says about NCCL describes ProcessGroupNCCL; whether ProcessGroupNCCL2 behaves the same is not "
    "checked, and no NCCL path has run here: these sessions had no GPU.",
    "GPUs and NCCL (no GPU was available: the GPU path is untested).",
    "**Nothing here ran on a GPU** (section 7).",
    "Everything runs on this machine's CPU with gloo; **no GPU path was verified here**.",
    "FSDP2 is for a model whose state does not fit one device, not for speed; on a GPU none of this was measured.",
    "With NCCL (ProcessGroupNCCL, not run here: no GPU) its watchdog takes the whole process down instead.",
    "Unverified here (CUDA's documentation, not run): this machine has no GPU.",
    "The same code chooses NCCL on GPUs; that path has run only on one GPU, one process, so **what this lecture says "
    "of several GPUs on NCCL has not been verified.**",
    "It ran once, on an H200 with torch 2.11, stopped at 120 s with 9 of its then 12 figures.",
    "rank 0's GPU RNG (2+ GPUs not run) on each rank's own: all draw alike",
    "(A GPU's caching allocator behaves differently: not measured.)",
    "Whether that path dumps on a timeout was not checked, and no NCCL ran here.",
    "00, 02, 04, 05 (as it was then, built whole before sharding; its build on the meta device has not run on a GPU) "
    "and the GPT port trained on CUDA (one process, NCCL), the preflight passed.",
    "they do not pass `device_id`, which would also mute the warning on a GPU (that path had not run when they were "
    "written).",
    "That is a CPU result: on GPUs, cuDNN and some CUDA kernels are not deterministic by default, so two runs "
    "(interrupted or not) can differ in the last bits; not tested here.",
    "gloo's all_gather refuses uneven sizes (torch's docstring says they are supported, naming no backend; NCCL's: "
    "not run here), so each shard is padded to the largest.",
    "Name it: `export NCCL_SOCKET_IFNAME=eth0` (GPU/NCCL; described for ProcessGroupNCCL, and not run here: no GPU).",
    "05 has trained on [one GPU, one process](../docs/gpu-runs/2026-11-28-h200/README.md) (torch 2.11.0).",
    "05 builds on the meta device, so no GPU holds the whole model; but that has run only on this CPU.",
    "On GPUs NCCL runs beside the computation and usually hides more (not measured: no GPU was available).",
    "The preflight has passed on one GPU node.",
    "It passed on an H200.",
    "We never tried it on a GPU.",
    "NCCL: not exercised here.",
]

LEGITIMATE = [  # what the code does on a GPU, a pointer to the page, a finding with its source: not caught
    "The batch is passed on to the GPU copy of the model.",
    "Everything runs on a laptop CPU (gloo), and the same code chooses GPUs (NCCL) when PyTorch sees them.",
    "The CPU path is checked by the test suite on real processes, the GPU path far less (what has run on a GPU: "
    "[GPU runs](docs/gpu-runs/README.md)).",
    "What has and has not run on a GPU: [GPU runs](gpu-runs/README.md).",
    "`--device auto` picks CUDA when PyTorch sees a GPU, and the backend follows the device (NCCL on GPUs, gloo on "
    "CPU).",
    "A checkpoint that rank 0 saved from `cuda:0` therefore lands on GPU 0 in every process that loads it without "
    "`map_location`: every rank then allocates on GPU 0, and GPU 0 runs out of memory first.",
    "The fake GPUs are device files Slurm hands out; PyTorch finds no real GPU and runs on the CPU.",
    "Real processes, real `torchrun`, real gloo groups, a real Slurm; no GPU needed.",
    "Without CUDA every `gpu` test skips, saying why, and it exits 0: CI runs it so, which proves the plumbing and "
    "nothing about GPUs.",
    "**Seen on the H200** (torch 2.11.0): with these settings two runs gave the same weights, bit for bit.",
    "A GPU with one process does not run NCCL's all-reduce between processes.",
]


@pytest.mark.parametrize("sentence", STALE)
def test_a_stale_sentence_is_caught(sentence):
    assert claim(sentence)


@pytest.mark.parametrize("sentence", LEGITIMATE)
def test_a_sentence_that_claims_no_run_is_not_caught(sentence):
    assert claim(sentence) is None


def test_the_sentences_are_read_with_their_lines():
    markdown = "---\njupytext: x\n---\n# Title\n\nFirst line of a\nparagraph. The GPU path\nhas run once.\n"
    assert [number for block in markdown_blocks(markdown) for number, sentence in sentences(block)
            if claim(sentence)] == [7]
    python = '"""A module.\n\nIt ran once on a GPU."""\nx = 1  # an H200\n# has run it\n'
    assert [(number, sentence) for block in python_blocks(python) for number, sentence in sentences(block)
            if claim(sentence)] == [(3, "It ran once on a GPU."), (4, "an H200 has run it")]


def test_the_index_links_every_run_folder():
    folders = sorted(path.name for path in PAGE.parent.iterdir() if path.is_dir())
    linked = set(re.findall(r"\]\(([^)/#]+)/(?:README\.md)?\)", PAGE.read_text(encoding="utf-8")))
    assert folders, "no run's folder in docs/gpu-runs/"
    assert not set(folders) - linked, f"docs/gpu-runs/README.md does not link {sorted(set(folders) - linked)}"
    for folder in folders:
        assert (PAGE.parent / folder / "README.md").is_file(), f"docs/gpu-runs/{folder}/ has no README.md"
