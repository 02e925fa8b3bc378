"""port/gpt_async.py: snapshots written while training goes on (DCP's async_save). A run killed (SIGKILL to every
process) while a snapshot is being written in the background, just after one was put in place, or a moment into a
write, resumes from the newest complete snapshot, never from a partial one or one not yet written, and the run
resumed after the last kill ends on the uninterrupted run's weights, bit for bit."""
import re
import threading
import time

import pytest
from helpers import finish, kill_tree, run_ok, start, torchrun

ASYNC = "port/gpt_async.py"
ARGS = ("--steps", 14, "--save-every-steps", 1, "--n-layer", 2, "--eval-every", 100, "--log-every", 100,
        "--sample-bytes", 0, "--async-save")


def checksum(output):
    (value,) = set(re.findall(r"rank \d done: parameter checksum ([-+.\deE]+)", output))
    return value


def killed_at(path, trigger, after=0.0):
    """Runs to the first line that starts with `trigger`, waits `after` seconds, then SIGKILLs every process of the
    run (torchrun's agent and its ranks). Returns the output up to the kill."""
    process = start(torchrun(2, ASYNC, *ARGS, "--checkpoint", path))
    watchdog = threading.Timer(150, kill_tree, [process.pid])  # a run that never prints the line fails, not hangs
    watchdog.start()
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith(trigger):
            time.sleep(after)
            kill_tree(process.pid)
            break
    watchdog.cancel()
    finish(process, timeout=30)
    output = "".join(lines)
    assert line.startswith(trigger), f"no line {trigger!r}:\n{output[-3000:]}"
    return output


@pytest.mark.launch
@pytest.mark.long_job
def test_a_run_killed_during_or_between_background_writes_resumes_from_the_last_complete_snapshot(tmp_path):
    reference = run_ok(torchrun(2, ASYNC, *ARGS, "--checkpoint", tmp_path / "reference"), timeout=150).stdout
    path = tmp_path / "gpt"
    # a write just begun; a snapshot just put in place; 20 ms into a write. Each run resumes where the last one died
    moments = [("snapshot of step 3: ", 0.0), (f"saved snapshot {path} (step 6)", 0.0), ("snapshot of step 9: ", 0.02)]
    outputs = [killed_at(path, trigger, after) for trigger, after in moments]
    outputs.append(run_ok(torchrun(2, ASYNC, *ARGS, "--checkpoint", path), timeout=150).stdout)
    for killed, resumed in zip(outputs, outputs[1:], strict=False):
        in_place = max(int(step) for step in re.findall(rf"saved snapshot {path} \(step (\d+)\)", killed))
        begun = max(int(step) for step in re.findall(r"snapshot of step (\d+): ", killed))
        (step,) = map(int, re.findall(rf"resumed from {path}: step (\d+) of 14", resumed))
        # never one older than the last put in place, never one whose write had not begun (or not ended: the resume
        # reads every piece, and the final weights below would differ)
        assert in_place <= step <= begun, (in_place, step, begun, resumed[-2000:])
        assert "error" not in resumed.lower(), resumed[-3000:]
    assert checksum(outputs[-1]) == checksum(reference)
