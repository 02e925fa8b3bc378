"""Cluster preflight: can these nodes train together, and if not, why not? Run it before the first job.

Start it exactly like the training scripts; every process checks its own machine and reports to rank 0, and
rank 0 prints one report ending in a verdict (exit status 0: OK; 1: the nodes cannot train together):

  python preflight.py                                          # this machine alone (starts torchrun itself)
  torchrun --nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d --rdzv_endpoint=nodeA:29500 --rdzv_id=pre1 \
      --rdzv_conf=join_timeout=60 preflight.py                 # on nodeA and on nodeB alike
  sbatch slurm/preflight.sbatch                                # on Slurm

It never hangs: every wait is bounded by --timeout, and a rank that never arrives is named in the report.
Like the numbered scripts it imports nothing from this project, so it can be copied anywhere on its own.
"""
import argparse
import contextlib
import fcntl
import ipaddress
import json
import os
import socket
import statistics
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

POLL = 0.05  # seconds between looks at the store while waiting for other ranks


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--timeout", type=float, default=60,
                        help="seconds to wait for every rank to check in, and again for the network tests")
    parser.add_argument("--sizes-mb", default=None, help="all-reduce message sizes for the bandwidth test, in MB "
                        "(comma-separated; default 1,8,32 on CPU, 8,64,256 on GPU)")
    parser.add_argument("--iters", type=int, default=None, help="timed all-reduces per size (default 5 CPU, 20 GPU)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="without a launcher: processes to start on this machine (default: GPUs, or 2)")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    try:
        sizes = [float(size) for size in args.sizes_mb.split(",")] if args.sizes_mb else None
    except ValueError:
        parser.error(f"--sizes-mb {args.sizes_mb}: not a comma-separated list of numbers")
    if sizes is not None and min(sizes) <= 0:
        parser.error(f"--sizes-mb {args.sizes_mb}: sizes must be positive")
    args.sizes_mb = sizes
    for name in ("iters", "nproc"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    return args


# --- what one process can find out about its own machine, before talking to anybody ---------------------------

def interface_addresses():
    """{interface name: IPv4 address} for every interface that has one (Linux ioctl; stdlib only)."""
    addresses = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue  # no IPv4 address on this interface
            addresses[name] = socket.inet_ntoa(packed[20:24])
    return addresses


def link_state(interface):
    """'up' or 'down' (loopback and some virtual links report 'unknown' as their state: read the UP flag)."""
    try:
        with open(f"/sys/class/net/{interface}/operstate") as state:
            operstate = state.read().strip()
        with open(f"/sys/class/net/{interface}/flags") as flags:
            up = int(flags.read(), 16) & 1
    except (OSError, ValueError):
        return "unknown"
    return operstate if operstate != "unknown" else "up" if up else "down"


def is_loopback(address):
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def resolve(name):
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)})
    except OSError as error:
        return [f"unresolvable ({error.strerror or error})"]


def gloo_address(hostname, interfaces):
    """The address gloo binds to and announces to its peers, chosen the way PyTorch does: the interface named by
    GLOO_SOCKET_IFNAME; else the first address the hostname resolves to that can be bound here; else loopback."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        name = os.environ["GLOO_SOCKET_IFNAME"].split(",")[0]
        return interfaces.get(name, f"none: GLOO_SOCKET_IFNAME={name} has no IPv4 address here"), "GLOO_SOCKET_IFNAME"
    for address in resolve(hostname):
        try:
            with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as sock:
                sock.bind((address, 0))
            return address, "the hostname"
        except OSError:
            continue
    return "127.0.0.1", "loopback fallback: the hostname resolves to no local address"


def route_source(address):
    """The local address the kernel would send from to reach `address` (no packet is sent), or None."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((address, 9))
            return sock.getsockname()[0]
    except OSError:
        return None


def cpu_list(cpus):
    """{0, 1, 2, 5} -> '0-2,5'."""
    cpus, parts = sorted(cpus), []
    for cpu in cpus:
        if parts and cpu == parts[-1][1] + 1:
            parts[-1][1] = cpu
        else:
            parts.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


