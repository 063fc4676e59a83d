"""Control-plane benchmark: what do N heartbeating nodes cost the coordinator?

Starts a real `tessera-coordinator serve` subprocess, then simulates N nodes in this one
process over real gRPC: each registers (real Ed25519 challenge/response), attaches, and
heartbeats, with the nodes' schedules spread evenly over the interval.
The coordinator's CPU time is read from the OS (psutil, /proc), never estimated.

The simulated nodes speak what `tessera-node` speaks (AttachHello.keepalive_pings): their
connections carry HTTP/2 keepalive pings both ways, so the coordinator acks only state
changes, and asks for a heartbeat with telemetry only every few intervals
(Welcome.telemetry_interval_ms); in between, its pings, answered by gRPC's core, prove each
node alive. Every node has its own TCP connection, and so its own pings, as separate
machines would. `--legacy-acks` simulates older agents instead: a heartbeat every interval,
each acked. After the measurement the coordinator's own node list must show every node
online and recently heard from.

"CPU per heartbeat" is the coordinator's CPU time over the liveness heartbeats it kept:
one per node per interval, whether a message or pings carried it.

    python bench/control_plane.py                       # 1000 and 5000 nodes
    python bench/control_plane.py --nodes 200 --duration 10
    python bench/control_plane.py --legacy-acks         # older agents: an ack per heartbeat

Prints a table, and last the extrapolation to 10,000 nodes:
    control plane: 10000 nodes at 5s heartbeat ≈ X% of one core
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from coordinator.server import server_options  # noqa: E402
from coordinator.settings import Settings  # noqa: E402
from node_agent import __version__  # noqa: E402
from node_agent.agent import AgentConfig, keepalive_options  # noqa: E402
from protos import codec, identity  # noqa: E402
from protos.tessera.v1 import (  # noqa: E402
    client_api_pb2,
    client_api_pb2_grpc,
    coordinator_pb2,
    coordinator_pb2_grpc,
    node_pb2,
)

TARGET_NODES = 10_000
REGISTER_CONCURRENCY = 64
ATTACH_CONCURRENCY = 200
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", codec.MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", codec.MAX_MESSAGE_BYTES),
    # Each channel must get its own TCP connection, like separate machines would.
    ("grpc.use_local_subchannel_pool", 1),
]
# What tessera-node's channel adds: HTTP/2 keepalive pings, which the coordinator answers.
AGENT_CHANNEL_OPTIONS = CHANNEL_OPTIONS + keepalive_options(AgentConfig(coordinator="", name=""))


@dataclass(frozen=True)
class Protocol:
    """How the simulated agents talk: today's agents by default, or older ones."""

    legacy_acks: bool = False  # older agents: a heartbeat every interval, acks every `ack_every`
    ack_every: int = 1
    nodes_per_connection: int = 1

    @property
    def channel_options(self) -> list[tuple[str, int]]:
        return CHANNEL_OPTIONS if self.legacy_acks else AGENT_CHANNEL_OPTIONS

    def describe(self) -> str:
        acks = f"an ack every {self.ack_every} heartbeat(s)" if self.legacy_acks else (
            "keepalive pings (acks on state changes only, telemetry every "
            f"{Settings(Path(), Path()).telemetry_every_intervals} intervals)"
        )  # fmt: skip
        return f"{acks}; {self.nodes_per_connection} node(s) per TCP connection"


