"""Writes diffs/NN_name.diff: each numbered script against the one before it, the tutorial's lessons; and
diffs/port_gpt.diff: port/gpt_single.py against port/gpt_ddp.py, the ladder's steps applied to another model; and
diffs/port_gpt_fsdp.diff: port/gpt_ddp.py against port/gpt_fsdp.py, step 05 (FSDP2) applied to it; and
diffs/port_gpt_stream.diff: port/gpt_ddp.py against port/gpt_stream.py, its data read as a stream of shard files; and
diffs/port_gpt_timed.diff: port/gpt_ddp.py against port/gpt_timed.py, each rank's step split in computing, waiting and
communicating, and profiler traces; and diffs/port_gpt_async.diff: port/gpt_fsdp.py against port/gpt_async.py, its
snapshots written while training goes on; and diffs/port_gpt_tp.diff: port/gpt_fsdp.py against port/gpt_tp.py,
tensor parallelism on a 2-D mesh; and diffs/port_gpt_zero.diff: port/gpt_ddp.py against port/gpt_zero.py, ZeRO-1;
and diffs/port_gpt_pp.diff: port/gpt_ddp.py against port/gpt_pp.py, pipeline stages.

    python tools/make_diffs.py            # regenerate diffs/
    python tools/make_diffs.py --check    # fail if diffs/ is stale or a step is over its budget (CI)

A step's size is the number of lines it adds to the previous script. The budgets below are the one place
they are kept: a step that grows past its budget is teaching more than one thing, or the scripts' shared
parts have drifted apart.
"""
import difflib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DIFFS = REPO / "diffs"
BUDGET = {  # lines added by each step
    "01_mp_spawn.py": 84,  # aimed at 60; preparing the data once costs 7, checking inputs 1, CPU affinity 1,
    # the ranks agreeing on a diverged loss 3, checking OMP_NUM_THREADS 1, a stopped process's one line 3, what
    # mp.spawn runs: main, then an exit without Python's shutdown (gloo's threads outlive the group: SIGABRT) 8
    "02_torchrun.py": 30,
    "03_multinode.py": 40,
    "04_fault_tolerant.py": 194,  # 150, then nothing lost to a diverged run (--allow-new-lr, no non-finite
    # snapshot) 24, loader workers seeded per rank and epoch 4, rank 0's GPU RNG state set on each rank's GPU 1, damaged
    # snapshots named with what is wrong in the one refusal line, the fallback's warning once it has worked 5,
    # TensorBoard's writer closed on a stop by a signal 2, the loaders' fork server started deaf to the stop signals 5,
    # and its workers killed at Python's exit after a failure, which would otherwise wait for them forever 3
    "05_fsdp.py": 140,  # FSDP2 for DDP 15, sharded snapshots (DCP) and the whole-model file 50, the rest: every rank
    # runs as many forwards (evaluate), a resume that keeps the global batch on another world size, an old gloo refused;
    # 120: a snapshot's index and pieces checked before a resume reads them 3, a piece damaged inside refused in one
    # line 3 (less 1: `import warnings` is now in every step); 123: its loader workers' fork server preloads DCP and
    # FSDP too 3; 140: built on the meta device, each rank allocating only its pieces, filled from rank 0's whole
    # build (set_model_state_dict, broadcast_from_rank0) 12, of which its import wrapped on four lines 5; rank 0's
    # random state, which its build advanced, sent to every rank 3; a model that cannot be built there refused 2
}
# Other pairs of scripts: (before, after) -> (diff file, budget of added lines). The port's budget: what the
# ladder's steps 01-04 add to a script, plus what a real run needs on top (clipping after the all-reduce, exact
# metrics, the loss check every rank agrees on, one text for all ranks), a comment naming the step on each line.
PAIRS = {
    # 140, not 125: the port lesson's review put a barrier on both failing and stopping exits, a rank-local failure path
    # for an unreadable snapshot, and one check that every rank resumes the same snapshot on the same world size
    # 141: leaving without Python's shutdown (gloo's threads outlive the group: a SIGABRT at exit) costs 4 lines;
    # a shorter comment and docstring gave 3 back
    # 143: the model FLOPs utilisation over every device's peak (2)
    ("port/gpt_single.py", "port/gpt_ddp.py"): ("port_gpt.diff", 143),
    # 202: the port sharded (FSDP2), each added statement saying "fsdp:": the meta-device build, one unit per block and
    # the tied root, rank 0's weights sent to all; MixedPrecisionPolicy, activation checkpointing, HSDP's mesh and their
    # flags; clipping with the whole model's norm; as many forwards on every rank; DCP snapshots and their resume on
    # another world size; the plain file gpt_single.py resumes from; the imports (the state-dict ones wrapped by ruff);
    # the mesh in the first log line; after an expert read, the all-reduce's mean checked too, PATH.prev named in the
    # refusal and the resume line, the export's line saying which flags gpt_single.py takes; after a newcomer's read,
    # why batch_size is not in SAME_ON_RESUME, and the memory gradient accumulation holds; 202: the loss as one mean
    # over the step's targets on every rank, with --pad-up-to making the ranks' counts differ (27, its docstring line);
    # 209: --compile, each block compiled in place before fully_shard (its flag 3, the call 2, the docstring 1, the
    # first log line 1)
    ("port/gpt_ddp.py", "port/gpt_fsdp.py"): ("port_gpt_fsdp.diff", 209),
    # 119: the training windows read from shard files by loader workers, each added statement saying "stream:": the
    # docstring and imports 16, the folder and --num-workers flags and their refusals 12, the folder's sizes, held-out
    # bytes and digest, the stream's order from the sizes alone and the IterableDataset split by rank and worker 76,
    # the loader made and read 8, the first log line and two messages 6, gc before leaving 1
    # 141, after an expert read: the stop signals ignored by the fork server and the loader workers, as in 04 (a worker
    # killed by the signal left the rank unable to reach the end of its step) 16, the digest's limits and a shard's
    # order in memory said 4, the windows sent as bytes and split after the copy 2
    # 148, after a second read: a rank that raises leaves at once (6; Python's exit would wait forever for loader
    # workers that ignore SIGTERM), a docstring line 1; 150: it kills them first (2: each would otherwise live on,
    # and keep the fork server alive, each waiting for the other)
    ("port/gpt_ddp.py", "port/gpt_stream.py"): ("port_gpt_stream.diff", 150),
    # 98: the docstring (what the split is and is not, how to run it), --timings and --profile, the split's arithmetic,
    # the comm hook noting each bucket's hand-over and end, the clocks and the profiler in the loop, the log line and
    # the file; each added statement saying "timed:"
    ("port/gpt_ddp.py", "port/gpt_timed.py"): ("port_gpt_timed.diff", 98),
    # 64: the docstring (what is copied while training waits, what the thread costs, what is written after, the marker
    # moved last), the flag, one function that puts a written snapshot in place (used both ways), the background
    # save and its end, the writing thread's gloo group (wrapped, to give it --timeout), the poll, the call and its
    # logged wait, the waits before leaving
    ("port/gpt_fsdp.py", "port/gpt_async.py"): ("port_gpt_async.diff", 64),
    # 116, after an expert read: gpt_fsdp.py's snapshot refused in its own words 3, the clipping's comment 3.
    # 110: the docstring (the 2-D grid, what is split how, what is not built) 16, the imports 3, --tp and its
    # refusals 7, q, k and v as three matrices and the forward on this process's heads 9, the validation's and the
    # median's windows by row 8, whole logits for validation and sampling 5, the export's qkv joined again 14, the
    # global batch counted in rows on a resume 5, the grid and the plan (blocks by heads, the tied matrix by
    # vocabulary, tied again) 20, rows in the data, padding and dropout seeds 8, the loss on split logits 6, the norm
    # over two meshes 10
    ("port/gpt_fsdp.py", "port/gpt_tp.py"): ("port_gpt_tp.diff", 118),
    # 25: the docstring (what ZeRO-1 splits and what it does not, the snapshot's collective), the import, the optimizer
    # and what each process keeps, the snapshot gathered on rank 0 by every process, each process's share logged
    ("port/gpt_ddp.py", "port/gpt_zero.py"): ("port_gpt_zero.diff", 25),
    # 179: the tied copies' group given --timeout 1. 178, after an expert read: the whole snapshot freed 1, all the
    # logits not kept 1, the blocks per stage logged 2, the fp16 refusal said as a choice 1. 173: the docstring 11, the
    # import 1, --schedule and --grad-accum's default 5, the refusals (too few blocks, 1F1B with too few micro-batches,
    # fp16) 8, the forward of a stage 6, cutting the model 17, AdamW's state by name between a stage and the whole
    # (snapshots stay gpt_ddp.py's files) 30, one forward through the stages by send and recv for validation and
    # sampling 13 (replacing the gathered median), validation's two numbers from the last stage 6, sampling's byte from
    # it 6, the stage, the schedule and the tied copies' group 13, one batch for all stages and the schedule's step 11,
    # the tied copies' gradients summed and the norm over the stages 9, the loss, checks and checksum from the stages
    # 14, the rest comments and one-liners
    ("port/gpt_ddp.py", "port/gpt_pp.py"): ("port_gpt_pp.diff", 179),
}


