"""04_fault_tolerant.py loses nothing: four workers killed at random steps in one run, a writer killed mid-write, a
truncated snapshot, SIGTERM and SIGUSR1 all end with exactly the parameters of a run that was never interrupted
(bitwise: CPU, gloo, same seed), and the loader's workers draw alike on a resume. A resume that would change what
the run computes is refused; one that changes only how it runs goes on. (A malicious snapshot, refused with its code
never run: tests/test_refused_input.py.)"""
import contextlib
import io
import os
import random
import re
import signal
import time

import psutil
import pytest
import torch
from helpers import TORCHRUN, clean_env, finish, ignored_signals, load_script, start

pytestmark = pytest.mark.faults

SCRIPT = "04_fault_tolerant.py"
TRAIN_SAMPLES = 1024  # 16 steps per epoch of 2 x 32 samples
TRAIN = ["--train-samples", str(TRAIN_SAMPLES), "--val-samples", "64", "--epochs", "2", "--batch-size", "32",
         "--save-every-steps", "4"]


def command(snapshot, max_restarts=0, *extra):
    """The README's fault-tolerance command, with tiny settings."""
    return [TORCHRUN, "--standalone", "--nproc_per_node=2", f"--max-restarts={max_restarts}", SCRIPT, *TRAIN,
            "--checkpoint", snapshot, *extra]


def environment(shared_store=False, **extra):
    """The documented launch sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; shared_store=True leaves it out, to
    prove the script's own fallback."""
    return clean_env(**({} if shared_store else {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}), **extra)


def launch(tmp_path, name, cmd, env=None):
    with open(tmp_path / f"{name}.log", "w") as log:  # the child keeps its own copy of the file descriptor
        return start(cmd, env=env or environment(), output=log), tmp_path / f"{name}.log"


def wait(process, log, timeout=240):
    result = finish(process, timeout, log)
    return result.returncode, log.read_text()


def left_behind(mark, timeout=10):
    """The processes started with TEST_MARK=mark in their environment still alive after `timeout` s (then killed): a
    run must leave none. A loader worker that ignores SIGTERM outlives its rank unless the rank kills it, and keeps
    its fork server alive too (each worker holds the fork server's "a client is alive" pipe, multiprocessing's
    popen_forkserver.py), each waiting for the other forever."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if process.environ().get("TEST_MARK") == mark:
                    alive.append((process, " ".join(process.cmdline())[:120]))
        if not alive or time.monotonic() > deadline:
            for process, _ in alive:
                with contextlib.suppress(psutil.Error):
                    process.kill()
            return [command for _, command in alive]
        time.sleep(0.2)


def checksums(output):
    return set(re.findall(r"rank \d done: parameter checksum ([-+.\deE]+)", output))


def workers(agent):
    """The agent's training processes (not the agent, not DataLoader workers)."""
    return [p for p in psutil.Process(agent.pid).children(recursive=True)
            if SCRIPT in " ".join(p.cmdline()) and p.parent().pid == agent.pid]


