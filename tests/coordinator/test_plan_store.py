"""The placement plans in the coordinator's database: what a restart starts from."""

import json
import logging
from pathlib import Path

import pytest

from coordinator.db import open_database
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
    PlanStore(open_database(tmp_path / "c.db")).save(plans)
    assert PlanStore(open_database(tmp_path / "c.db")).load() == plans


def test_save_writes_only_what_changed_and_forgets_removed_models(tmp_path):
    db = open_database(tmp_path / "c.db")
    store = PlanStore(db)
    store.save({"m": pipelines_plan(), "k": layout_plan()})
    written = db.conn.total_changes
    store.save({"m": pipelines_plan(), "k": layout_plan()})
    assert db.conn.total_changes == written, "an unchanged plan is not written again"
    moved = pipelines_plan()
    moved.holders["c"] = Shard("m", 0, 3)
    store.save({"m": moved})
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
    PlanStore(open_database(db_path)).save({"k": layout_plan()})
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
    store.save({"k": layout_plan()})
    assert set(rows(db_path)) == {"k"}


def test_the_format_is_plain_json_with_sorted_holders():
    text = plan_to_json(pipelines_plan())
    data = json.loads(text)
    assert list(data["holders"]) == ["a", "b", "c"]
    assert data["holders"]["c"] == [0, 6] and data["pipelines"] == [["a", "b"]]