def steps():
    """(previous script, script) pairs, in order."""
    scripts = sorted(path.name for path in REPO.glob("[0-9][0-9]_*.py"))
    return list(zip(scripts, scripts[1:], strict=False))


def render(previous, script):
    old, new = ((REPO / name).read_text().splitlines(keepends=True) for name in (previous, script))
    return "".join(difflib.unified_diff(old, new, previous, script))


def added_lines(diff):
    return sum(line.startswith("+") and not line.startswith("+++") for line in diff.splitlines())


def main(check):
    problems = []
    DIFFS.mkdir(exist_ok=True)
    pairs = [(previous, script, script.replace(".py", ".diff"), BUDGET[script]) for previous, script in steps()]
    for previous, script, name, budget in pairs + [(*pair, *target) for pair, target in PAIRS.items()]:
        diff, target = render(previous, script), DIFFS / name
        if added_lines(diff) > budget:
            problems.append(f"{script} adds {added_lines(diff)} lines to {previous}; budget {budget}")
        if check and (not target.exists() or target.read_text() != diff):
            problems.append(f"{target.relative_to(REPO)} is stale: run python tools/make_diffs.py")
        elif not check:
            target.write_text(diff)
        print(f"{previous} -> {script}: {added_lines(diff)} lines added (budget {budget})")
    for problem in problems:
        print("error:", problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(check="--check" in sys.argv[1:]))
