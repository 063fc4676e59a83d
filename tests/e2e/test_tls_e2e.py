"""A coordinator served over TLS: real processes, a private CA.

`serve --tls-cert --tls-key` puts the coordinator's one gRPC port (nodes' registration,
Attach, shard downloads, the admin API, clients' sessions, the ledger) behind TLS. Every
program then dials `grpcs://HOST:PORT` and checks the certificate against
`$TESSERA_CA_CERT`. Here the node agents join, download their shards and serve; the
admin CLI imports a model through the address file `serve` wrote; a client generates
exactly what transformers does; a node's earnings CLI answers; the metrics page (plain
HTTP on its own port) counts the nodes and the model. A client that dials the
port without TLS, or trusts another CA, is told what to change.
"""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from support.checkpoints import TINY_SHAPE, make_checkpoint, transformers_greedy
from support.tls_files import write_tls_files

from client.api import Client
from client.errors import CoordinatorUnavailable
from client.local_swarm import LocalSwarm, wait_for_replicas
from protos.dialing import CA_ENV, host_port

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
PROMPT = [1, 5, 9, 23, 42, 7, 11]
NEW_TOKENS = 8


def test_a_swarm_whose_coordinator_serves_tls(tmp_path: Path, monkeypatch) -> None:
    tls = write_tls_files(tmp_path / "tls")
    other_ca = write_tls_files(tmp_path / "other", ca_name="Someone else's CA").ca
    checkpoint = make_checkpoint(tmp_path / "tiny", "llama", num_layers=4, **TINY_SHAPE, seed=5)
    (reference,) = transformers_greedy(checkpoint, [PROMPT], NEW_TOKENS)
    monkeypatch.setenv(CA_ENV, str(tls.ca))  # every process started below trusts our CA
    args = ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--min-stages", "2",
            "--metrics-listen", "127.0.0.1:0"]  # fmt: skip
    with LocalSwarm(tmp_path / "swarm", coordinator_args=args) as swarm:
        address = swarm.start_coordinator()
        assert address.startswith("grpcs://127.0.0.1:")  # the address file says TLS
        assert f"serving on {address}" in swarm.coordinator.log_text()
        nodes = [swarm.start_node(name) for name in ("alpha", "bravo")]
        swarm.wait_registered(nodes)
        swarm.add_model(checkpoint, MODEL)  # the admin CLI, over TLS, from the address file
        with Client(address) as client:
            wait_for_replicas(client, MODEL, timeout_s=120)
            result = client.generate_all(
                MODEL, token_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False
            )
        assert result.token_ids == reference
        # What an operator's Prometheus scrapes meanwhile (plain HTTP, beside the TLS port).
        metrics = re.search(r"metrics on (http://\S+)", swarm.coordinator.log_text())
        assert metrics is not None
        with urllib.request.urlopen(metrics.group(1), timeout=10) as page:
            scraped = page.read().decode()
        assert 'tessera_nodes{state="online"} 2' in scraped
        assert f'tessera_model_available{{model="{MODEL}"}} 1' in scraped
        assert f'tessera_model_ready_replicas_min{{model="{MODEL}"}} ' in scraped
        # Two stages (--min-stages 2), served by the nodes that joined over TLS; the router
        # may give both stages to one node, which holds both (2 replicas on 2 nodes).
        assert len(result.initial_route) == 2
        assert {hop.node_id for hop in result.initial_route} <= {n.node_id for n in nodes}

        earnings = subprocess.run(
            [sys.executable, "-m", "node_agent.cli", "earnings", "--coordinator", address,
             "--data-dir", str(swarm.workdir / "nodes" / "alpha")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert earnings.returncode == 0, earnings.stderr

        plain = host_port(address)
        with pytest.raises(CoordinatorUnavailable) as caught, Client(plain) as client:
            client.models()
        assert f"dial grpcs://{plain}" in str(caught.value)

        monkeypatch.setenv(CA_ENV, str(other_ca))
        with pytest.raises(CoordinatorUnavailable) as caught, Client(address) as client:
            client.models()
        message = str(caught.value)
        assert "dialed over TLS" in message and CA_ENV in message, message

        for node in nodes:
            assert node.alive(), node.log_text()[-2000:]
            assert "not attached to coordinator" not in node.log_text()  # attached at once, stayed