class BareAttachServer(coordinator_pb2_grpc.CoordinatorServicer):
    """gRPC without the coordinator: registers anyone, acks heartbeats, keeps no state.

    Run under the same simulator, it shows what grpc.aio itself costs per heartbeat, the
    floor under any Python coordinator that speaks this protocol.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    async def GetChallenge(self, request, context):
        return coordinator_pb2.Challenge(nonce=os.urandom(32))

    async def Register(self, request, context):
        return coordinator_pb2.RegisterResponse(
            node_id=identity.node_id(request.public_key), attach_ticket=b"t"
        )

    async def Attach(self, request_iterator, context):
        hello = (await context.read()).hello
        settings = self.settings
        welcome = coordinator_pb2.Welcome(
            node_id=hello.node_id,
            heartbeat_interval_ms=int(settings.heartbeat_interval_s * 1000),
        )
        ack_every = settings.heartbeat_ack_every
        if hello.keepalive_pings:  # as the coordinator answers it
            welcome.acks_on_state_change_only = True
            welcome.telemetry_interval_ms = int(settings.telemetry_interval_s * 1000)
            ack_every = 0
        await context.write(coordinator_pb2.CoordinatorMessage(welcome=welcome))
        count = 0
        while True:
            message = await context.read()
            if message is grpc.aio.EOF:
                return
            count += 1
            if ack_every and count % ack_every == 0:
                await context.write(
                    coordinator_pb2.CoordinatorMessage(
                        heartbeat_ack=coordinator_pb2.HeartbeatAck(seq=message.heartbeat.seq)
                    )
                )


async def serve_bare(interval_s: float, ack_every: int) -> None:
    settings = bench_settings(interval_s, ack_every)
    server = grpc.aio.server(options=server_options(settings))  # the coordinator's options
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(BareAttachServer(settings), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)  # as the coordinator does
    print(f"serving on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def bench_settings(interval_s: float, ack_every: int) -> Settings:
    """What `tessera-coordinator serve --heartbeat-interval S --heartbeat-ack-every N` runs."""
    return Settings(Path(), Path(), heartbeat_interval_s=interval_s, heartbeat_ack_every=ack_every)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from the kernel's accounting."""
    try:
        import psutil

        times = psutil.Process(pid).cpu_times()
        return times.user + times.system
    except ImportError:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ServerProcess:
    """The server under test, as a subprocess in a throw-away directory: the real
    coordinator (`tessera-coordinator serve`), or the bare gRPC baseline below."""

    def __init__(self, work_dir: Path, interval_s: float, protocol: Protocol, bare: bool) -> None:
        self.work_dir = work_dir
        self.log_path = work_dir / "server.log"
        if bare:
            args = [sys.executable, __file__, "--serve-bare", "--interval", str(interval_s),
                    "--ack-every", str(protocol.ack_every)]  # fmt: skip
        else:
            args = [
                sys.executable, "-m", "coordinator.cli", "serve", "--listen", "127.0.0.1:0",
                "--db", str(work_dir / "coordinator.db"), "--heartbeat-interval",
                str(interval_s), "--heartbeat-ack-every", str(protocol.ack_every),
            ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip
        self.address = self._wait_for_address(timeout=60)

    def _wait_for_address(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(r"serving on (\S+:\d+)", self.log_path.read_text(errors="replace"))
            if match:
                return match.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the server did not start:\n{self.log_path.read_text()[-3000:]}")

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class SimNode:
    index: int
    key: object
    public_key: bytes
    node_id: str = ""
    ticket: bytes = b""


@dataclass
class Stats:
    heartbeats: int = 0
    errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)  # ack round trips (legacy)
    lag_ms: list[float] = field(default_factory=list)  # sent after the node's slot by
    recording: bool = False


def capabilities(i: int) -> node_pb2.Capabilities:
    return node_pb2.Capabilities(
        device_kind="cuda", device_name="NVIDIA GeForce RTX 3090", device_count=1,
        memory_total_bytes=24 << 30, memory_usable_bytes=22 << 30, compute_capability="8.6",
        cpu_cores=16, ram_bytes=64 << 30, matmul_tflops=30.0 + i % 10, region="eu-west",
        agent_version=__version__, dtypes=["float32", "float16"],
    )  # fmt: skip


def telemetry(seq: int) -> node_pb2.Telemetry:
    """Numbers that change from beat to beat, as a real node's do."""
    return node_pb2.Telemetry(
        memory_used_bytes=(8 << 30) + (seq % 97 << 20), utilization=seq % 100 / 100,
        queue_length=seq % 3, active_sessions=seq % 2, kv_tokens_used=seq % 4096,
        kv_tokens_budget=4096,
    )  # fmt: skip


async def register(stub: coordinator_pb2_grpc.CoordinatorStub, node: SimNode) -> None:
    challenge = await stub.GetChallenge(
        coordinator_pb2.ChallengeRequest(public_key=node.public_key)
    )
    request = coordinator_pb2.RegisterRequest(
        public_key=node.public_key, nonce=challenge.nonce, name=f"sim-{node.index}",
        account="bench", capabilities=capabilities(node.index),
    )  # fmt: skip
    identity.sign_register(node.key, request)
    reply = await stub.Register(request)
    node.node_id, node.ticket = reply.node_id, reply.attach_ticket


async def attach(
    stub: coordinator_pb2_grpc.CoordinatorStub, node: SimNode, protocol: Protocol
) -> tuple[grpc.aio.StreamStreamCall, coordinator_pb2.Welcome]:
    call = stub.Attach()
    hello = coordinator_pb2.AttachHello(
        node_id=node.node_id, attach_ticket=node.ticket,
        keepalive_pings=not protocol.legacy_acks,
    )  # fmt: skip
    try:
        await call.write(coordinator_pb2.NodeMessage(hello=hello))
        welcome = await call.read()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
        code, details = await call.code(), await call.details()
        raise RuntimeError(f"node {node.index} could not attach: {code}: {details}") from exc
    if welcome is grpc.aio.EOF or welcome.WhichOneof("kind") != "welcome":
        raise RuntimeError(f"node {node.index} got {welcome!r} instead of a welcome")
    if welcome.welcome.acks_on_state_change_only == protocol.legacy_acks:
        raise RuntimeError(f"the server did not answer keepalive_pings: {welcome.welcome}")
    return call, welcome.welcome


async def heartbeat_loop(
    stub: coordinator_pb2_grpc.CoordinatorStub,
    node: SimNode,
    first_beat: float,
    interval_s: float,
    stats: Stats,
    attached: asyncio.Queue[None],
    attach_limit: asyncio.Semaphore,
    protocol: Protocol,
) -> None:
    """`interval_s`: how often this node sends a heartbeat message, as the welcome says."""
    async with attach_limit:  # a real swarm does not reconnect all at once either
        call, welcome = await attach(stub, node, protocol)
    told_ms = welcome.telemetry_interval_ms or welcome.heartbeat_interval_ms
    if told_ms != int(interval_s * 1000):
        raise RuntimeError(f"node {node.index} was told to heartbeat every {told_ms} ms, "
                           f"not every {interval_s:g} s")  # fmt: skip
    attached.put_nowait(None)
    loop = asyncio.get_running_loop()
    seq = 0
    # Like a real agent: one heartbeat right after the welcome, then one per interval, in
    # this node's own slot of the interval so the swarm's load is spread evenly.
    next_beat = loop.time()
    try:
        while True:
            await asyncio.sleep(max(0.0, next_beat - loop.time()))
            seq += 1
            sent = loop.time()
            beat = coordinator_pb2.Heartbeat(
                seq=seq, sent_unix_ms=int(time.time() * 1000), telemetry=telemetry(seq)
            )
            try:
                await call.write(coordinator_pb2.NodeMessage(heartbeat=beat))
                if stats.recording:
                    stats.heartbeats += 1
                    if next_beat >= first_beat:  # not the beat right after the welcome
                        stats.lag_ms.append((sent - next_beat) * 1000)
                if not protocol.legacy_acks or seq % protocol.ack_every:
                    next_beat = next_slot(first_beat, interval_s, loop.time())
                    continue  # no ack due: today's agents get one only on a state change
                ack = await call.read()
                while ack is not grpc.aio.EOF and ack.heartbeat_ack.seq < seq:
                    ack = await call.read()  # an extra ack for a state change
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                ack = grpc.aio.EOF
            if ack is grpc.aio.EOF or ack.heartbeat_ack.seq != seq:
                stats.errors += 1
                code, details = await call.code(), await call.details()
                print(f"node {node.index}: stream ended: {code.name}: {details}", file=sys.stderr)
                return
            if stats.recording:
                stats.latencies_ms.append((loop.time() - sent) * 1000)
            next_beat = next_slot(first_beat, interval_s, loop.time())
    finally:
        call.cancel()


async def _wait_for_count(queue: asyncio.Queue[None], count: int) -> None:
    for _ in range(count):
        await queue.get()


async def _first_failure(tasks: list[asyncio.Task[None]]) -> None:
    """Raise the exception of the first task that fails; never returns otherwise."""
    failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    def check(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() and not failed.done():
            failed.set_result(task.exception())

    for task in tasks:
        task.add_done_callback(check)
    raise await failed


def next_slot(phase: float, interval_s: float, now: float) -> float:
    """The first time after `now` that is `phase` plus a whole number of intervals."""
    periods = max(0, int((now - phase) // interval_s) + 1)
    return phase + periods * interval_s


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


async def count_online(address: str, interval_s: float) -> int:
    """Nodes the coordinator itself lists as online and heard from within 1.5 of their
    intervals: proof that it took in their heartbeats, not just that the simulator sent
    them."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        reply = await client_api_pb2_grpc.ClientApiStub(channel).ListNodes(
            client_api_pb2.ListNodesRequest(include_offline=True), timeout=60
        )
    recent_ms = time.time() * 1000 - 1.5 * interval_s * 1000
    return sum(
        1 for n in reply.nodes
        if n.state == node_pb2.NODE_STATE_ONLINE and n.last_seen_unix_ms >= recent_ms
    )  # fmt: skip


@dataclass
class Result:
    nodes: int
    register_rate: float
    register_cpu_ms: float
    heartbeat_rate: float  # liveness heartbeats kept: nodes / interval
    message_rate: float  # heartbeat messages the simulator sent
    core_share: float
    cpu_us_per_heartbeat: float
    idle_share: float
    lag_p99_ms: float
    ack_p50_ms: float
    ack_p99_ms: float
    online: int | None  # None for the bare server, which keeps no node list
    errors: int
    simulator_share: float
    expected_message_rate: float

    @property
    def kept_up(self) -> bool:
        """Did the simulator send on schedule? If not, the load was burstier than real."""
        return (
            abs(self.message_rate / self.expected_message_rate - 1) < 0.1
            and self.lag_p99_ms < 500
            and not self.ack_p99_ms > 500  # NaN (no acks) passes
        )


async def run_one(
    n: int, duration_s: float, interval_s: float, protocol: Protocol, work_dir: Path, bare: bool
) -> Result:
    coordinator = ServerProcess(work_dir, interval_s, protocol, bare)
    # How often each node sends a heartbeat message; pings fill the intervals in between.
    message_interval_s = interval_s
    if not protocol.legacy_acks:
        message_interval_s = bench_settings(interval_s, protocol.ack_every).telemetry_interval_s
    label = f"{n} nodes, {'bare gRPC baseline' if bare else 'coordinator'}"
    channels: list[grpc.aio.Channel] = []
    tasks: list[asyncio.Task[None]] = []
    try:
        # Idle cost: the watchdog and flush loops with no nodes.
        cpu0, t0 = coordinator.cpu(), time.monotonic()
        await asyncio.sleep(2.0)
        idle_share = (coordinator.cpu() - cpu0) / (time.monotonic() - t0)

        print(f"[{label}] generating keys...", file=sys.stderr)
        nodes = []
        for i in range(n):
            key = identity.generate_private_key()
            nodes.append(SimNode(i, key, identity.public_key_bytes(key)))
        per_connection = protocol.nodes_per_connection
        print(f"[{label}] connecting...", file=sys.stderr)
        channels = [
            grpc.aio.insecure_channel(coordinator.address, options=protocol.channel_options)
            for _ in range((n + per_connection - 1) // per_connection)
        ]
        stubs = [coordinator_pb2_grpc.CoordinatorStub(c) for c in channels]
        await asyncio.gather(*(channel.channel_ready() for channel in channels))

        print(f"[{label}] registering...", file=sys.stderr)
        limit = asyncio.Semaphore(REGISTER_CONCURRENCY)

        async def register_limited(node: SimNode) -> None:
            async with limit:
                await register(stubs[node.index // per_connection], node)

        cpu0, t0 = coordinator.cpu(), time.monotonic()
        await asyncio.gather(*(register_limited(node) for node in nodes))
        register_wall = time.monotonic() - t0
        register_cpu = coordinator.cpu() - cpu0

        # The simulator holds thousands of streams: keep the collector's pauses out of the
        # heartbeat schedule (the coordinator does the same).
        gc.collect()
        gc.freeze()
        gc.set_threshold(20_000, 50, 100)

        print(f"[{label}] attaching; heartbeat messages every {message_interval_s:g} s...",
              file=sys.stderr)  # fmt: skip
        stats = Stats()
        attached: asyncio.Queue[None] = asyncio.Queue()
        attach_limit = asyncio.Semaphore(ATTACH_CONCURRENCY)
        loop = asyncio.get_running_loop()
        start = loop.time()
        attach_cpu0 = coordinator.cpu()
        for node in nodes:
            first_beat = start + message_interval_s * (1 + node.index / n)  # spread evenly
            stub = stubs[node.index // per_connection]
            tasks.append(
                asyncio.create_task(
                    heartbeat_loop(
                        stub, node, first_beat, message_interval_s, stats, attached,
                        attach_limit, protocol,
                    )
                )
            )  # fmt: skip
        all_attached = asyncio.ensure_future(_wait_for_count(attached, n))
        first_failure = asyncio.ensure_future(_first_failure(tasks))
        done, _ = await asyncio.wait(
            {all_attached, first_failure}, timeout=300, return_when=asyncio.FIRST_COMPLETED
        )
        all_attached.cancel()
        first_failure.cancel()
        if first_failure in done:
            first_failure.result()  # raise what went wrong in the simulated node
        if all_attached not in done:
            raise TimeoutError("the nodes did not attach within 300 s")
        attach_wall = loop.time() - start
        attach_cpu = coordinator.cpu() - attach_cpu0
        print(f"[{label}] all attached in {attach_wall:.1f} s "
              f"(coordinator CPU {attach_cpu:.1f} s)", file=sys.stderr)  # fmt: skip
        # Let every node complete one full cycle before measuring the steady state.
        await asyncio.sleep(max(0.0, start + 2 * message_interval_s + 0.5 - loop.time()))

        print(f"[{label}] measuring for {duration_s:g} s...", file=sys.stderr)
        stats.recording = True
        cpu0, t0, sim0 = coordinator.cpu(), time.monotonic(), cpu_seconds(os.getpid())
        await asyncio.sleep(duration_s)
        cpu1, t1, sim1 = coordinator.cpu(), time.monotonic(), cpu_seconds(os.getpid())
        stats.recording = False
        online = None if bare else await count_online(coordinator.address, message_interval_s)
        window = t1 - t0
        heartbeats = n / interval_s * window  # one per node per interval, message or pings
        return Result(
            nodes=n,
            register_rate=n / register_wall,
            register_cpu_ms=register_cpu / n * 1000,
            heartbeat_rate=heartbeats / window,
            message_rate=stats.heartbeats / window,
            core_share=(cpu1 - cpu0) / window,
            cpu_us_per_heartbeat=(cpu1 - cpu0) / heartbeats * 1e6,
            idle_share=idle_share,
            lag_p99_ms=percentile(stats.lag_ms, 0.99),
            ack_p50_ms=percentile(stats.latencies_ms, 0.5),
            ack_p99_ms=percentile(stats.latencies_ms, 0.99),
            online=online,
            errors=stats.errors,
            simulator_share=(sim1 - sim0) / window,
            expected_message_rate=n / message_interval_s,
        )
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for channel in channels:
            await channel.close()
        coordinator.stop()


def extrapolate(results: list[Result], interval_s: float, target: int) -> float:
    """Share of one core for `target` nodes: a least-squares line through the measurements.

    Heartbeat cost is linear in the heartbeat rate; the intercept is the fixed overhead.
    With one measurement, the line goes through it and the idle cost.
    """
    xs = [r.nodes for r in results]
    ys = [r.core_share for r in results]
    if len(results) == 1:
        r = results[0]
        slope = (r.core_share - r.idle_share) / r.nodes
        return r.idle_share + slope * target
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    return mean_y + slope * (target - mean_x)


def print_table(
    results: list[Result], baselines: list[Result | None], interval_s: float, protocol: Protocol
) -> None:
    header = (
        "nodes", "register/s", "reg CPU ms/node", "heartbeats/s", "messages/s", "coordinator CPU",
        "CPU µs/heartbeat", "bare gRPC CPU", "vs bare", "send lag p99 ms", "ack p50 ms",
        "ack p99 ms", "online", "errors", "simulator CPU", "on schedule",
    )  # fmt: skip
    rows = [header]
    for r, b in zip(results, baselines, strict=True):
        acks = ("-", "-") if r.ack_p50_ms != r.ack_p50_ms else (  # NaN: no acks to time
            f"{r.ack_p50_ms:.2f}", f"{r.ack_p99_ms:.2f}"
        )  # fmt: skip
        rows.append((
            str(r.nodes), f"{r.register_rate:.0f}", f"{r.register_cpu_ms:.2f}",
            f"{r.heartbeat_rate:.0f}", f"{r.message_rate:.0f}",
            f"{r.core_share * 100:.1f}% of a core",
            f"{r.cpu_us_per_heartbeat:.0f}",
            f"{b.core_share * 100:.1f}%" if b else "-",
            f"{r.core_share / b.core_share:.2f}x" if b and b.core_share else "-",
            f"{r.lag_p99_ms:.1f}", *acks, f"{r.online}/{r.nodes}", str(r.errors),
            f"{r.simulator_share * 100:.0f}%",
            "yes" if r.kept_up and (b is None or b.kept_up) else "NO",
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for i, row in enumerate(rows):
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    idle = statistics.fmean(r.idle_share for r in results)
    print(f"\nagents: {protocol.describe()}")
    print(f"idle coordinator (no nodes): {idle * 100:.2f}% of a core; "
          f"heartbeat interval {interval_s:g} s")  # fmt: skip
    print("heartbeats/s: nodes / interval, what liveness tracking keeps up; messages/s: the "
          "heartbeat messages sent (the rest of the liveness is keepalive pings); CPU per "
          "heartbeat is over the former")  # fmt: skip
    print("online: nodes the coordinator lists as online and heard from within 1.5 of their "
          "heartbeat intervals after the measurement")  # fmt: skip
    if any(b is not None for b in baselines):
        print("bare gRPC: the same simulator against a grpc.aio server that acks as the "
              "coordinator would (no registry, no state): the floor for this protocol in "
              "Python")  # fmt: skip
    if not all(r.kept_up for r in results):
        print("note: where 'on schedule' is NO the simulator fell behind (CPU-bound): its "
              "heartbeats came in bursts, which flatters the server; the extrapolation "
              "below uses only on-schedule runs when there are any")  # fmt: skip
    print(
        f"this machine: {machine_speed():.2f} s for sum(range(10**7)) in Python "
        "(a 2023 desktop core: about 0.15 s)"
    )


def machine_speed() -> float:
    """How fast this CPU runs Python, so numbers from different machines can be compared."""
    started = time.process_time()
    sum(range(10**7))
    return time.process_time() - started


def parse_nodes(values: list[str]) -> list[int]:
    counts = []
    for value in values:
        for part in value.replace(",", " ").split():
            count = int(part)
            if count < 1:
                raise argparse.ArgumentTypeError("--nodes must be positive")
            counts.append(count)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--nodes", action="append", metavar="N",
        help='node counts to simulate, repeatable or a list (default: "1000 5000")',
    )  # fmt: skip
    parser.add_argument(
        "--duration", type=float, default=30.0, metavar="S",
        help="steady-state measurement window per node count (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--interval", type=float, default=5.0, metavar="S",
        help="heartbeat interval (default: %(default)s, the coordinator's default)",
    )  # fmt: skip
    parser.add_argument(
        "--legacy-acks", action="store_true",
        help="simulate agents that predate AttachHello.keepalive_pings: a heartbeat every "
        "interval, acked every time (or every --ack-every-th), no keepalive pings; what a "
        "swarm that has not upgraded costs",
    )  # fmt: skip
    parser.add_argument(
        "--ack-every", type=int, choices=[1, 2], default=1, metavar="N",
        help="with --legacy-acks: the coordinator's --heartbeat-ack-every (default: "
        "%(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--nodes-per-connection", type=int, default=1, metavar="K",
        help="simulated nodes sharing one TCP connection (default: %(default)s, one each, as "
        "separate machines). More is lighter on the simulator, but flatters the server: "
        "pings go per connection, so K nodes get the pings of one",
    )  # fmt: skip
    parser.add_argument(
        "--no-baseline", action="store_true",
        help="skip the bare gRPC baseline runs (halves the running time)",
    )  # fmt: skip
    parser.add_argument("--serve-bare", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_bare:
        asyncio.run(serve_bare(args.interval, args.ack_every))
        return
    counts = parse_nodes(args.nodes or ["1000 5000"])
    if args.nodes_per_connection < 1:
        parser.error("--nodes-per-connection must be at least 1")
    protocol = Protocol(args.legacy_acks, args.ack_every, args.nodes_per_connection)

    def measure(n: int, bare: bool) -> Result:
        with tempfile.TemporaryDirectory(prefix="tessera-bench-") as tmp:
            return asyncio.run(run_one(n, args.duration, args.interval, protocol, Path(tmp), bare))

    results, baselines = [], []
    for n in counts:
        results.append(measure(n, bare=False))
        baselines.append(None if args.no_baseline else measure(n, bare=True))
    print()
    print_table(results, baselines, args.interval, protocol)
    if not args.no_baseline:
        floor = extrapolate([b for b in baselines if b is not None], args.interval, TARGET_NODES)
        print(f"bare gRPC floor: {TARGET_NODES} nodes at {args.interval:g}s heartbeat ≈ "
              f"{floor * 100:.0f}% of one core")  # fmt: skip
    trusted = [r for r in results if r.kept_up] or results
    share = extrapolate(trusted, args.interval, TARGET_NODES)
    print(
        f"control plane: {TARGET_NODES} nodes at {args.interval:g}s heartbeat ≈ "
        f"{share * 100:.0f}% of one core"
    )


if __name__ == "__main__":
    main()
