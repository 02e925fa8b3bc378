"""port/gpt_stream.py: the port reading its training windows from shard files keeps its promises. The stream holds
every window of every shard once per epoch; split by rank and by loader worker it hands each rank exactly its
share, in order, and a stream started at a position hands out what the uninterrupted one did from there (bitwise).
Launched: two ranks cross epochs whose window count the global batch does not divide and end together; a run
stopped by SIGTERM mid-way (its loader workers ignore it) and resumed with another number of loader workers ends on
the bits of the uninterrupted one.
port/make_shards.py cuts a text into the checked-in shards without losing or adding a byte.

Tiny settings: shards the tests make (port/make_shards.py applied to test_port's text), a one-block model."""
import argparse
import multiprocessing
import os
import re
import shutil
import signal
import time

import pytest
import torch
from helpers import REPO, load_script, run_ok, torchrun
from test_port import PORTED_BATCH, TINY, make_text, rank_lines

STREAM = "port/gpt_stream.py"
BLOCK = 16  # TINY's --block-size


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """make_shards.py's cut of test_port's text into 5 shards (of uneven sizes), and a second folder of 4 tiny
    shards, one too short for a window, of 27 windows in all, with the same held-out part: with micro-batches of 4
    windows (2 on each of 2 ranks), 3 epoch ends in 4 fall inside one."""
    folder = tmp_path_factory.mktemp("stream")
    text = make_text(folder / "text.txt")
    load_script("port/make_shards.py").main([str(text), "--out", str(folder / "shards"), "--shards", "5"])
    tiny = folder / "tiny"
    tiny.mkdir()
    for k, size in enumerate((BLOCK + 4, BLOCK + 8, BLOCK + 15, BLOCK - 6)):
        (tiny / f"train_{k:05d}.bin").write_bytes(text.read_bytes()[1000 * k:][:size])
    (tiny / "val.bin").write_bytes((folder / "shards" / "val.bin").read_bytes())
    return folder / "shards", tiny


def read_windows(stream, folder, indices):
    """What the windows at these stream indices hold, block_size + 1 bytes each, read from the files by the test."""
    shards = sorted(folder.glob("train_*.bin"))
    counts = tuple(max(0, path.stat().st_size - BLOCK) for path in shards)
    rows = []
    for index in indices:
        shard, start = stream.window_at(index, counts, 0)
        rows.append(list(shards[shard].read_bytes()[start:start + BLOCK + 1]))
    return torch.tensor(rows, dtype=torch.uint8)


