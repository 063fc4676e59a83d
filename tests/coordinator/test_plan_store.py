"""The placement plans in the coordinator's database: what a restart starts from."""

import json
import logging
from pathlib import Path

import pytest

from coordinator.db import open_database
from coordinator.measurements import Measurements
from coordinator.plan_store import PlanStore, plan_from_json, plan_to_json
from coordinator.planner import ModelPlan, Shard


def pipelines_plan() -> ModelPlan:
    return ModelPlan(
        "m",
        [0, 6],
        {"a": Shard("m", 0, 3), "b": Shard("m", 3, 6), "c": Shard("m", 0, 6)},
        [("a", "b")],
        share_bytes=1.5e9,
    )


def layout_plan() -> ModelPlan:
    return ModelPlan("k", [0, 2, 4, 6], {"x": Shard("k", 0, 2), "y": Shard("k", 2, 6)})


def rows(db_path: Path) -> dict[str, str]:
    db = open_database(db_path)
    return dict(db.execute("SELECT model, plan_json FROM placement_plans").fetchall())


def test_plans_survive_a_reopen_of_the_database(tmp_path):
    plans = {"m": pipelines_plan(), "k": layout_plan()}
    PlanStore(open_database(tmp_path / "c.db")).save(plans, Measurements())
    assert PlanStore(open_database(tmp_path / "c.db")).load() == plans


def test_save_writes_only_what_changed_and_forgets_removed_models(tmp_path):
    db = open_database(tmp_path / "c.db")
    store = PlanStore(db)
    store.save({"m": pipelines_plan(), "k": layout_plan()}, Measurements())
    written = db.conn.total_changes
    store.save({"m": pipelines_plan(), "k": layout_plan()}, Measurements())
    assert db.conn.total_changes == written, "an unchanged plan is not written again"
    moved = pipelines_plan()
    moved.holders["c"] = Shard("m", 0, 3)
    store.save({"m": moved}, Measurements())
    assert db.conn.total_changes == written + 2  # one row updated, one deleted
    assert PlanStore(open_database(tmp_path / "c.db")).load() == {"m": moved}


HOSTILE = {
    "not json": "{",
    "not an object": "[1, 2]",
    "missing holders": json.dumps({"boundaries": [0, 6], "pipelines": [], "share_bytes": 0}),
    "boundaries not from 0": json.dumps(
        {"boundaries": [1, 6], "holders": {}, "pipelines": [], "share_bytes": 0}
    ),
    "boundaries out of order": json.dumps(
        {"boundaries": [0, 4, 2, 6], "holders": {}, "pipelines": [], "share_bytes": 0}
    ),
    "a shard past the end": json.dumps(
        {"boundaries": [0, 6], "holders": {"a": [0, 9]}, "pipelines": [], "share_bytes": 0}
    ),
    "an empty shard": json.dumps(
        {"boundaries": [0, 6], "holders": {"a": [3, 3]}, "pipelines": [], "share_bytes": 0}
    ),
    "a shard that is not a pair": json.dumps(
        {"boundaries": [0, 6], "holders": {"a": 5}, "pipelines": [], "share_bytes": 0}
    ),
    "a fractional layer": json.dumps(
        {"boundaries": [0, 2.5, 6], "holders": {}, "pipelines": [], "share_bytes": 0}
    ),
    "a shard of three ends": json.dumps(
        {"boundaries": [0, 6], "holders": {"a": [0, 3, 6]}, "pipelines": [], "share_bytes": 0}
    ),
    "a shard as text": json.dumps(
        {"boundaries": [0, 6], "holders": {"a": "05"}, "pipelines": [], "share_bytes": 0}
    ),
    "a pipeline of strangers": json.dumps(
        {"boundaries": [0, 6], "holders": {"a": [0, 6]}, "pipelines": [["z"]], "share_bytes": 0}
    ),
    "a share that is no number": json.dumps(
        {"boundaries": [0, 6], "holders": {}, "pipelines": [], "share_bytes": "lots"}
    ),
}