def wait_for_new_snapshot(path, after, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_mtime_ns > after:
            return path.stat().st_mtime_ns
        time.sleep(0.05)
    raise AssertionError(f"no new snapshot at {path} within {timeout} s")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run: its final checksum and final snapshot, and the one before it."""
    folder = tmp_path_factory.mktemp("reference")
    code, output = wait(*launch(folder, "reference", command(folder / "snapshot.pt")))
    assert code == 0, output[-3000:]
    (checksum,) = checksums(output)
    return checksum, folder


def final_model(path):
    return torch.load(path, weights_only=True)["model"]


def assert_same_as_reference(reference, output, snapshot):
    checksum, folder = reference
    assert checksums(output) == {checksum}
    expected, got = final_model(folder / "snapshot.pt"), final_model(snapshot)
    assert all(torch.equal(expected[key], got[key]) for key in expected), "bitwise equal to the uninterrupted run"


def test_killing_the_writer_mid_write_keeps_the_previous_snapshot(reference, tmp_path):
    snapshot = tmp_path / "snapshot.pt"
    # snapshots at the epochs' ends only, each write held 1.5 s: the first, the killed one (the run's last), and the
    # restart's
    agent, log = launch(tmp_path, "run", command(snapshot, 1, "--save-every-steps", "1000"),
                        environment(SNAPSHOT_WRITE_DELAY="1.5"))
    wait_for_new_snapshot(snapshot, 0)
    deadline = time.monotonic() + 60
    while not (tmp_path / "snapshot.pt.tmp").exists():  # the next write has begun and is paused
        assert time.monotonic() < deadline
        time.sleep(0.02)
    before = snapshot.read_bytes()
    writer = next(p for p in workers(agent) if "RANK" in p.environ() and p.environ()["RANK"] == "0")
    writer.kill()
    assert snapshot.read_bytes() == before, "the complete previous snapshot is untouched"
    torch.load(snapshot, weights_only=True)
    code, output = wait(agent, log)
    assert code == 0, output[-3000:]
    assert "resumed from" in output
    assert_same_as_reference(reference, output, snapshot)


def test_a_truncated_newest_snapshot_falls_back_to_the_previous_with_a_warning(reference, tmp_path):
    _, folder = reference
    snapshot = tmp_path / "snapshot.pt"
    good = (folder / "snapshot.pt.prev").read_bytes()  # the reference's last-but-one snapshot
    (tmp_path / "snapshot.pt.prev").write_bytes(good)
    snapshot.write_bytes((folder / "snapshot.pt").read_bytes()[:5000])  # a crash mid-copy, say
    code, output = wait(*launch(tmp_path, "run", command(snapshot)))
    assert code == 0, output[-3000:]
    assert f"warning: snapshot {snapshot} is unusable" in output
    assert "resumed from" in output
    assert_same_as_reference(reference, output, snapshot)


def assert_loader_workers_ignore_stop_signals(agent):
    """Every process below the ranks (each rank's DataLoader workers and the fork server they come from) ignores
    both stop signals, by the kernel's own record: they must not die first (a worker watches its parent)."""
    below = [process for rank in psutil.Process(agent.pid).children() for process in rank.children(recursive=True)]
    assert len(below) >= 2 * 2, [process.cmdline() for process in below]  # each rank's training loader workers
    for process in below:  # (a worker just started may take a moment to reach ignore_stop_signals)
        deadline = time.monotonic() + 10
        while not {signal.SIGTERM, signal.SIGUSR1} <= ignored_signals(process.pid) and process.is_running():
            assert time.monotonic() < deadline, process.cmdline()
            time.sleep(0.1)


def assert_stopped_with_a_snapshot(output, snapshot):
    stopped = re.search(r"stopped by a signal in epoch (\d+), (\d+) samples in", output)
    assert stopped, output[-3000:]
    epoch, samples = map(int, stopped.groups())
    assert f"saved snapshot {snapshot} (epoch {epoch - 1}, +{samples} samples)" in output, "saved at the stop"
    return epoch


# The loader's workers, recorded: a sitecustomize.py, imported at start-up by every Python interpreter of a run
# (PYTHONPATH), the fork server included, so the workers it forks have it too. A wrapper around DataLoader.__init__
# makes each loader's workers append their rank, set size and base seed to SEED_LOG; the callable is an instance of
# a module-level class, which pickle sends as the class's name plus its fields. The script is run unchanged.
RECORD_WORKER_SEEDS = """
import os
import torch.utils.data as data


class Record:
    def __init__(self, size, then):
        self.size, self.then = size, then

    def __call__(self, worker_id):
        with open(os.environ["SEED_LOG"], "a") as log:
            log.write(f"{os.environ['RANK']} {self.size} {data.get_worker_info().seed - worker_id}\\n")
        if self.then:
            self.then(worker_id)


original = data.DataLoader.__init__


def init(self, dataset, *args, **options):
    original(self, dataset, *args, **{**options, "worker_init_fn": Record(len(dataset), options.get("worker_init_fn"))})


data.DataLoader.__init__ = init
"""


def worker_seeds(log):
    """{rank: [base seed of each training loader, in the order they started]}: the training set has TRAIN_SAMPLES
    samples (a rank's validation shard fewer); a loader's workers share one base seed (each adds its id)."""
    seeds = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        rank, size, seed = map(int, line.split())
        if size == TRAIN_SAMPLES and seed not in seeds.setdefault(rank, []):
            seeds[rank].append(seed)
    return seeds


def test_two_preemption_signals_each_save_a_snapshot_and_the_reruns_resume(reference, tmp_path):
    """A job preempted twice: SIGTERM to torchrun (which forwards it to the workers) in epoch 1; in the rerun, once
    epoch 1 is done, SIGUSR1 to every process (workers and their loaders alike, as Slurm's scancel --signal sends
    it). Each stop saves a snapshot, and the last rerun ends bitwise equal to the uninterrupted run. With DataLoader
    workers (--num-workers 2) that get the signal too, and TensorBoard: a stop leaves by os._exit, which runs no
    clean-up, so the writer is closed before it, and the file holds every finished epoch's scalars.

    The loader's workers, recorded (RECORD_WORKER_SEEDS): augmentation would run in them, seeded from the loader's
    generator, which 04 seeds from (seed, epoch, rank). The 2 ranks x 2 epochs draw 4 different base seeds, and a
    run resumed mid-epoch draws that epoch's seeds again: the rerun's epoch 1 those of the first run, which began
    it; the last run's epoch 2 those of the rerun, which began it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    snapshot, board = tmp_path / "snapshot.pt", tmp_path / "tb"
    (tmp_path / "sitecustomize.py").write_text(RECORD_WORKER_SEEDS)
    run = command(snapshot, 0, "--num-workers", "2", "--tensorboard", board)

    def recorded(name):
        return environment(SEED_LOG=tmp_path / f"{name}.seeds", PYTHONPATH=tmp_path)

    agent, log = launch(tmp_path, "first", run, recorded("first"))
    wait_for_new_snapshot(snapshot, wait_for_new_snapshot(snapshot, 0))
    assert_loader_workers_ignore_stop_signals(agent)
    os.kill(agent.pid, signal.SIGTERM)  # torchrun forwards TERM to its workers
    _, output = wait(agent, log)
    assert assert_stopped_with_a_snapshot(output, snapshot) == 1

    agent, log = launch(tmp_path, "second", run, recorded("second"))
    deadline = time.monotonic() + 120
    # then stop in epoch 2, once both ranks' epoch-2 loaders have started their workers (recorded)
    while "epoch 1/2" not in log.read_text() or [len(seeds) for _, seeds in sorted(
            worker_seeds(tmp_path / "second.seeds").items())] != [2, 2]:
        assert agent.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    assert_loader_workers_ignore_stop_signals(agent)
    for process in psutil.Process(agent.pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # ended since it was listed (a loader's worker): no signal
            process.send_signal(signal.SIGUSR1)
    code, output = wait(agent, log)
    assert code == 0, "a stop on a signal is not a failure"
    assert "resumed from" in output and assert_stopped_with_a_snapshot(output, snapshot) == 2
    steps = [event.step for event in EventAccumulator(str(board)).Reload().Scalars("val_loss")]
    assert steps == [1], "every finished epoch's scalars, on disk"

    code, output = wait(*launch(tmp_path, "third", run, recorded("third")))
    assert code == 0, output[-3000:]
    assert "resumed from" in output
    assert_same_as_reference(reference, output, snapshot)

    first, second, third = (worker_seeds(tmp_path / f"{name}.seeds") for name in ("first", "second", "third"))
    assert sorted(second) == [0, 1] and all(len(seeds) == 2 for seeds in second.values()), second  # epochs 1, 2
    assert len({seed for seeds in second.values() for seed in seeds}) == 4, "per rank and per epoch: " + str(second)
    assert first == {rank: seeds[:1] for rank, seeds in second.items()}, (first, second)  # epoch 1, resumed
    assert third == {rank: seeds[1:] for rank, seeds in second.items()}, (third, second)  # epoch 2, resumed


KILLS = 4


def test_four_kill_9s_at_random_steps_in_one_run_each_resume_to_identical_parameters(reference, tmp_path):
    """kill -9 of a random worker at a random step, four times in a row in one run: each restart resumes from the
    last snapshot, and the run ends bitwise equal to the uninterrupted one. A snapshot every step, each write held
    0.1 s (SNAPSHOT_WRITE_DELAY), and each kill a random, seeded 0-50 ms after the first snapshot since the last
    (re)start: the steps since it are lost and redone, and each restart moves the run on by one or two of its 32
    steps on any CPU, so the kills always fit. On torchrun's shared rendezvous store (no
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE): the script's per-attempt prefix is what keeps each restart clean. Four
    kills, not more: each restart is the same claim again (restarts in a row, a random rank, a random step), and a
    longer soak is tools/repeat_test.py's."""
    snapshot, rng = tmp_path / "snapshot.pt", random.Random(0)
    agent, log = launch(tmp_path, "run", command(snapshot, 10, "--save-every-steps", "1"),
                        environment(shared_store=True, SNAPSHOT_WRITE_DELAY="0.1"))
    for kill in range(KILLS):
        deadline = time.monotonic() + 90
        while "saved snapshot" not in log.read_text().rsplit("resumed from", 1)[-1]:  # since the last (re)start
            assert agent.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no snapshot after restart {kill} within 90 s"
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.05))
        rng.choice(workers(agent)).kill()
        # the next kill waits for the restart: a rank still writing when its peer died would otherwise give
        # a "new" snapshot at once, and the kill would hit a dying worker instead of a restarted one
        deadline = time.monotonic() + 90
        while log.read_text().count("resumed from") <= kill:
            assert agent.poll() is None, log.read_text()[-3000:]  # the agent gave up: say why, at once
            assert time.monotonic() < deadline, f"no restart {kill + 1} within 90 s"
            time.sleep(0.05)
    code, output = wait(agent, log, timeout=300)
    assert code == 0, output[-3000:]
    assert output.count("resumed from") == KILLS
    assert_same_as_reference(reference, output, snapshot)


