"""The synchronous Client and the `tessera` CLI against real stage servers on loopback.

The servers run on a background event loop (the Client blocks its caller); the coordinator
is the in-test FakeCoordinator serving the ClientApi calls from a fixed layout.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from data_plane.stage_harness import (
    MODEL,
    BackgroundLoop,
    CoordinatorKeys,
    FakeCoordinator,
    StageNode,
    reference_greedy,
)
from data_plane.test_hedging import SlowServicer

from client import Client, CoordinatorError, ModelNotFound
from client import cli as tessera_cli
from client.driver import DriverConfig
from client.tokenizer import TextTokenizer
from node_agent.stage_server import StageServicer
from protos.tessera.v1 import node_pb2

PROMPT_TEXT = "hello world the quick brown fox"


@dataclass
class Swarm:
    loop: BackgroundLoop
    coordinator: FakeCoordinator
    address: str
    a: StageNode
    b: StageNode
    b_alt: StageNode
    checkpoint: Path

    @property
    def tokenizer(self) -> TextTokenizer:
        return TextTokenizer.from_json((self.checkpoint / "tokenizer.json").read_bytes())

    def active_sessions(self) -> int:
        return sum(n.manager.active_sessions() for n in (self.a, self.b, self.b_alt))


@pytest.fixture
def swarm(checkpoint: Path, tmp_path: Path) -> Iterator[Swarm]:
    loop = BackgroundLoop()
    keys = CoordinatorKeys()

    async def start() -> Swarm:
        # b answers as fast as the others until a test sets its delay (a straggler).
        nodes = [
            await StageNode.start(
                checkpoint, keys.public, shards, data_dir=tmp_path / name, servicer_class=cls
            )
            for name, shards, cls in (
                ("a", [(0, 2)], StageServicer),
                ("b", [(2, 4)], SlowServicer),
                ("b_alt", [(2, 4)], StageServicer),
            )
        ]
        a, b, b_alt = nodes
        coordinator = FakeCoordinator(keys, checkpoint, [(0, 2, a, []), (2, 4, b, [b_alt])])
        address = await coordinator.start()
        return Swarm(loop, coordinator, address, a, b, b_alt, checkpoint)

    swarm = loop.run(start())
    yield swarm

    async def stop() -> None:
        await swarm.coordinator.stop()
        for node in (swarm.a, swarm.b, swarm.b_alt):
            await node.stop()

    loop.run(stop())
    loop.close()


def test_generate_streams_the_same_tokens_as_the_whole_model(swarm: Swarm) -> None:
    prompt_ids = swarm.tokenizer.encode(PROMPT_TEXT)
    expected = reference_greedy(swarm.checkpoint, prompt_ids, 8)
    with Client(swarm.address) as client:
        tokens = list(
            client.generate(MODEL, prompt=PROMPT_TEXT, max_new_tokens=8, stop_at_eos=False)
        )
        result = client.last_run
    assert [t.id for t in tokens] == expected
    assert [t.index for t in tokens] == list(range(8))
    assert all(len(t.stage_timings) == 2 for t in tokens[1:])
    assert result is not None and result.token_ids == expected
    assert result.prompt_token_ids == prompt_ids
    assert result.text == "".join(t.text for t in tokens)
    assert result.text.strip() == swarm.tokenizer.decode(expected).strip()
    assert result.finish_reason == "length" and result.failovers == []
    assert [h.node_id for h in result.route] == [swarm.a.node_id, swarm.b.node_id]
    # The session was sized for prompt + new tokens, and closed everywhere afterwards.
    [opened] = swarm.coordinator.opened
    assert opened.max_length == len(prompt_ids) + 8
    assert swarm.coordinator.closed == [result.session_id]
    assert swarm.active_sessions() == 0


def test_a_node_dying_mid_generation_changes_nothing_in_the_output(swarm: Swarm) -> None:
    prompt = [1, 9, 17, 25]
    expected = reference_greedy(swarm.checkpoint, prompt, 10)
    with Client(swarm.address) as client:
        ids = []
        for token in client.generate(MODEL, token_ids=prompt, max_new_tokens=10, stop_at_eos=False):
            ids.append(token.id)
            if token.index == 3:
                swarm.loop.run(swarm.b.server.stop(0))
        result = client.last_run
    assert ids == expected
    [event] = result.failovers
    assert (event.failed_node_id, event.replacement_node_ids) == (
        swarm.b.node_id,
        (swarm.b_alt.node_id,),
    )
    assert [h.node_id for h in result.route] == [swarm.a.node_id, swarm.b_alt.node_id]
    summary = result.to_json()
    assert summary["failovers"][0]["via"] == "alternate"
    assert [s["node_id"] for s in summary["stages"]] == [swarm.a.node_id, swarm.b_alt.node_id]


def test_the_record_shows_the_hop_a_won_hedge_moved_while_it_generates(swarm: Swarm) -> None:
    prompt = [1, 9, 17, 25]
    config = DriverConfig(hedge_factor=3.0, hedge_floor_s=0.1, min_samples=2, deadline_floor_s=5.0)
    routes = []
    with Client(swarm.address, driver_config=config) as client:
        stream = client.generate(
            MODEL, token_ids=prompt, max_new_tokens=10, stop_at_eos=False, run_ahead=False
        )
        for token in stream:
            assert client.last_run is not None
            routes.append([h.node_id for h in client.last_run.route])
            if token.index == 3:
                assert isinstance(swarm.b.servicer, SlowServicer)
                swarm.b.servicer.delay_s = 1.0
        result = client.last_run
    assert result.token_ids == reference_greedy(swarm.checkpoint, prompt, 10)
    assert not result.failovers and [h.winner for h in result.hedges][:1] == ["alternate"]
    # Stepped on demand, the generation was still running at its last token: the route the
    # record showed then already named the alternate that won the hedge.
    assert routes[0] == [swarm.a.node_id, swarm.b.node_id]
    assert routes[-1] == [swarm.a.node_id, swarm.b_alt.node_id]


def test_stopping_early_still_closes_the_session(swarm: Swarm) -> None:
    with Client(swarm.address) as client:
        stream = client.generate(MODEL, token_ids=[1, 2, 3], max_new_tokens=20)
        next(stream)
        stream.close()
    assert len(swarm.coordinator.closed) == 1
    assert swarm.active_sessions() == 0


def test_the_generation_does_not_wait_for_the_caller(swarm: Swarm) -> None:
    # The caller holds on to its first token; meanwhile the pipeline goes on, and every
    # token is there when the caller comes back for the rest.
    expected = reference_greedy(swarm.checkpoint, [1, 2, 3], 8)
    with Client(swarm.address) as client:
        stream = client.generate(MODEL, token_ids=[1, 2, 3], max_new_tokens=8, stop_at_eos=False)
        first = next(stream)
        run = client.last_run
        assert run is not None
        deadline = time.monotonic() + 30
        while len(run.token_ids) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert run.token_ids == expected  # all generated before the caller asked again
        assert [first.id, *(t.id for t in stream)] == expected
    assert swarm.active_sessions() == 0


def test_without_run_ahead_each_step_waits_for_the_caller(swarm: Swarm) -> None:
    expected = reference_greedy(swarm.checkpoint, [1, 2, 3], 4)
    with Client(swarm.address) as client:
        stream = client.generate(
            MODEL, token_ids=[1, 2, 3], max_new_tokens=4, stop_at_eos=False, run_ahead=False
        )
        first = next(stream)
        time.sleep(0.3)  # ample time for the next steps, were they running
        run = client.last_run
        assert run is not None and run.token_ids == [first.id]
        assert [first.id, *(t.id for t in stream)] == expected
    assert swarm.active_sessions() == 0


def test_directory_calls_and_unknown_models(swarm: Swarm) -> None:
    with Client(swarm.address) as client:
        assert len(client.nodes()) == 3
        [info] = client.models()
        assert info.name == MODEL and info.num_layers == 4
        with pytest.raises(ModelNotFound, match=f"known models: {MODEL}"):
            list(client.generate("no-such-model", token_ids=[1], max_new_tokens=1))
        with pytest.raises(ValueError, match="exactly one of"):
            list(client.generate(MODEL, max_new_tokens=1))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            list(client.generate(MODEL, token_ids=[1, 999], max_new_tokens=1))
        # Past the model's positions: told how many new tokens fit after this prompt.
        with pytest.raises(ValueError, match="3 tokens, so at most 253 new tokens fit"):
            list(client.generate(MODEL, token_ids=[1, 2, 3], max_new_tokens=254))
    assert swarm.coordinator.opened == []  # nothing was opened for bad requests


def test_the_coordinators_own_unavailable_is_not_mistaken_for_unreachable(swarm: Swarm) -> None:
    swarm.coordinator.refuse_sessions = "model 'tiny-llama' is not served yet; try again shortly"
    with Client(swarm.address) as client:
        with pytest.raises(CoordinatorError, match="not served yet") as err:
            list(client.generate(MODEL, token_ids=[1], max_new_tokens=1))
    assert "cannot reach" not in str(err.value)


def test_cli_generate_json(swarm: Swarm, capsys) -> None:
    code = tessera_cli.main(
        [
            "generate",
            "--coordinator",
            swarm.address,
            "--model",
            MODEL,
            "--token-ids",
            "1,9,17,25",
            "--max-new-tokens",
            "5",
            "--no-stop-at-eos",
            "--json",
        ]
    )
    assert code == 0
    output = json.loads(capsys.readouterr().out)
    assert output["token_ids"] == reference_greedy(swarm.checkpoint, [1, 9, 17, 25], 5)
    # The new tokens' text as it continues the prompt (spaces included), not decoded alone.
    prompt = [1, 9, 17, 25]
    whole = swarm.tokenizer.decode(prompt + output["token_ids"])
    assert output["text"] == whole[len(swarm.tokenizer.decode(prompt)) :]
    assert [hop["start"] for hop in output["route"]] == [0, 2]
    assert {s["requests"] for s in output["stages"]} == {5}
    assert output["failovers"] == []


def test_cli_generate_streams_text_and_lists(swarm: Swarm, capsys) -> None:
    code = tessera_cli.main(
        [
            "generate",
            "--coordinator",
            swarm.address,
            "--model",
            MODEL,
            "--prompt",
            PROMPT_TEXT,
            "--max-new-tokens",
            "4",
            "--no-stop-at-eos",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0
    assert "4 tokens" in captured.err
    expected = reference_greedy(swarm.checkpoint, swarm.tokenizer.encode(PROMPT_TEXT), 4)
    assert captured.out.strip() == swarm.tokenizer.decode(expected).strip()

    assert tessera_cli.main(["nodes", "--coordinator", swarm.address]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == [
        "ID", "NAME", "STATE", "DEVICE", "MEMORY", "TFLOPS", "GB/S", "LAST", "SEEN", "LEAVES",
        "TRUST", "SPEED"
    ]  # fmt: skip
    assert len(table) == 4 and "online" in table[1] and "3s ago" in table[1]
    node = node_pb2.NodeInfo(
        reliability=node_pb2.NodeReliability(leave_rate_per_h=2.5, departures=5, hours_online=1.0)
    )
    assert tessera_cli._leaves(node) == "2.50/h (5 in 1.0 h)"
    assert tessera_cli._leaves(node_pb2.NodeInfo()) == "-"  # a coordinator without a planner
    speed = node_pb2.NodeSpeed(ms_per_gparam=2.0, call_ms=3.0, measured=True)
    assert tessera_cli._speed(node_pb2.NodeInfo(speed=speed)) == "2 ms/Gparam + 3 ms/call"
    claimed = node_pb2.NodeSpeed(ms_per_gparam=0.5)
    assert tessera_cli._speed(node_pb2.NodeInfo(speed=claimed)) == "0.5 ms/Gparam (claimed)"
    assert tessera_cli.main(["nodes", "--coordinator", swarm.address, "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 3
    assert tessera_cli.main(["models", "--coordinator", swarm.address]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split()[:4] == ["NAME", "ARCHITECTURE", "LAYERS", "CONTEXT"]
    assert row.split()[:4] == [MODEL, "LlamaForCausalLM", "4", "256"]  # tokens a session holds

    code = tessera_cli.main(
        [
            "generate",
            "--coordinator",
            swarm.address,
            "--model",
            "nope",
            "--prompt",
            "x",
            "--max-new-tokens",
            "1",
        ]
    )
    assert code == 1
    assert f"known models: {MODEL}" in capsys.readouterr().err