def cpu_affinity():
    """The CPUs this process may run on. macOS has no sched_getaffinity, nor any call that binds a process to
    chosen CPUs: there it may run on every CPU."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def local_facts(env):
    hostname = socket.gethostname()
    interfaces = interface_addresses()
    address, chosen_by = gloo_address(hostname, interfaces)
    name_of = {ip: name for name, ip in interfaces.items()}
    for name, ip in interfaces.items():  # all of 127.0.0.0/8 (127.0.1.1, ...) lives on the loopback interface
        if is_loopback(ip) and address not in name_of and is_loopback(address):
            name_of[address] = name
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "nccl" if gpus else "gloo"
    device = f"cuda:{env['local_rank']}" if gpus else "cpu"
    if gpus and env["local_rank"] < gpus:
        device += f" ({torch.cuda.get_device_name(env['local_rank'])})"
    try:
        shm = os.statvfs("/dev/shm")
        shm_bytes = shm.f_frsize * shm.f_blocks
    except OSError:
        shm_bytes = None
    store_source = route_source(env["master_addr"])
    return {
        "rank": env["rank"], "local_rank": env["local_rank"], "node": env["node"],
        "local_world_size": env["local_world_size"], "hostname": hostname, "resolves_to": resolve(hostname),
        "address": address, "address_chosen_by": chosen_by, "interface": name_of.get(address, "?"),
        "interface_state": link_state(name_of[address]) if address in name_of else "unknown",
        "interfaces": interfaces, "store_route": [store_source, name_of.get(store_source, "?")],
        "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "nccl_socket_ifname":
        os.environ.get("NCCL_SOCKET_IFNAME"), "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": sys.version.split()[0], "backend": backend, "device": device, "gpus": gpus,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "shm_bytes": shm_bytes,
        "affinity": cpu_list(cpu_affinity()), "affinity_count": len(cpu_affinity()),
        "cpus": os.cpu_count(),
    }


# --- meeting the others: the launcher's TCP store, with every wait bounded -------------------------------------

def launcher_environment():
    """Who this process is, from the launcher's variables (torchrun, or srun with the variables set by hand)."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    node = int(os.environ.get("GROUP_RANK", rank // local_world_size))
    return {"rank": rank, "world_size": world_size, "local_rank": local_rank, "local_world_size": local_world_size,
            "node": node, "master_addr": os.environ.get("MASTER_ADDR", "127.0.0.1"),
            "master_port": int(os.environ.get("MASTER_PORT", 29500))}


def connect_store(env, timeout):
    """torchrun's agent on the first node already serves a TCP store at MASTER_ADDR:MASTER_PORT; without
    torchrun, rank 0 serves it. Rank 0 does not wait for the others here: it waits for their reports below,
    where it can say who is missing."""
    serve = env["rank"] == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(env["master_addr"], env["master_port"], env["world_size"], is_master=serve,
                          timeout=timedelta(seconds=timeout), wait_for_workers=False, multi_tenant=serve)
    # a key prefix per torchrun attempt: a restarted attempt must not read the previous one's reports
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
    return dist.PrefixStore(f"preflight/{attempt}/", store)


def publish(store, key, value):
    store.set(key, json.dumps(value))


def collect(store, keys, deadline):
    """{key: value} for each of `keys` that appeared before `deadline`; the missing ones are simply absent. A
    store that went away (its host ended) ends the wait too: nothing more can arrive."""
    found = {}
    while True:
        try:
            for key in [key for key in keys if key not in found]:
                if store.check([key]):
                    found[key] = json.loads(store.get(key))
        except (RuntimeError, OSError):
            return found
        if len(found) == len(keys) or time.monotonic() > deadline:
            return found
        time.sleep(POLL)


# --- TCP reachability between nodes, before gloo or NCCL try -----------------------------------------------

def open_probe_listener(facts):
    """A TCP port that answers every connection with this node's token, so that a prober knows it reached
    this node and not whatever listens at that address where the prober is (a loopback address)."""
    facts["probe_token"] = f"{facts['hostname']}/{os.getpid()}/{time.time_ns()}"
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("", 0))  # every interface: the test is whether the peer's packets arrive, not where we bind
    listener.listen(64)

    def accept_forever():
        while True:
            connection, _ = listener.accept()
            with contextlib.suppress(OSError):
                connection.sendall(facts["probe_token"].encode())
            connection.close()

    threading.Thread(target=accept_forever, daemon=True).start()
    facts["probe_port"] = listener.getsockname()[1]
    return listener


def probe(address, port, token, timeout):
    began = time.monotonic()
    try:
        with socket.create_connection((address, port), timeout=timeout) as connection:
            milliseconds = (time.monotonic() - began) * 1e3
            answer = b""
            while chunk := connection.recv(256):
                answer += chunk
        if answer.decode(errors="replace") != token:
            return {"ok": False, "error": "reached a different process at that address, not that node"}
        return {"ok": True, "ms": milliseconds}
    except TimeoutError:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s (packets dropped: a firewall, or a link down)"}
    except OSError as error:
        return {"ok": False, "error": error.strerror or str(error)}


# --- the network, through the backend the training scripts use ---------------------------------------------

