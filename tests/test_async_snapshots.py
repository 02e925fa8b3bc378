"""port/gpt_async.py: snapshots written while training goes on (DCP's async_save). A run killed (SIGKILL to every
process) as a background write has just begun, just after a snapshot was put in place, or while the pieces are
being written into PATH.tmp, resumes from the newest complete snapshot, never from a partial one or one not yet
written, and the run resumed after the last kill ends on the uninterrupted run's weights, bit for bit."""
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


def killed_at(path, trigger, mid_write=False):
    """Runs to the first line that starts with `trigger` (with `mid_write`, on to the moment PATH.tmp appears: DCP
    has planned the write and is writing the pieces), then SIGKILLs every process of the run (torchrun's agent and
    its ranks). Returns the whole output, and what PATH.tmp held just after the kill."""
    unfinished = path.parent / f"{path.name}.tmp"
    process = start(torchrun(2, ASYNC, *ARGS, "--checkpoint", path))
    watchdog = threading.Timer(150, kill_tree, [process.pid])  # a run that never prints the line fails, not hangs
    watchdog.start()
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith(trigger):
            deadline = time.monotonic() + 10
            while mid_write and not unfinished.exists() and time.monotonic() < deadline:
                time.sleep(0.001)
            kill_tree(process.pid)
            break
    left = sorted(entry.name for entry in unfinished.glob("*")) if unfinished.exists() else None
    watchdog.cancel()
    output = "".join(lines) + (finish(process, timeout=30).stdout or "")  # what it printed before the kill landed
    assert line.startswith(trigger), f"no line {trigger!r}:\n{output[-3000:]}"
    return output, left


@pytest.mark.launch
@pytest.mark.long_job
def test_a_run_killed_during_or_between_background_writes_resumes_from_the_last_complete_snapshot(tmp_path):
    reference = run_ok(torchrun(2, ASYNC, *ARGS, "--checkpoint", tmp_path / "reference"), timeout=150).stdout
    path = tmp_path / "gpt"
    # a write just begun (nothing on disk yet); a snapshot just put in place; a write under way in PATH.tmp. Each run
    # resumes where the last one died
    moments = [("snapshot of step 3: ", False), (f"saved snapshot {path} (step 6)", False),
               ("snapshot of step 9: ", True)]
    outputs, left = zip(*(killed_at(path, trigger, mid_write) for trigger, mid_write in moments), strict=True)
    outputs += (run_ok(torchrun(2, ASYNC, *ARGS, "--checkpoint", path), timeout=150).stdout,)
    # the third kill found the snapshot of step 9 being written, not in place: the resume after it reads PATH (step 8
    # or before), and the last run ends on the uninterrupted run's weights
    assert left[2] is not None and "train_state.pt" not in left[2], left
    name = re.escape(str(path))
    for killed, resumed in zip(outputs, outputs[1:], strict=False):
        in_place = max(int(step) for step in re.findall(rf"saved snapshot {name} \(step (\d+)\)", killed))
        begun = max(int(step) for step in re.findall(r"snapshot of step (\d+): ", killed))
        # (PATH.prev: killed between its two renames, PATH.prev is the newest complete snapshot)
        (step,) = map(int, re.findall(rf"resumed from {name}(?:\.prev)?: step (\d+) of 14", resumed))
        # never one older than the last put in place, never one whose write had not begun (or not ended: the resume
        # reads every piece, and the final weights below would differ)
        assert in_place <= step <= begun, (in_place, step, begun, resumed[-2000:])
        assert "error" not in resumed.lower(), resumed[-3000:]
    assert checksum(outputs[-1]) == checksum(reference)