def test_the_stream_holds_every_window_once_per_epoch_in_an_order_that_changes_each_epoch(shards):
    stream = load_script(STREAM)
    sizes = [path.stat().st_size for path in sorted(shards[0].glob("train_*.bin"))]
    counts = tuple(size - BLOCK for size in sizes)
    assert len(set(sizes)) == len(sizes)  # uneven shards
    every = sorted((shard, start) for shard, count in enumerate(counts) for start in range(count))
    epochs = [[stream.window_at(index, counts, 0) for index in range(epoch * len(every), (epoch + 1) * len(every))]
              for epoch in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == every
    assert epochs[0] != epochs[1]


def test_each_rank_and_loader_worker_reads_its_share_in_order_and_a_stream_resumed_at_a_position_reads_the_rest(
        shards):
    """Two ranks, each with a DataLoader of two workers (forked here; the script's fork server starts them another
    way, the split is the same): rank r's micro-batch j is windows j x 6 + r, j x 6 + r + 2, j x 6 + r + 4 of the
    stream (batch 3 per rank), bitwise, over the tiny shards' 5 epochs of 27 windows (2 of its 4 epoch ends inside a
    micro-batch; a shard too short for a window); a stream made at the position of micro-batch 5 continues it
    exactly. Each batch is copied out of the shared memory it came in: a kept batch holds a file descriptor open
    (torch's default sharing strategy), and a few thousand kept would meet "Too many open files"."""
    stream, folder = load_script(STREAM), shards[1]
    args = argparse.Namespace(batch_size=3, block_size=BLOCK, seed=0)
    paths = [str(path) for path in sorted(folder.glob("train_*.bin"))]
    sizes = [(folder / path).stat().st_size for path in paths]
    micro_batches = 5 * 27 // 6
    fork = multiprocessing.get_context("fork")

    def loaded(rank, position, count):
        loader = torch.utils.data.DataLoader(stream.ShardStream(paths, sizes, args, position, rank, 2),
                                             batch_size=None, num_workers=2, multiprocessing_context=fork)
        batches = iter(loader)
        return [next(batches).clone() for _ in range(count)]

    for rank in range(2):
        got = loaded(rank, 0, micro_batches)
        for j, windows in enumerate(got):
            assert torch.equal(windows, read_windows(stream, folder, range(6 * j + rank, 6 * (j + 1), 2))), (rank, j)
        resumed = loaded(rank, 5 * 6, micro_batches - 5)
        assert all(torch.equal(old, new) for old, new in zip(got[5:], resumed, strict=True))


def test_make_shards_cuts_a_text_into_shards_and_a_held_out_part_without_losing_a_byte(tmp_path):
    """And the checked-in shards are its cut of the built-in text: 90 % in 8 training shards, each but the last
    ending at a line's end, the last 10 % (gpt_ddp.py's held-out bytes) in val.bin."""
    text = (REPO / "port/data/ddp_steps_prose.txt").read_bytes()
    load_script("port/make_shards.py").main(["--out", str(tmp_path)])
    made = sorted(tmp_path.iterdir())
    assert [path.name for path in made] == [*(f"train_{k:05d}.bin" for k in range(8)), "val.bin"]
    assert b"".join(path.read_bytes() for path in made) == text
    assert (tmp_path / "val.bin").read_bytes() == text[len(text) * 9 // 10:]
    assert all(path.read_bytes().endswith(b"\n") for path in made[:-2])
    for path in made:
        assert (REPO / "port/data/shards" / path.name).read_bytes() == path.read_bytes(), path.name


def test_make_shards_cuts_where_a_stretch_holds_no_newline_refuses_too_few_bytes_and_deletes_only_its_files(tmp_path):
    shards = load_script("port/make_shards.py")
    assert [len(piece) for piece in shards.cut(b"x" * 1000, 4)[0]] == [225, 225, 225, 225]  # no empty shard
    assert [len(piece) for piece in shards.cut(b"a" * 500 + b"\n" + b"b" * 400, 4)[0]] == [202, 203, 96, 309]
    (tmp_path / "tiny.txt").write_bytes(b"abc")
    with pytest.raises(SystemExit, match="^error: .*tiny.txt: 3 bytes are too few for --shards 8$"):
        shards.main([str(tmp_path / "tiny.txt"), "--out", str(tmp_path / "out")])
    out = tmp_path / "out"
    out.mkdir()
    for name in ("train_00009.bin", "val.bin", "other.bin"):
        (out / name).write_bytes(b"old")
    (tmp_path / "text.txt").write_bytes(b"line\n" * 100)
    shards.main([str(tmp_path / "text.txt"), "--out", str(out), "--shards", "2"])
    assert sorted(path.name for path in out.iterdir()) == ["other.bin", "train_00000.bin", "train_00001.bin",
                                                           "val.bin"]


@pytest.mark.parametrize("case", ["no folder", "a file", "no val.bin", "too few windows"])
def test_a_missing_or_too_small_shard_folder_is_refused_in_one_line(shards, tmp_path, case, capsys):
    stream = load_script(STREAM)
    if case in ("no folder", "a file"):
        path = tmp_path / "shards" if case == "no folder" else shards[0] / "train_00000.bin"
        with pytest.raises(SystemExit):
            stream.parse_args(["--data", str(path)])
        said = "no such folder" if case == "no folder" else "a file, not a folder of shards"
        assert capsys.readouterr().err.splitlines()[-1].endswith(f"--data {path}: {said}" + (
            "" if case == "no folder" else " (port/make_shards.py makes one from a text)"))
        return
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "train_00000.bin").write_bytes(b"x" * (BLOCK + 7))
    if case == "no val.bin":
        match = f"^error: --data {folder}: No such file or directory: {folder / 'val.bin'}$"
    else:
        (folder / "val.bin").write_bytes(b"y" * 100)
        match = (f"^error: --data {folder}: 1 train_\\*.bin shards with 7 windows of --block-size 16 and 100 held-out "
                 "bytes are too few for a global batch of 8 windows")
    with pytest.raises(SystemExit, match=match):
        stream.open_shards(stream.parse_args(["--data", str(folder), "--block-size", "16", "--batch-size", "4"]),
                           processes=2)


@pytest.mark.launch
@pytest.mark.long_job
def test_ranks_end_uneven_epochs_together_and_a_run_stopped_by_sigterm_resumes_with_other_workers_bitwise(
        shards, tmp_path):
    """27 windows an epoch, 4 a micro-batch: the ranks share out the stream over 150 steps (44 epochs, 3 ends in 4
    inside a micro-batch) and both end (equal weights; no loader workers). The same run with 2 a rank, whose workers and
    fork servers ignore the stop signals (the kernel's record), gets SIGTERM to torchrun mid-run, as Slurm's stop
    sends it: each rank saves and stops at the end of its step; the same command with no workers resumes from the
    snapshot's position and ends bitwise where the uninterrupted run ended."""
    from test_fault_tolerance import assert_loader_workers_ignore_stop_signals, launch, wait

    common = [*TINY, "--data", shards[1], *PORTED_BATCH, "--steps", 150, "--eval-every", 1000, "--save-every-steps",
              1000]
    whole, stopped = tmp_path / "whole.pt", tmp_path / "stopped.pt"
    output = run_ok(torchrun(2, STREAM, *common, "--checkpoint", whole, "--num-workers", 0), timeout=120).stdout
    assert "85 training bytes in 4 shards" in output
    lines = rank_lines(output)
    assert set(lines) == {0, 1} and lines[0] == lines[1] and lines[0][1] == "150"

    agent, log = launch(tmp_path, "stopped", torchrun(2, STREAM, *common, "--checkpoint", stopped, "--num-workers", 2))
    deadline = time.monotonic() + 90
    while "step 2/150" not in log.read_text():
        assert agent.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    assert_loader_workers_ignore_stop_signals(agent)
    os.kill(agent.pid, signal.SIGTERM)  # torchrun sends it on to each rank's process group
    _, first = wait(agent, log)
    stop = re.search(r"stopped after step (\d+); the same command resumes from there", first)
    assert stop and 2 <= int(stop[1]) < 150, first[-3000:]  # (torchrun prints a traceback of its own signal)
    assert f"saved snapshot {stopped} (step {stop[1]})" in first and "DataLoader worker" not in first, first[-3000:]
    second = run_ok(torchrun(2, STREAM, *common, "--checkpoint", stopped, "--num-workers", 0), timeout=120).stdout
    assert f"resumed from {stopped}: step {stop[1]} of 150" in second
    resumed, uninterrupted = (torch.load(path, weights_only=True) for path in (stopped, whole))
    assert resumed["step"] == uninterrupted["step"] == 150 and resumed["position"] == uninterrupted["position"] == 1200
    for name, value in uninterrupted["model"].items():
        assert torch.equal(resumed["model"][name], value), name


def test_the_streamed_port_and_its_shard_maker_are_standalone():
    for script in (STREAM, "port/make_shards.py"):
        source = (REPO / script).read_text()
        assert not re.search(r"^(from|import) (lessons|helpers|port)\b", source, re.M), script


@pytest.mark.launch
@pytest.mark.long_job
def test_a_rank_that_raises_with_loader_workers_leaves_at_once_with_the_error(shards, tmp_path):
    """The loader workers ignore SIGTERM, which Python's exit sends them before it waits for them: a rank that
    raised would wait there forever. Every shard cut short mid-run: the workers' error reaches both ranks, each
    prints it and leaves, and torchrun reports the failure, within seconds, not at a timeout; no worker and no fork
    server is left running."""
    from test_fault_tolerance import environment, launch, left_behind, wait

    folder = tmp_path / "shards"
    shutil.copytree(shards[1], folder)
    agent, log = launch(tmp_path, "cut", torchrun(2, STREAM, *TINY, "--data", folder, *PORTED_BATCH, "--steps", 150,
                                                 "--num-workers", 2), env=environment(TEST_MARK=tmp_path.name))
    deadline = time.monotonic() + 90
    while "step 2/150" not in log.read_text():
        assert agent.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    for shard in folder.glob("train_*.bin"):
        shard.write_bytes(b"")
    began = time.monotonic()
    code, output = wait(agent, log, timeout=60)
    assert code != 0 and time.monotonic() - began < 30, output[-3000:]
    assert "is shorter than when the run began" in output and "exitcode  : 1" in output, output[-3000:]
    assert left_behind(tmp_path.name) == []  # no loader worker, no fork server