def network_tests(store, env, facts, plan):
    """Runs in a thread of its own so that a collective that never completes cannot hold the report."""
    backend, world_size, rank = plan["backend"], env["world_size"], env["rank"]
    device = torch.device(f"cuda:{env['local_rank']}" if backend == "nccl" else "cpu")
    began = time.monotonic()
    dist.init_process_group(backend, store=dist.PrefixStore("group/", store), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=2 * plan["timeout"]), device_id=device if
                            backend == "nccl" else None)
    result = {"init_s": time.monotonic() - began}
    sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)

    # correctness: known integers, exact in float32, checked on every rank
    values = torch.arange(4096, device=device, dtype=torch.float32) % 97
    total = values + rank
    dist.all_reduce(total)
    expected = values * world_size + world_size * (world_size - 1) / 2
    result["allreduce_ok"] = bool(torch.equal(total, expected))
    result["allreduce_max_error"] = float((total - expected).abs().max())

    # barrier latency, then clock offsets: each rank reads its clock right as a barrier releases everybody
    latencies, offsets = [], []
    for _ in range(20):
        start = time.perf_counter()
        dist.barrier(device_ids=[device.index] if backend == "nccl" else None)
        latencies.append(time.perf_counter() - start)
    for _ in range(5):
        clocks = torch.zeros(world_size, dtype=torch.float64, device=device)
        dist.barrier(device_ids=[device.index] if backend == "nccl" else None)
        clocks[rank] = time.time()
        dist.all_reduce(clocks)
        offsets.append(clocks[rank].item() - clocks[0].item())
    result["barrier_ms"] = statistics.median(latencies) * 1e3
    result["clock_offset_s"] = statistics.median(offsets)

    # bandwidth, nccl-tests' definitions: algbw = bytes / time; busbw = algbw * 2(n-1)/n for an all-reduce
    result["bandwidth"] = []
    for size_mb in plan["sizes_mb"]:
        tensor = torch.ones(int(size_mb * 1e6 / 4), dtype=torch.float32, device=device)
        for _ in range(2):  # warm-up: connections, buffers, NCCL channels
            dist.all_reduce(tensor)
        sync()
        start = time.perf_counter()
        for _ in range(plan["iters"]):
            dist.all_reduce(tensor)
        sync()
        seconds = torch.tensor([(time.perf_counter() - start) / plan["iters"]], device=device, dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank sets everybody's pace
        algbw = tensor.numel() * 4 / seconds.item() / 1e9
        result["bandwidth"].append({"mb": size_mb, "ms": seconds.item() * 1e3, "algbw": algbw,
                                    "busbw": algbw * 2 * (world_size - 1) / world_size})

    # every pair of nodes, node leader to node leader, pairs at once in round-robin rounds
    result["pairs"] = {}
    leaders = plan["leaders"]
    if len(leaders) > 2:
        tensor = torch.ones(int(plan["sizes_mb"][-1] * 1e6 / 4), dtype=torch.float32, device=device)
        for pairs in round_robin(list(range(len(leaders)))):
            dist.barrier(device_ids=[device.index] if backend == "nccl" else None)
            for a, b in pairs:
                if rank in (leaders[a], leaders[b]):
                    peer = leaders[b] if rank == leaders[a] else leaders[a]
                    result["pairs"][f"{min(a, b)}-{max(a, b)}"] = time_pair(tensor, rank, peer, leaders[a], sync)
    return result


def round_robin(nodes):
    """Rounds of disjoint pairs covering every pair once (the circle method)."""
    if len(nodes) % 2:
        nodes = [*nodes, None]
    rounds = []
    for _ in range(len(nodes) - 1):
        half = len(nodes) // 2
        rounds.append([(a, b) for a, b in zip(nodes[:half], reversed(nodes[half:]), strict=True)
                       if a is not None and b is not None])
        nodes = [nodes[0], nodes[-1], *nodes[1:-1]]
    return rounds


def time_pair(tensor, rank, peer, first, sync, repeats=3):
    """GB/s from `first` to the other and back (a ping-pong of `tensor`), seen by this rank."""
    start = time.perf_counter()
    for _ in range(repeats):
        if rank == first:
            dist.send(tensor, peer)
            dist.recv(tensor, peer)
        else:
            dist.recv(tensor, peer)
            dist.send(tensor, peer)
    sync()
    return 2 * repeats * tensor.numel() * 4 / (time.perf_counter() - start) / 1e9


def run_bounded(function, seconds, *args):
    """function(*args) in a daemon thread: its result, or {'error': ...} if it raised or did not finish."""
    outcome = {"error": f"did not finish within {seconds:.0f} s: a peer it was waiting for never answered"}

    def target():
        try:
            outcome.clear()
            outcome.update(function(*args))
        except Exception as error:  # noqa: BLE001 - every failure is reported, none may kill the report
            outcome.clear()
            outcome["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    return dict(outcome) if not thread.is_alive() else {
        "error": f"did not finish within {seconds:.0f} s: a peer it was waiting for never answered"}


# --- rank 0: the plan, then the report ----------------------------------------------------------------------

def make_plan(args, env, facts):
    """What the network tests need to know, decided once by rank 0 from every rank's facts."""
    leaders = sorted(rank for rank, fact in facts.items() if fact["local_rank"] == 0)
    backends = {fact["backend"] for fact in facts.values()}
    gpu = backends == {"nccl"}
    blocked = len(facts) < env["world_size"] or len(backends) > 1 or any(
        fact["backend"] == "nccl" and fact["local_rank"] >= fact["gpus"] for fact in facts.values())
    return {"run": not blocked, "backend": backends.pop() if len(backends) == 1 else None,
            "leaders": leaders, "timeout": args.timeout,
            "sizes_mb": args.sizes_mb or ([8, 64, 256] if gpu else [1, 8, 32]),
            "iters": args.iters or (20 if gpu else 5),
            "probes": {str(leader): [facts[leader]["address"], facts[leader]["probe_port"],
                                     facts[leader]["hostname"], facts[leader]["probe_token"]] for leader in leaders}}


def size(nbytes):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024


class Report:
    """Lines of the report, plus the problems (the nodes cannot train together) and warnings (they can)."""

    def __init__(self):
        self.lines, self.problems, self.warnings = [], [], []

    def __call__(self, line=""):
        self.lines.append(line)

    def problem(self, tag, text, fix):
        self.problems.append(f"PROBLEM [{tag}] {text}\n    fix: {fix}")

    def warning(self, tag, text, fix):
        self.warnings.append(f"warning [{tag}] {text}\n    fix: {fix}")


def first_of_each_node(facts):
    """One rank's facts per node (its lowest rank), in node order: what is the same for the whole machine."""
    first = {}
    for rank in sorted(facts, reverse=True):
        first[facts[rank]["node"]] = facts[rank]
    return [first[node] for node in sorted(first)]


def node_name(facts, node):
    hosts = sorted({fact["hostname"] for fact in facts.values() if fact["node"] == node})
    return "/".join(hosts) if hosts else f"node {node}"


def report_who(say, env, facts):
    nodes = sorted({fact["node"] for fact in facts.values()})
    say(f"== who is where: {len(facts)} of {env['world_size']} ranks checked in, from {len(nodes)} node(s)")
    say(f"  {'rank':>4} {'node':>4} {'local':>5}  {'host':<20} {'device':<28} cpus")
    for rank in sorted(facts):
        fact = facts[rank]
        say(f"  {rank:>4} {fact['node']:>4} {fact['local_rank']:>5}  {fact['hostname']:<20} {fact['device']:<28} "
            f"{fact['affinity']}")


def check_missing(report, env, facts):
    missing = sorted(set(range(env["world_size"])) - set(facts))
    if not missing:
        return
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", 0))  # torchrun's count of nodes (agents)
    uneven = len({fact["local_world_size"] for fact in facts.values()}) > 1 or \
        (nodes and nodes * env["local_world_size"] != env["world_size"])  # a node of another count reported nothing
    if uneven:  # rank // count would name the wrong node
        report.problem("missing", f"rank(s) {','.join(map(str, missing))} never checked in within the timeout (the "
                       "nodes run different numbers of processes, so their node cannot be told from their rank)",
                       "start the same command on every node, with the same --nproc_per_node, and read the output "
                       "of the nodes that did not report")
        return
    per_node = env["local_world_size"]  # launchers number ranks node by node
    by_node = {}
    for rank in missing:
        by_node.setdefault(rank // per_node, []).append(rank)
    # The launcher numbers nodes in the order they joined, so a node that never came has no name here; a
    # list of the hosts that should have come (the sbatch file passes Slurm's) names it.
    expected = os.environ.get("PREFLIGHT_EXPECTED_HOSTS", "").split()
    absent = sorted(set(expected) - {fact["hostname"] for fact in facts.values()})
    wholly_missing = sum(len(ranks) == per_node for ranks in by_node.values())
    for node, ranks in sorted(by_node.items()):
        whole = len(ranks) == per_node
        if whole and absent:
            name = absent[0] if len(absent) == wholly_missing == 1 else f"(one of {', '.join(absent)})"
        else:
            name = node_name(facts, node)
        report.problem("missing", f"{'node' if whole else 'on node'} {name} "
                       f"(node {node}): rank(s) {','.join(map(str, ranks))} never checked in within the timeout",
                       "start the same command on that node; if it was started, read its own output: it could "
                       f"not reach the rendezvous store at {env['master_addr']}:{env['master_port']} "
                       "(name resolution, firewall) or crashed before checking in (Python or torch missing there)")


# What must be the same on every node: (fact, the report's tag, what it is)
SAME_EVERYWHERE = (("local_world_size", "nproc-per-node", "processes per node (--nproc_per_node)"),
                   ("torch", "torch-version", "torch version"), ("backend", "backend", "backend"),
                   ("python", "python-version", "Python version"))


def check_same_everywhere(report, facts):
    nodes = {fact["node"]: fact for fact in first_of_each_node(facts)}
    for key, flag, what in SAME_EVERYWHERE:
        seen = {}
        for node, fact in sorted(nodes.items()):
            seen.setdefault(fact[key], []).append(f"{fact['hostname']} (node {node})")
        if len(seen) > 1:
            fix = {"nproc-per-node": "use one command for every node (same --nproc_per_node), e.g. the sbatch file",
                   "backend": "every node needs the same kind of device: GPUs visible to PyTorch on all nodes, or "
                   "on none (check drivers, CUDA_VISIBLE_DEVICES, a CPU-only torch build)"}.get(
                       flag, "install the same environment on every node (one shared venv, or one container image)")
            text = "; ".join(f"{value} on {', '.join(where)}" for value, where in seen.items())
            if flag == "nproc-per-node":  # torchrun accepts it: ranks are numbered node after node, and counted
                report.warning(flag, f"different {what}: {text}. torchrun accepts this (WORLD_SIZE is their sum) "
                               "and the steps train, but code that assumes one count on every node breaks: a node "
                               "index computed as RANK // LOCAL_WORLD_SIZE, WORLD_SIZE taken as nodes x processes, a "
                               "2-D device mesh (nodes x processes, as HSDP builds)", fix)
            elif flag == "python-version":
                report.warning(flag, f"different {what}: {text}", fix)
            else:
                report.problem(flag, f"different {what}: {text}", fix)
    return {key: {fact[key] for fact in nodes.values()} for key in ("local_world_size", "torch", "backend")}


def probes_to(rank, probes):
    """{prober rank: result} of the TCP probes that tried to reach node leader `rank`."""
    return {int(key.split(">")[0]): result for key, result in probes.items() if int(key.split(">")[1]) == rank}


def report_names(report, say, env, facts, probes):
    nodes = first_of_each_node(facts)
    several = len(nodes) > 1
    say(f"== name resolution (rendezvous store: {env['master_addr']}:{env['master_port']})")
    for fact in nodes:
        say(f"  {fact['hostname']}: resolves to {', '.join(fact['resolves_to'])}; advertises {fact['address']} "
            f"(via {fact['address_chosen_by']}); reaches the store from {fact['store_route'][0]} "
            f"({fact['store_route'][1]})")
        tried = probes_to(fact["rank"], probes)
        unreached = {facts[r]["hostname"]: result["error"] for r, result in tried.items() if not result["ok"]}
        if several and is_loopback(fact["address"]) and tried and not unreached:
            say(f"    ({fact['address']} is a loopback address, yet every other node reached it there: these "
                "nodes share one machine's network, as on the local Slurm cluster)")
        elif several and is_loopback(fact["address"]):
            report.problem("loopback", f"{fact['hostname']} advertises {fact['address']}, a loopback address "
                           f"({fact['hostname']} resolves to {', '.join(fact['resolves_to'])}): on every other "
                           "node that address means that node itself, so connections to it from there fail ("
                           + "; ".join(f"{host} tried: {error}" for host, error in unreached.items()) + "). Whether "
                           "a job then fails depends on which side opens each connection: it may start on one "
                           "layout and fail on the next",
                           f"on {fact['hostname']}, map its name to the address the nodes share in /etc/hosts "
                           f"(not 127.0.x.x), or name the shared interface: GLOO_SOCKET_IFNAME=<if> (CPU) / "
                           f"NCCL_SOCKET_IFNAME=<if> (GPU), and torchrun --local_addr=<its address> "
                           f"(interfaces there: {', '.join(f'{k} {v}' for k, v in fact['interfaces'].items())})")
        elif several and any(is_loopback(address) for address in fact["resolves_to"]):
            report.warning("loopback", f"{fact['hostname']} resolves to {', '.join(fact['resolves_to'])}; gloo is "
                           f"steered to {fact['address']} by GLOO_SOCKET_IFNAME, but a torchrun agent on this node "
                           "hosting the rendezvous would still advertise the loopback name",
                           "fix /etc/hosts on that node, or pass torchrun --local_addr=<its address>")
        if fact["address"].startswith("none"):
            report.problem("interface", f"{fact['hostname']}: {fact['address']}",
                           f"name an interface that exists there ({', '.join(fact['interfaces'])})")


def report_network(report, say, env, facts, plan, probes, results):
    say("== network")
    backend = plan["backend"] or "/".join(sorted({f["backend"] for f in facts.values()}))
    for fact in first_of_each_node(facts):
        nccl = fact["nccl_socket_ifname"] or "unset: NCCL picks one itself, skipping lo and docker*"
        say(f"  {fact['hostname']}: gloo uses {fact['interface']} ({fact['address']}, link {fact['interface_state']});"
            f" NCCL_SOCKET_IFNAME {nccl}")
    for key, result in sorted(probes.items()):
        source, target = (int(part) for part in key.split(">"))
        names = facts[source]["hostname"], plan["probes"][str(target)][2]
        address, port = plan["probes"][str(target)][:2]
        if result["ok"]:
            say(f"  TCP {names[0]} -> {names[1]} ({address}:{port}): connected in {result['ms']:.1f} ms")
        else:
            say(f"  TCP {names[0]} -> {names[1]} ({address}:{port}): FAILED, {result['error']}")
        if not result["ok"] and not is_loopback(address):  # a loopback address is its own problem, above
            report.problem("connect", f"{names[0]} cannot open a TCP connection to {names[1]} at {address}:{port}: "
                           f"{result['error']}", "gloo and NCCL connect between all nodes on ephemeral ports, not "
                           "only the rendezvous port: allow TCP between the nodes (firewall, cloud security group), "
                           "check the link of the interface named above (ip -br link), or name a shared interface "
                           "with GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME")
    if not plan["run"]:
        say(f"  {backend} tests not run: the ranks above cannot form a process group")
        return
    failed = {rank: result["error"] for rank, result in results.items() if "error" in result}
    absent = sorted(set(facts) - set(results))
    for rank, error in sorted(failed.items()):
        say(f"  rank {rank} ({facts[rank]['hostname']}): {backend} FAILED: {error}")
    if failed or absent:
        who = ", ".join(f"rank {rank} ({facts[rank]['hostname']})" for rank in sorted([*failed, *absent]))
        report.problem("process-group", f"the {backend} process group or its collectives failed on {who}",
                       "the cause is in the lines above (a loopback address, a failed TCP connection); also try "
                       "TORCH_LOGS=distributed, and NCCL_DEBUG=INFO on GPUs")
        return
    wrong = [rank for rank, result in results.items() if not result["allreduce_ok"]]
    say(f"  all-reduce correctness (known values, every rank): "
        f"{'OK on all ' + str(len(results)) + ' ranks' if not wrong else 'WRONG on ranks ' + str(wrong)}")
    if wrong:
        report.problem("allreduce", f"all-reduce returned wrong values on ranks {wrong} (max error "
                       f"{max(results[r]['allreduce_max_error'] for r in wrong)})",
                       "a broken transport: try NCCL_P2P_DISABLE=1 / NCCL_IB_DISABLE=1 to find which; "
                       "check GPU health (nvidia-smi -q) and driver versions")
    first = results[0]
    say(f"  init {first['init_s']:.2f} s; barrier latency {first['barrier_ms']:.3f} ms (median of 20)")
    say(f"  all-reduce bandwidth ({backend}, {env['world_size']} ranks; algbw = size / time, busbw = algbw x "
        f"2(n-1)/n, as nccl-tests; time of the slowest rank, mean of {plan['iters']}):")
    say(f"    {'size':>10} {'time ms':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for row in first["bandwidth"]:
        say(f"    {row['mb']:>7g} MB {row['ms']:>10.2f} {row['algbw']:>11.3f} {row['busbw']:>11.3f}")
    pairs = {key: value for result in results.values() for key, value in result["pairs"].items()}
    names = {node: node_name(facts, node) for node in {f["node"] for f in facts.values()}}
    if pairs:
        ordered = sorted(pairs.items(), key=lambda item: item[1])
        say(f"  node pairs, ping-pong of {plan['sizes_mb'][-1]:g} MB between node leaders (GB/s): " + ", ".join(
            f"{names[int(k.split('-')[0])]}<->{names[int(k.split('-')[1])]} {v:.3f}" for k, v in ordered))
        (slowest, speed), median = ordered[0], statistics.median(pairs.values())
        a, b = (names[int(part)] for part in slowest.split("-"))
        say(f"  slowest pair of nodes: {a} <-> {b}, {speed:.3f} GB/s (median pair {median:.3f} GB/s)")
        if speed < median / 2:
            report.warning("slow-pair", f"{a} <-> {b} is less than half as fast as the median pair",
                           "check that pair's links and switch ports; every step waits for the slowest link")
    else:
        say(f"  slowest pair of nodes: not measured ({len(names)} node(s): with two or fewer, the all-reduce "
            "above is that pair)")


def report_machine(report, say, facts, results):
    say("== machines")
    for fact in first_of_each_node(facts):
        node = fact["node"]
        ranks = [f for f in facts.values() if f["node"] == node]
        offset = max((abs(results[f["rank"]]["clock_offset_s"]) for f in ranks if "clock_offset_s" in
                      results.get(f["rank"], {})), default=None)
        visible = fact["cuda_visible_devices"]
        say(f"  {fact['hostname']}: {fact['gpus']} GPU(s) visible to PyTorch (CUDA_VISIBLE_DEVICES="
            f"{visible if visible is not None else 'unset'}) for {fact['local_world_size']} process(es); /dev/shm "
            f"{size(fact['shm_bytes']) if fact['shm_bytes'] else 'missing'}; {fact['cpus']} CPUs; "
            f"clock offset vs rank 0 {'not measured' if offset is None else f'{offset * 1e3:.1f} ms'}")
        where = f"{fact['hostname']} (node {node})"
        if fact["gpus"] and fact["local_world_size"] > fact["gpus"]:
            report.problem("gpus", f"{where}: {fact['local_world_size']} processes but {fact['gpus']} GPU(s) "
                           "visible: some processes have no GPU of their own",
                           f"--nproc_per_node={fact['gpus']} (one process per GPU), or make more GPUs visible "
                           "(CUDA_VISIBLE_DEVICES; with srun, --gpu-bind=none)")
        elif fact["gpus"] > fact["local_world_size"]:
            report.warning("gpus", f"{where}: {fact['gpus']} GPUs visible, {fact['local_world_size']} processes: "
                           f"{fact['gpus'] - fact['local_world_size']} GPU(s) idle",
                           f"--nproc_per_node={fact['gpus']}")
        if visible and not fact["gpus"]:
            report.warning("no-gpu", f"{where}: CUDA_VISIBLE_DEVICES={visible} but PyTorch sees no GPU: it runs "
                           "on the CPU (gloo)", "check the driver (nvidia-smi) and that torch is a CUDA build "
                           "(python -c 'import torch; print(torch.version.cuda)')")
        if fact["shm_bytes"] is not None and fact["shm_bytes"] < 1 << 30:
            report.warning("shm", f"{where}: /dev/shm is {size(fact['shm_bytes'])}: DataLoader workers and NCCL "
                           "share memory through it and die with 'Bus error' when it is full",
                           "in Docker: --shm-size=16g or --ipc=host; in Kubernetes: an emptyDir with medium Memory "
                           "at /dev/shm")
        sharing = {}
        for f in ranks:
            sharing.setdefault((f["affinity"], f["affinity_count"]), []).append(f["rank"])
        for (cpus, count), together in sharing.items():
            if len(together) > count:
                report.warning("affinity", f"{where}: ranks {together} are all pinned to CPU(s) {cpus}: "
                               f"{len(together)} processes on {count} core(s)", "give each process its own cores "
                               "(srun --cpus-per-task, a wider cgroup, or no CPU binding)")
        if offset is not None and offset > 1:
            report.warning("clock", f"{where}: clock {offset:.1f} s off rank 0's: logs and timestamps disagree",
                           "run NTP/chrony on every node")


def build_report(args, env, facts, plan, probes, results):
    report = Report()
    say = report
    say(f"ddp-steps preflight: {env['world_size']} ranks expected, {env['local_world_size']} per node on node 0")
    report_who(say, env, facts)
    check_missing(report, env, facts)
    same = check_same_everywhere(report, facts)
    differ = any(len(values) > 1 for values in same.values())
    say(f"  same on every node: --nproc_per_node {' and '.join(map(str, sorted(same['local_world_size'])))}, torch "
        f"{' and '.join(sorted(same['torch']))}, backend {' and '.join(sorted(same['backend']))}"
        + (" (not the same: see below)" if differ else ""))
    report_names(report, say, env, facts, probes)
    report_network(report, say, env, facts, plan, probes, results)
    report_machine(report, say, facts, results)
    if report.problems:
        say(f"== verdict: NOT OK, {len(report.problems)} problem(s): these nodes cannot train together")
    else:
        counts = sorted(same["local_world_size"])
        each = f"x {counts[0]} process(es)" if len(counts) == 1 else \
            f"({' and '.join(map(str, counts))} processes per node, {len(facts)} in all)"
        say(f"== verdict: OK, {len({f['node'] for f in facts.values()})} node(s) {each} can train together"
            + (f" ({len(report.warnings)} warning(s))" if report.warnings else ""))
    say("\n".join(report.problems + report.warnings))
    return "\n".join(line for line in report.lines if line), not report.problems


# --- one process's part ---------------------------------------------------------------------------------------

def relaunch_with_torchrun(args):
    """`python preflight.py`: check this one machine, with one process per GPU (or 2 on CPU)."""
    nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 0) or 2
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               os.path.abspath(__file__), *sys.argv[1:]]
    print(f"no launcher: checking this machine alone, {nproc} processes: torchrun --standalone "
          f"--nproc_per_node={nproc} {sys.argv[0]}", flush=True)
    os.execv(sys.executable, command)


def main(args):
    env = launcher_environment()
    rank, timeout = env["rank"], args.timeout
    torch.set_num_threads(1)  # the tests measure the network, not the CPU; and leave the cores to the others
    tag = f"[{socket.gethostname()}] rank {rank}"
    facts = local_facts(env)
    if facts["backend"] == "nccl" and env["local_rank"] < facts["gpus"]:
        torch.cuda.set_device(env["local_rank"])
    try:
        store = connect_store(env, timeout)
    except Exception as error:  # noqa: BLE001
        print(f"{tag}: PROBLEM [store] cannot reach the rendezvous store at {env['master_addr']}:"
              f"{env['master_port']} within {timeout:.0f} s ({type(error).__name__}: {str(error).splitlines()[0]})."
              f"\n    fix: check that {env['master_addr']} resolves here to the first node's address "
              f"(getent hosts {env['master_addr']}) and that its port is open", flush=True)
        return 1
    if env["local_rank"] == 0:
        open_probe_listener(facts)
    publish(store, f"facts/{rank}", facts)

    if rank == 0:
        keys = [f"facts/{r}" for r in range(env["world_size"])]
        found = collect(store, keys, time.monotonic() + timeout)
        facts_of = {int(key.split("/")[1]): value for key, value in found.items()}
        plan = make_plan(args, env, facts_of)
        publish(store, "plan", plan)
    else:
        plan = collect(store, ["plan"], time.monotonic() + 2 * timeout + 10).get("plan")
        if plan is None:
            print(f"{tag}: PROBLEM [missing] rank 0 never published its plan: it is gone", flush=True)
            return 1

    planned = time.monotonic()
    if env["local_rank"] == 0:  # node leaders try a plain TCP connection to every other node's leader
        targets = {f"{rank}>{leader}": (address, port, token) for leader, (address, port, _, token)
                   in plan["probes"].items() if int(leader) != rank}
        with ThreadPoolExecutor(max(1, len(targets))) as pool:
            tried = {key: pool.submit(probe, *target, min(5.0, timeout / 3)) for key, target in targets.items()}
        publish(store, f"probes/{rank}", {key: future.result() for key, future in tried.items()})
    result = run_bounded(network_tests, timeout, store, env, facts, plan) if plan["run"] else {}
    publish(store, f"network/{rank}", result)

    if rank != 0:
        verdict = collect(store, ["verdict"], time.monotonic() + timeout + 30).get("verdict")
        status = "" if verdict is None else "OK" if verdict == 0 else "NOT OK"
        print(f"{tag} (node {env['node']}, local rank {env['local_rank']}): reported to rank 0; verdict "
              f"{status or 'never came: rank 0 is gone'}", flush=True)
        return 1 if verdict is None else verdict

    leaders = [int(leader) for leader in plan["probes"]]
    probes = {}
    for value in collect(store, [f"probes/{leader}" for leader in leaders], time.monotonic() + timeout).values():
        probes.update(value)
    # every rank's network tests end by `planned + timeout` (probes take at most 5 s more): wait that long
    found = collect(store, [f"network/{r}" for r in facts_of], planned + timeout + 10) if plan["run"] else {}
    results = {int(key.split("/")[1]): value for key, value in found.items()}
    text, ok = build_report(args, env, facts_of, plan, probes, results)
    print(text, flush=True)
    publish(store, "verdict", 0 if ok else 1)
    time.sleep(1)  # let the others read the verdict before this process, maybe the store's host, goes
    return 0 if ok else 1


if __name__ == "__main__":
    arguments = parse_args()
    if "RANK" not in os.environ:
        relaunch_with_torchrun(arguments)
    code = main(arguments)
    sys.stdout.flush()
    # Leave at once: a process group whose peer is gone can hang or abort in its teardown; nothing is left to do.
    os._exit(code)