# --- a resume with other flags: what must not change is refused, the rest follows the command -----------------

# Per flag of 04's argparse: does a resume refuse a new value (True), or take it from the command (False)?
# Refused: what the snapshot's run computes (its model, data, seed, learning rate and schedule length, batch per
# process, accumulation, precision; --lr is taken with --allow-new-lr, tests/test_divergence.py). Taken: how and
# where it runs. The world size is not a flag: elastic.
RESUME_REFUSES = {"--epochs": ("3", True), "--seed": ("5", True), "--lr": ("0.1", True), "--batch-size": ("16", True),
                  "--grad-accum": ("2", True), "--model": ("resnet18", True), "--data": ("images", True),
                  "--train-samples": ("4096", True), "--amp": (None, True),
                  "--val-samples": ("32", False), "--data-dir": ("elsewhere", False), "--download": (None, False),
                  "--device": ("cpu", False), "--num-workers": ("2", False), "--save-every": ("2", False),
                  "--save-every-steps": ("10", False), "--compile": (None, False), "--tensorboard": ("tb", False),
                  "--metrics": ("m.jsonl", False), "--timeout": ("60", False), "--allow-new-lr": (None, False)}


def test_every_flag_has_a_resume_rule():
    module = load_script(SCRIPT)
    everything = {"--" + name.replace("_", "-") for name in vars(module.parse_args([]))}
    assert everything - set(RESUME_REFUSES) == {"--checkpoint", "--evaluate"}  # the snapshot itself; not a run


