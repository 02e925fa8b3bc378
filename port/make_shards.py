"""Cuts a text into the shard files port/gpt_stream.py reads: train_00000.bin ... (its first 90 %) and val.bin (the
last 10 %, the bytes gpt_ddp.py holds out of the same text). The tokens are the bytes, so a shard is the text's bytes
as they are: a corpus prepared once, read by every run.

    python port/make_shards.py                                   # the built-in text into port/data/shards
    python port/make_shards.py my.txt --out my_shards --shards 64

Each shard but the last ends at the last line's end before its share of the bytes runs out (or at that point, in
a stretch with no newline), so the shards differ in size, as real ones do. An existing folder's train_*.bin and
val.bin are replaced.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def cut(text, shards):
    """The training part (the first 90 %) in `shards` pieces ending at a newline where there is one, and the rest."""
    split = len(text) * 9 // 10
    train, pieces, first = text[:split], [], 0
    for k in range(1, shards + 1):
        share = len(train) * k // shards  # where this piece would end if pieces were equal
        newline = train.rfind(b"\n", first, share)
        end = len(train) if k == shards else newline + 1 if newline >= first else share
        pieces.append(train[first:end])
        first = end
    return pieces, text[split:]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], usage=argparse.SUPPRESS,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("text", nargs="?", default=os.path.join(HERE, "data", "ddp_steps_prose.txt"))
    parser.add_argument("--out", default=os.path.join(HERE, "data", "shards"), help="the folder to write")
    parser.add_argument("--shards", type=int, default=8, help="training shard files")
    args = parser.parse_args(argv)
    if args.shards < 1:
        parser.error(f"--shards must be at least 1, got {args.shards}")
    try:
        with open(args.text, "rb") as f:
            text = f.read()
        pieces, val = cut(text, args.shards)
        if not all(pieces):
            sys.exit(f"error: {args.text}: {len(text)} bytes are too few for --shards {args.shards}")
        os.makedirs(args.out, exist_ok=True)
        for name in os.listdir(args.out):
            if name == "val.bin" or name.startswith("train_") and name.endswith(".bin"):
                os.remove(os.path.join(args.out, name))
        for name, data in [*((f"train_{k:05d}.bin", piece) for k, piece in enumerate(pieces)), ("val.bin", val)]:
            with open(os.path.join(args.out, name), "wb") as f:
                f.write(data)
    except OSError as error:
        sys.exit(f"error: {error.filename}: {error.strerror or error}")
    print(f"{args.out}: {len(pieces)} training shards of {min(map(len, pieces))} to {max(map(len, pieces))} bytes, "
          f"val.bin of {len(val)}")


if __name__ == "__main__":
    main()