@pytest.mark.parametrize("text", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_malformed_row_is_planned_afresh_and_the_others_load(tmp_path, caplog, text):
    db_path = tmp_path / "c.db"
    PlanStore(open_database(db_path)).save({"k": layout_plan()}, Measurements())
    db = open_database(db_path)
    with db.atomic():
        db.execute(
            "INSERT INTO placement_plans (model, plan_json, saved_ms) VALUES ('m', ?, 0)", [text]
        )
    store = PlanStore(open_database(db_path))
    with caplog.at_level(logging.WARNING, "tessera.placement"):
        assert store.load() == {"k": layout_plan()}
    assert "saved plan of model m is unusable" in caplog.text
    with pytest.raises(ValueError):
        plan_from_json("m", text)
    # The next save replaces the bad row (here: the model is gone, so it goes too).
    store.save({"k": layout_plan()}, Measurements())
    assert set(rows(db_path)) == {"k"}


def test_the_format_is_plain_json_with_sorted_holders():
    text = plan_to_json(pipelines_plan())
    data = json.loads(text)
    assert list(data["holders"]) == ["a", "b", "c"]
    assert data["holders"]["c"] == [0, 6] and data["pipelines"] == [["a", "b"]]


def measured() -> Measurements:
    """Two nodes seen at two spans each (so the fixed part of a call is told apart), and
    their round trips to each other and a third."""
    m = Measurements()
    for node_id, ms_per_layer in (("a", 3.0), ("b", 7.0)):
        for i in range(12):
            layers = 2 + 2 * (i % 2)
            m.observe_step(node_id, layers=layers, params_per_layer=10**8, tokens=1,
                           compute_ms=1.5 + ms_per_layer * layers + 0.1 * i)  # fmt: skip
    m.observe_rtts("a", {"b": 12.0, "c": 40.0})
    m.observe_rtts("b", {"a": 14.0})
    return m


def test_measurements_survive_a_reopen_of_the_database(tmp_path):
    seen = measured()
    PlanStore(open_database(tmp_path / "c.db")).save({}, seen)
    again = Measurements()
    PlanStore(open_database(tmp_path / "c.db")).load_measurements(again)
    assert set(again.known()) == {"a", "b"}
    for node_id in ("a", "b"):
        assert again.snapshot(node_id) == seen.snapshot(node_id)
        assert again.of(node_id, 10**8) == seen.of(node_id, 10**8)
        assert again.of(node_id, 10**8).call_ms > 0, "the fitted fixed part came back too"
    assert again.pair_rtt_ms("a", "b") == seen.pair_rtt_ms("a", "b") == 13.0


def test_measurements_are_written_only_when_they_changed(tmp_path):
    db = open_database(tmp_path / "c.db")
    store, seen = PlanStore(db), measured()
    store.save({}, seen)
    written = db.conn.total_changes
    store.save({}, seen)
    assert db.conn.total_changes == written
    seen.observe_rtts("b", {"a": 20.0})
    store.save({}, seen)
    assert db.conn.total_changes == written + 1, "only the node that changed"


HOSTILE_MEASUREMENTS = {
    "not json": "{",
    "not an object": "[1]",
    "a time without its work": json.dumps({"layer": [1.0, 3]}),
    "a negative time": json.dumps({"layer": [-1.0, 3], "work": [0.2, 3]}),
    "not a number": '{"layer": [NaN, 3], "work": [0.2, 3]}',
    "infinite": '{"layer": [Infinity, 3], "work": [0.2, 3]}',
    "fractional samples": json.dumps({"layer": [1.0, 2.5], "work": [0.2, 3]}),
    "a short pair": json.dumps({"layer": [1.0], "work": [0.2, 3]}),
    "a fit of strings": json.dumps({"fit": ["1", 0, 0, 0, 0, 1]}),
    "a fixed part that is text": json.dumps({"call": "fast"}),
    "round trips as a list": json.dumps({"rtt": [["b", 1.0]]}),
    "a negative round trip": json.dumps({"rtt": {"b": [-5.0, 1]}}),
}


@pytest.mark.parametrize("text", HOSTILE_MEASUREMENTS.values(), ids=HOSTILE_MEASUREMENTS.keys())
def test_a_malformed_measurement_row_is_measured_again(tmp_path, caplog, text):
    db_path = tmp_path / "c.db"
    PlanStore(open_database(db_path)).save({}, measured())
    db = open_database(db_path)
    with db.atomic():
        db.execute("UPDATE node_measurements SET state_json = ? WHERE node_id = 'b'", [text])
    again = Measurements()
    with caplog.at_level(logging.WARNING, "tessera.placement"):
        PlanStore(open_database(db_path)).load_measurements(again)
    assert "saved measurements of node b are unusable" in caplog.text
    assert set(again.known()) == {"a"}, "the good row loads, the bad one leaves nothing"
    assert again.snapshot("a") == measured().snapshot("a")