@pytest.mark.parametrize("flag", RESUME_REFUSES)
def test_a_resume_refuses_or_follows_each_flag(flag, tmp_path):
    """In-process: the script's own load_snapshot, given a snapshot saved by a run with the default flags."""
    module, snapshot = load_script(SCRIPT), tmp_path / "snapshot.pt"
    value, refused = RESUME_REFUSES[flag]
    saved = vars(module.parse_args(["--checkpoint", str(snapshot)]))
    torch.save({"model_name": "cnn", "num_classes": 10, "optimizer": {}, "args": saved}, snapshot)
    args = module.parse_args(["--checkpoint", str(snapshot), flag, *([value] if value else [])])
    with contextlib.redirect_stdout(io.StringIO()):
        if refused:
            with pytest.raises(SystemExit) as stop:
                module.load_snapshot(args, "cpu", 10)
            name = flag[2:].replace("-", "_")
            expected = (f"a resume cannot change {flag} {getattr(args, name)} (snapshot: {saved[name]}); repeat the "
                        "snapshot's values, or give another --checkpoint path to start afresh")
            if flag == "--lr":  # the way out after a divergence (tests/test_divergence.py)
                expected += " (or, after a divergence, add --allow-new-lr)"
            if flag == "--model":  # refused by the older check of the model and class count, before this one
                expected = "not a snapshot of --model resnet18 with 10 classes; give another path to start over"
            assert stop.value.code == f"error: --checkpoint {snapshot}: {expected}"
        else:
            _, followed = module.load_snapshot(args, "cpu", 10)
            assert [line.split(" (snapshot")[0].split()[0] for line in followed] == [flag]


