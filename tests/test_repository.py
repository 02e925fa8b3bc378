"""The repository keeps its own promises: diffs that are one lesson each and never stale, standalone
scripts with the same flags, ruff-clean code, and a README (and docs/ pages) whose commands are the ones the tests
run."""
import ast
import json
import subprocess
import sys

import pytest
from conftest import DOCUMENTED
from helpers import PYTHON, REPO, SCRIPTS, load_script
from test_multinode import node_command, static_node_command

sys.path.insert(0, str(REPO / "tools"))
import make_diffs  # noqa: E402


def test_rendered_diffs_are_up_to_date_and_each_step_within_its_budget():
    result = subprocess.run([PYTHON, "tools/make_diffs.py", "--check"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("previous, script", make_diffs.steps())
def test_step_budget_holds(previous, script):
    assert make_diffs.added_lines(make_diffs.render(previous, script)) <= make_diffs.BUDGET[script]


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_are_standalone(script):
    """A numbered script imports nothing from the project: each one is read, copied and run on its own."""
    tree = ast.parse((REPO / script).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    local = {path.stem for path in REPO.glob("*.py")} | {path.name for path in REPO.iterdir() if path.is_dir()}
    assert not imported & local


def flags(script):
    source = (REPO / script).read_text()
    return {node.args[0].value for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
            and getattr(node.func, "attr", "") == "add_argument"}


@pytest.mark.parametrize("script", SCRIPTS[1:])
def test_every_script_keeps_the_flags_of_the_one_before(script):
    previous = SCRIPTS[SCRIPTS.index(script) - 1]
    assert flags(previous) - flags(script) <= {"--nproc"}, "01's --nproc goes when torchrun takes over"


def test_ruff_is_clean():
    result = subprocess.run([PYTHON, "-m", "ruff", "check", "."], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_readme_shows_the_commands_the_tests_run():
    """The README shows the two commands and each step's command (its ladder table); the docs/ page a subject
    moved to shows that subject's commands."""
    readme = (REPO / "README.md").read_text()
    multinode = (REPO / "docs/multinode.md").read_text()
    fault_tolerance = (REPO / "docs/fault-tolerance.md").read_text()
    for command in DOCUMENTED.values():
        shown = " ".join(["python" if part == PYTHON else "torchrun" if part.endswith("torchrun") else str(part)
                          for part in command])
        assert shown in readme, f"README does not show: {shown}"
    practice = node_command("127.0.0.1:29500", "job1")
    assert " ".join(["torchrun", *practice[1:]]) in multinode, "docs/multinode.md's one-machine multi-node command"
    for node_rank in (0, 1):
        practice = static_node_command(node_rank, "127.0.0.1", 29500)
        assert " ".join(["torchrun", *practice[1:]]) in multinode, \
            "docs/multinode.md's one-machine static rendezvous commands"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 --max-restarts=3 " \
           "04_fault_tolerant.py --checkpoint snapshot.pt" in fault_tolerance, \
           "docs/fault-tolerance.md: the command tests/test_fault_tolerance.py runs"
    for target in ("make demo", "make test"):
        assert target in readme


def test_the_published_benchmark_table_is_what_the_committed_raw_figures_give():
    benchmark = load_script("benchmarks/run.py")
    _, _, table = benchmark.summarize(json.loads((REPO / "benchmarks/results.json").read_text()))
    assert (REPO / "benchmarks/results.md").read_text() == table, "run: .venv/bin/python benchmarks/run.py --table-only"
    assert table in (REPO / "docs/performance.md").read_text(), "docs/performance.md: paste benchmarks/results.md"


def test_the_build_memory_report_is_what_its_raw_figures_give_and_the_docs_quote_it():
    """benchmarks/fsdp_build_memory.md is made from its json only; docs/fsdp.md quotes its medians."""
    benchmark = load_script("benchmarks/fsdp_build_memory.py")
    raw = json.loads((REPO / "benchmarks/fsdp_build_memory.json").read_text())
    assert (REPO / "benchmarks/fsdp_build_memory.md").read_text() == benchmark.table(raw)
    docs = (REPO / "docs/fsdp.md").read_text()
    for way, rank in (("eager", 0), ("meta", 1), ("meta", 0)):
        peaks = sorted(run["peak_over_before_MB"] for run in raw["runs"] if run["way"] == way and run["rank"] == rank)
        assert f"{peaks[len(peaks) // 2]:.1f} MB" in docs, (way, rank)


def test_the_sharded_ports_memory_report_is_what_its_raw_figures_give_and_the_docs_quote_it():
    """benchmarks/gpt_fsdp_memory.md is made from its json only (its verdicts by benchmarks/_verdict.py), and
    docs/fsdp.md carries its table as it is."""
    benchmark = load_script("benchmarks/gpt_fsdp_memory.py")
    report = benchmark.table(json.loads((REPO / "benchmarks/gpt_fsdp_memory.json").read_text()))
    assert (REPO / "benchmarks/gpt_fsdp_memory.md").read_text() == report
    table = report[report.index("| configuration"):report.index("\n\n- ")]
    assert table in (REPO / "docs/fsdp.md").read_text(), "docs/fsdp.md: paste benchmarks/gpt_fsdp_memory.md's table"
    build = report[report.index("| configuration | N | rank"):].rstrip("\n")
    assert build in (REPO / "docs/fsdp.md").read_text(), "docs/fsdp.md: paste the report's build table"


def test_the_hsdp_bytes_report_is_what_its_raw_figures_give_and_each_count_is_its_prediction():
    """benchmarks/gpt_hsdp_bytes.md is made from its json only; every count of the bytes FSDP2's collectives were
    handed per step is what the report's formula predicts, to 0.5% (padding), and docs/fsdp.md links the report."""
    benchmark = load_script("benchmarks/gpt_hsdp_bytes.py")
    raw = json.loads((REPO / "benchmarks/gpt_hsdp_bytes.json").read_text())
    assert (REPO / "benchmarks/gpt_hsdp_bytes.md").read_text() == benchmark.table(raw)
    for layout, counted in raw["layouts"].items():
        for key, expected in benchmark.predicted(layout).items():
            assert abs(counted[key] - expected) <= 0.005 * expected, (layout, key)
    assert "benchmarks/gpt_hsdp_bytes.md" in (REPO / "docs/fsdp.md").read_text()


def test_the_past_fsdp_bytes_report_is_what_its_raw_figures_give_and_each_count_is_its_prediction():
    """benchmarks/parallel_bytes.md is made from its json only; in every predicted row (tensor parallelism's
    all-reduces of activations, FSDP2's gathers and reduce-scatters across the rows, the pipeline's sends and tied
    gradient, ZeRO-1's all-reduce and broadcast) the bytes counted per step are the prediction, less the calls of a
    few numbers each (under 4 kB), the same on every rank, and docs/past-fsdp.md and docs/sizing.md link the
    report."""
    benchmark = load_script("benchmarks/parallel_bytes.py")
    raw = json.loads((REPO / "benchmarks/parallel_bytes.json").read_text())
    assert (REPO / "benchmarks/parallel_bytes.md").read_text() == benchmark.table(raw)
    rows = [line.split(" | ") for line in benchmark.table(raw).splitlines() if line.startswith("| ") and ".py" in line]
    assert len(rows) == 7
    for row in rows:
        predicted, counted, small = (int(cell.strip(" |").replace(",", "")) for cell in row[-4:-1])
        assert counted - small <= predicted <= counted, row  # ZeRO-1's broadcast: the small parameters predicted too
        assert row[-1] == "yes |", row  # every rank's group of that shape handed the same bytes
    for page in ("docs/past-fsdp.md", "docs/sizing.md"):
        assert "benchmarks/parallel_bytes.md" in (REPO / page).read_text(), page


def test_the_bubble_report_is_what_its_raw_figures_give_and_the_docs_quote_it():
    benchmark = load_script("benchmarks/pipeline_bubble.py")
    report = benchmark.summarize(json.loads((REPO / "benchmarks/pipeline_bubble.json").read_text()))
    assert (REPO / "benchmarks/pipeline_bubble.md").read_text() == report
    table = report[report.index("| micro-batches m"):].rstrip("\n")
    assert table in (REPO / "docs/past-fsdp.md").read_text(), "docs/past-fsdp.md: paste the bubble table"


def test_the_fsdp_report_is_what_its_raw_figures_give_and_the_docs_quote_it():
    """benchmarks/fsdp_memory.md is made from its json only; docs/fsdp.md and the README quote its figures."""
    benchmark = load_script("benchmarks/fsdp_memory.py")
    report = benchmark.markdown(json.loads((REPO / "benchmarks/fsdp_memory.json").read_text()))
    assert (REPO / "benchmarks/fsdp_memory.md").read_text() == report, \
        "run: .venv/bin/python benchmarks/fsdp_memory.py --table-only"
    docs, readme = (REPO / "docs/fsdp.md").read_text(), (REPO / "README.md").read_text()
    for figure in ("| FSDP | 2 | 180.2, 228.2 at peak | 180.2 |", "| FSDP | 4 | 90.1, 138.1 at peak | 90.1 |",
                   "| 2 | 202 | 412 | 2.07 (1.86-2.10) |", "| FSDP | 2 | 240.3 | 180.2 | 240.5 | 240.8 |",
                   "| 2 | 1.001 (1.000) | 0.500 (0.500) | 1.001 (0.500) |", "| 4 | 2.38e-07 | 1.03e-07 | 38 of 40 |",
                   "| DDP | 2 | 120.1 | 120.1 | 120.3 | 120.4 |",
                   "| FSDP | 2 | 180.2, 228.2 at peak | 180.2 | 0 | 701.2 | 136.1 | 801.6 |",
                   "| DDP | 2 | 360.4 | 360.4 | 0 | 702.0 | 241.5 | 459.6 | 396.6 |",
                   "| FSDP | 1 | 360.4, 408.4 at peak | 360.4 | 0 | 702.3 | 147.9 | 828.4 | 413.0 |",
                   "| FSDP | 4 | 90.1, 138.1 at peak | 90.1 | 32784 | 702.2 | 129.9 | 865.4 | 175.0 |"):
        assert figure in report, figure
    for quoted in ("180.2 MB (180.2)", "90.1 MB (90.1)", "2.07 (1.86-2.10)", "1.97 (1.76-2.75)", "2.00 (1.34-2.46)",
                   "802 MB against 460 MB", "240.8 MB", "120.4 MB", "2.4e-7", "413.0, 254.6 and 175.0 MB",
                   "394.5 to 398.1 MB"):
        assert quoted in docs, quoted
    assert "2.07 times as long as DDP's at 2 processes (1.86-2.10" in readme and "360.4, 180.2 and 90.1 MB" in readme
    assert "254.6 MB against 396.6 MB" in readme
