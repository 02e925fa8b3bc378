"""The link classes of benchmarks/shaped_link.py and how a link is shaped: a token bucket (`tc qdisc ... tbf`) on
the sending side of each end of the veth pair that joins the two namespace hosts. Each direction is shaped by
the end it leaves from, so both directions get the rate, as on a full-duplex network port.

Only bandwidth can be shaped here: this kernel has `tbf` and `htb` but not `netem`, so latency cannot be added
(the veth pair's own round trip is what every link class has: an all-reduce of one number through gloo took
144-459 us in the published run, benchmarks/shaped_link.json, torch 2.14.1).
"""
import subprocess

# name -> tbf rate (None: not shaped). Why these rates: what decides whether communication or computation sets
# a step's time is the machine balance, FLOP per second of one node / bytes per second of its link. One rank
# here (one CPU core) computes ~10-40 GFLOP/s on these models (shaped_link.py measures and prints it); the
# rates below give it the balance of real GPU clusters (docs/scaling.md):
LINKS = {
    "unlimited": None,  # the bare veth pair, limited by how fast the CPU copies (0.4-14 Gbit/s point to point
    # in the published run): faster, for its compute, than any real cluster
    "datacenter": "50mbit",  # ~6,400 FLOP/B at 40 GFLOP/s: 8 GPUs per node, a 200-400 Gbit/s NIC per GPU
    "slow": "10mbit",  # ~32,000 FLOP/B: 8 GPUs sharing about 250 Gbit/s (two or three 100 Gbit/s Ethernet ports)
}


def bits_per_second(rate):
    """'50mbit' -> 50e6 (tc's units: kbit, mbit, gbit)."""
    for unit, factor in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * factor
    raise ValueError(f"unknown rate {rate!r} (use kbit, mbit or gbit)")


def tc(device, *arguments, netns=None, check=True):
    prefix = ["ip", "netns", "exec", netns] if netns else []
    return subprocess.run([*prefix, "tc", "qdisc", *arguments[:1], "dev", device, *arguments[1:]],
                          capture_output=True, text=True, timeout=30, check=check)


def shape(device, rate, netns=None):
    """Limits what leaves `device` to `rate` (None: removes the limit). The bucket holds 2 ms at the rate (at
    least 16 kB): a bigger one would let a whole small all-reduce through at the unshaped speed. The queue
    holds 200 ms: a shorter one drops the bursts TCP sends and the link then carries less than its rate."""
    if rate is None:
        unshape(device, netns)
        return
    burst = max(16_000, int(bits_per_second(rate) / 8 * 0.002))
    tc(device, "replace", "root", "tbf", "rate", rate, "burst", str(burst), "latency", "200ms", netns=netns)


def unshape(device, netns=None):
    """Removes the limit; no error if there is none."""
    tc(device, "del", "root", netns=netns, check=False)


def qdisc(device, netns=None):
    """What `tc qdisc show` says about `device` (its first line)."""
    return tc(device, "show", netns=netns).stdout.splitlines()[0]