def test_a_resume_with_other_epochs_and_seed_is_refused_naming_both(tmp_path):
    """In-process: the finished reference run's flags (2 epochs, seed 0) resumed with --epochs 3 --seed 5 (its
    restored schedule would keep its old length, on data reshuffled for another model): one line names both. That
    every rank refuses before any step under torchrun, in one line and no traceback, and leaves the snapshot:
    tests/test_refused_input.py's test_04_refuses_a_damaged_snapshot_on_every_rank_before_any_step_and_leaves_it."""
    module, snapshot = load_script(SCRIPT), tmp_path / "snapshot.pt"
    saved = vars(module.parse_args([*map(str, TRAIN), "--checkpoint", str(snapshot)]))
    torch.save({"model_name": "cnn", "num_classes": 10, "optimizer": {}, "args": saved}, snapshot)
    args = module.parse_args([*map(str, TRAIN), "--checkpoint", str(snapshot), "--epochs", "3", "--seed", "5"])
    with pytest.raises(SystemExit) as stop, contextlib.redirect_stdout(io.StringIO()):
        module.load_snapshot(args, "cpu", 10)
    assert stop.value.code == (f"error: --checkpoint {snapshot}: a resume cannot change --epochs 3 (snapshot: 2), "
                               "--seed 5 (snapshot: 0); repeat the snapshot's values, or give another --checkpoint "
                               "path to start afresh")


def test_a_resume_on_another_world_size_with_other_workers_goes_on_and_says_so(reference, tmp_path):
    checksum, folder = reference
    snapshot = tmp_path / "snapshot.pt"
    snapshot.write_bytes((folder / "snapshot.pt").read_bytes())
    run = [TORCHRUN, "--standalone", "--nproc_per_node=1", "--max-restarts=0", SCRIPT, *TRAIN, "--checkpoint", snapshot,
           "--num-workers", "2"]
    code, output = wait(*launch(tmp_path, "run", run), timeout=120)
    assert code == 0, output[-3000:]
    assert (f"resumed from {snapshot}: epoch 3, 0 samples into it; world size 2 then, 1 now; from this command: "
            f"--num-workers 2 (snapshot: 0), --checkpoint {snapshot} (snapshot: {folder / 'snapshot.pt'})") in output
    assert checksums(output) == {checksum}
