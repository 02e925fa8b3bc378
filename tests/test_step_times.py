"""port/gpt_timed.py and tools/step_times.py: each rank's step split into computing, waiting for the other ranks and
communicating names the rank made slow on purpose, and the time the others lose shows as waiting, not as
communication. The split's arithmetic on records made by hand; the tool's verdicts; then one run of 2 ranks with
rank 1 slowed by 100 ms a step, which also writes a torch.profiler trace per rank."""
import json

import pytest
from helpers import clean_env, load_script, run_ok, torchrun

TIMED = load_script("port/gpt_timed.py")
TOOL = load_script("tools/step_times.py")


def test_a_step_splits_into_computing_then_waiting_for_the_last_rank_then_communicating():
    """Two buckets. Rank 0 hands bucket 0 over at 10 ms and bucket 1 at 20; rank 1 at 50 and 70. Bucket 0's
    all-reduce runs from 50 to 60 ms, bucket 1's from 70 to 74; both backward() calls return at 75 ms and the steps
    end at 80. Rank 0 waited 50 ms (20 to 70) and communicated 5 (70 to 75); its bucket 0 was reduced while it
    waited, hidden behind nothing. Rank 1 waited for nobody; bucket 0's 10 ms ran hidden behind its backward."""
    records = [[(0.0, {0: (0.010, 0.060), 1: (0.020, 0.074)}, 0.075, 0.080)],
               [(0.0, {0: (0.050, 0.060), 1: (0.070, 0.074)}, 0.075, 0.080)]]
    rank0, rank1 = (steps[0] for steps in TIMED.split_steps(records))
    assert rank0 == pytest.approx({"step_ms": 80, "computing_ms": 25, "waiting_ms": 50, "communicating_ms": 5,
                                   "allreduce_ms": 14, "hidden_ms": 0, "hideable_ms": 10})
    assert rank1 == pytest.approx({"step_ms": 80, "computing_ms": 75, "waiting_ms": 0, "communicating_ms": 5,
                                   "allreduce_ms": 14, "hidden_ms": 10, "hideable_ms": 10})


def lines_of(**ranks):
    """Timings lines of 6 steps, each rank's parts the same in every step."""
    return [{"step": step, "rank": int(rank[4:]), **{f"{part}_ms": value for part, value in parts.items()}}
            for step in range(1, 7) for rank, parts in ranks.items()]


def test_the_tool_names_the_rank_that_computes_longest_and_only_a_rank_that_stands_out():
    fast = {"step": 130, "computing": 25, "waiting": 100, "communicating": 5, "allreduce": 5, "hidden": 0,
            "hideable": 0}
    slow = {**fast, "computing": 125, "waiting": 0}
    table = TOOL.medians(lines_of(rank0=fast, rank1=slow), skip=1)
    assert TOOL.slowest(table) == 1 and "slow rank: 1 (it computes longest" in TOOL.report(table, 5)
    assert TOOL.slowest(TOOL.medians(lines_of(rank0=fast, rank1={**fast, "computing": 30}), skip=1)) is None
    resumed = lines_of(rank0=fast, rank1=slow) + lines_of(rank0=fast, rank1=fast)  # the same steps again: the later
    assert TOOL.slowest(TOOL.medians(resumed, skip=1)) is None


@pytest.mark.launch
@pytest.mark.long_job
def test_the_port_logs_the_split_the_tool_names_the_slow_rank_and_each_rank_writes_a_trace(tmp_path, capsys):
    timings, traces = tmp_path / "times.jsonl", tmp_path / "traces"
    output = run_ok(torchrun(2, "port/gpt_timed.py", "--steps", 12, "--log-every", 4, "--eval-every", 100,
                             "--n-layer", 2, "--batch-size", 8, "--sample-bytes", 0, "--timings", timings,
                             "--profile", traces), env=clean_env(STEP_DELAY="1:0.1"), timeout=150).stdout
    assert output.count("ms computing / waiting / communicating, medians of 4 steps: rank 0 ") == 3, output[-3000:]
    assert len(timings.read_text().splitlines()) == 2 * 12
    assert TOOL.main([str(timings)]) == 0
    assert "slow rank: 1 (it computes longest; the others wait for it)" in capsys.readouterr().out
    table = TOOL.medians([json.loads(line) for line in timings.read_text().splitlines()], skip=5)
    assert table[1]["computing"] - table[0]["computing"] > 70  # rank 1 computes ~100 ms longer
    assert table[0]["waiting"] > 70 and table[1]["waiting"] < 0.3 * table[0]["waiting"]  # rank 0 waits; 1 does not
    assert max(table[0]["communicating"], table[1]["communicating"]) < 0.3 * table[0]["waiting"]  # not the network
    for rank in (0, 1):  # steps 3 to 5 of each rank, its all-reduces among them (2 buckets and the loss check)
        trace, = traces.glob(f"rank{rank}.*.pt.trace.json")
        names = [event.get("name") for event in json.loads(trace.read_text())["traceEvents"]]
        assert [name for name in names if str(name).startswith("ProfilerStep#")] == [f"ProfilerStep#{i}" for i in
                                                                                     (2, 3, 4)]
        assert names.count("gloo:all_reduce") == 9, sorted(set(map(str, names)))[:50]


def test_the_tool_refuses_a_file_it_cannot_read_in_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("not json\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n')  # gpt_timed.py's --metrics file
    for path, said in ((tmp_path / "gone.jsonl", "No such file"), (tmp_path / "notes.txt", "Expecting value"),
                       (tmp_path / "metrics.jsonl", "KeyError")):
        with pytest.raises(SystemExit) as stop:
            TOOL.main([str(path)])
        assert stop.value.code.startswith(f"error: {path}: not a file of gpt_timed.py --timings (") and said in \
            stop.value.code and "\n" not in stop.value.code
