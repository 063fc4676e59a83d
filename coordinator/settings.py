"""Tunables of a running coordinator, fixed at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from coordinator.agent_versions import MIN_AGENT_VERSION


@dataclass(frozen=True)
class Settings:
    db_path: Path
    data_dir: Path
    listen: str = "127.0.0.1:0"
    # PEM certificate chain and key: serve over TLS (coordinator/tls.py); None: plain gRPC.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    mqtt_url: str | None = None
    # Prometheus metrics over HTTP at HOST:PORT/metrics (coordinator/metrics.py); None: off.
    metrics_listen: str | None = None
    heartbeat_interval_s: float = 5.0
    # None means three heartbeat intervals.
    offline_after_s: float | None = None
    # A node that has been silent this many intervals is `suspect`.
    suspect_after_intervals: float = 1.5
    # Acknowledge every Nth heartbeat (and every state change at once). Node agents treat
    # 3 silent intervals as a lost coordinator, so N may be 1 or 2.
    heartbeat_ack_every: int = 1
    # Agents with keepalive pings (AttachHello.keepalive_pings) send telemetry every this
    # many heartbeat intervals; our HTTP/2 pings prove them alive in between.
    telemetry_every_intervals: int = 3
    challenge_ttl_s: float = 60.0
    # Outstanding challenges are bounded so a GetChallenge flood cannot exhaust memory.
    max_pending_challenges: int = 100_000
    # last_seen and state changes reach SQLite in one batch per flush, not one write each.
    flush_interval_s: float = 1.0
    # A node's last_seen column is rewritten at most this often (memory is always current).
    last_seen_persist_s: float = 30.0
    reachability_timeout_s: float = 1.5
    # A node the coordinator could not dial back gets no shards (clients could not reach
    # it either); it is dialed again this often while it stays attached.
    reachability_recheck_s: float = 30.0
    # Where the relay listens for nodes that cannot be dialed, and the host clients reach
    # it at (coordinator/nat_relay.py); None: no relay, such nodes do not serve.
    relay_host: str | None = None
    # Where the relay's ports listen (None: relay_host), and the range they come from
    # (None: any free port the system gives).
    relay_bind: str | None = None
    relay_ports: tuple[int, int] | None = None
    # Node agents older than this release are refused at registration
    # (coordinator/agent_versions.py).
    min_agent_version: str = MIN_AGENT_VERSION
    # How long a stopping server lets running calls finish.
    shutdown_grace_s: float = 5.0
    # Placement: every layer keeps at least this many ready replicas when capacity allows.
    replicas: int = 2
    # Split every model into at least this many pipeline stages, even when one node could
    # hold more (deeper pipelines spread load; the demo uses 3 to make them visible).
    min_stages: int = 1
    # Planner objective: served tokens/s of pipelines whose estimated time per token is
    # within this bound (0: no bound). Slower pipelines are dissolved into replicas.
    max_token_latency_ms: float = 0.0
    # ... and within this price per 1,000 tokens through the whole model, in credit units
    # (0: no bound). Dearer pipelines are dissolved into replicas too.
    max_token_price_units: float = 0.0
    # After a restart, placement waits at most this long for the nodes that were online
    # before it to re-attach, so the first re-plan keeps their shards where they are (node
    # agents reconnect with jittered back-off capped at 30 s).
    reattach_grace_s: float = 45.0
    # KV cache tokens each assigned shard reserves across its sessions.
    kv_tokens_per_shard: int = 4096
    # Ledger: the price of a node that asks 0 (credit units per 1,000 token-layers; 0 =
    # free), how long settled earnings stay pending and challengeable before release, the
    # coordinator's cut of each settlement (basis points), and how often the sweep runs.
    default_price_units: int = 0
    # The same for training, in credit units per sample-layer (0 = free).
    default_training_price_units: int = 0
    challenge_window_s: float = 3600.0
    fee_bps: int = 0
    # A paid session's credit at each node: token positions x batch a node computes on a
    # layer range past the newest receipt the client acknowledged (0: no acknowledgments).
    usage_credit_tokens: int = 1024
    # The same for a paid training job, in samples (sequences) run forward.
    training_usage_credit_samples: int = 256
    ledger_sweep_s: float = 1.0
    # Verifier (docs/verification.md): every output of a node is checked until it has this
    # many consecutive verified results, then with probability warmup/results, never less
    # than the minimum. Canaries go to every ready node about once per interval (0: off).
    verify_warmup: int = 10
    verify_min_probability: float = 0.05
    canary_interval_s: float = 60.0
    # The corruption rate f the per-session bound 1 - (1 - p*f)^n is stated for.
    assumed_corruption: float = 0.05
    # Training: a dataset that no job uses is deleted this long after it was last uploaded
    # or looked up (0: kept forever). Anyone may upload one; the disk is not theirs to fill.
    dataset_ttl_s: float = 24 * 3600.0
    # A job that is done or failed is deleted, with its losses and checkpoints, this long
    # after it ended, and one still queued this long after it was submitted (0: kept
    # forever). Its output model stays in the model store.
    job_retention_s: float = 30 * 24 * 3600.0

    @property
    def offline_after(self) -> float:
        if self.offline_after_s is not None:
            return self.offline_after_s
        return 3 * self.heartbeat_interval_s

    @property
    def telemetry_interval_s(self) -> float:
        return self.telemetry_every_intervals * self.heartbeat_interval_s

    @property
    def suspect_after(self) -> float:
        return self.suspect_after_intervals * self.heartbeat_interval_s
