"""The placement plans, kept in the coordinator's database so that a restart keeps them.

A restarted coordinator that planned from scratch cut a new layout from whichever node
re-attached first, and moved shards between nodes that held them a moment before: each
node fetched its new layers again (on a real swarm, gigabytes per node for one deploy),
and live sessions failed over. With the last plans loaded, the first re-plan after a
restart starts from them (placement's `restore`), and the planner's hysteresis keeps
every shard where it was.

A plan is a row per model: its JSON (boundaries, holders, pipelines, share). A row that
does not parse (a hand-edited database, a newer coordinator's format) is skipped with a
warning: the model is then planned afresh, as before this store existed.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

import sqlite_utils

from coordinator.planner import ModelPlan, Shard

log = logging.getLogger("tessera.placement")

MIGRATION_NAME = "placement plans"


def create_plan_table(db: sqlite_utils.Database) -> None:
    db.execute(
        "CREATE TABLE IF NOT EXISTS placement_plans ("
        "model TEXT PRIMARY KEY, plan_json TEXT NOT NULL, saved_ms INTEGER NOT NULL)"
    )


def plan_to_json(model_plan: ModelPlan) -> str:
    return json.dumps(
        {
            "boundaries": model_plan.boundaries,
            "holders": {n: [s.start, s.end] for n, s in sorted(model_plan.holders.items())},
            "pipelines": [list(p) for p in model_plan.pipelines],
            "share_bytes": model_plan.share_bytes,
        },
        sort_keys=True,
    )


def plan_from_json(model: str, text: str) -> ModelPlan:
    """The plan `plan_to_json` wrote; ValueError when `text` is not one."""
    try:
        data: Any = json.loads(text)
        boundaries = [int(b) for b in data["boundaries"]]
        holders = {
            str(node_id): Shard(model, int(span[0]), int(span[1]))
            for node_id, span in data["holders"].items()
        }
        pipelines = [tuple(str(n) for n in p) for p in data["pipelines"]]
        share_bytes = float(data["share_bytes"])
    except (TypeError, KeyError, IndexError, AttributeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a saved plan: {exc!r}") from exc
    if len(boundaries) < 2 or boundaries[0] != 0 or boundaries != sorted(set(boundaries)):
        raise ValueError(f"boundaries {boundaries} do not cut layers 0..L in order")
    for node_id, shard in holders.items():
        if not 0 <= shard.start < shard.end <= boundaries[-1]:
            raise ValueError(f"{node_id} holds [{shard.start}, {shard.end}) outside the model")
    if any(n not in holders for p in pipelines for n in p):
        raise ValueError("a pipeline names a node that holds nothing")
    return ModelPlan(model, boundaries, holders, pipelines, share_bytes)


class PlanStore:
    """Reads and writes the `placement_plans` table; only this class knows its SQL."""

    def __init__(self, db: sqlite_utils.Database) -> None:
        self._db = db
        self._saved: dict[str, str] = {}  # what the table holds, by model

    def load(self) -> dict[str, ModelPlan]:
        plans: dict[str, ModelPlan] = {}
        for model, text in self._db.execute(
            "SELECT model, plan_json FROM placement_plans ORDER BY model"
        ).fetchall():
            self._saved[model] = text
            try:
                plans[model] = plan_from_json(model, text)
            except ValueError as exc:
                log.warning("the saved plan of model %s is unusable (%s); planning it afresh",
                            model, exc)  # fmt: skip
        return plans

    def save(self, plans: Mapping[str, ModelPlan]) -> None:
        """Make the table hold exactly `plans`; writes nothing when they did not change."""
        texts = {name: plan_to_json(p) for name, p in plans.items()}
        if texts == self._saved:
            return
        now_ms = int(time.time() * 1000)
        with self._db.atomic():
            gone = [m for m in self._saved if m not in texts]
            self._db.conn.executemany(
                "DELETE FROM placement_plans WHERE model = ?", [(m,) for m in gone]
            )
            self._db.conn.executemany(
                "INSERT INTO placement_plans (model, plan_json, saved_ms) VALUES (?, ?, ?) "
                "ON CONFLICT(model) DO UPDATE SET plan_json = excluded.plan_json, "
                "saved_ms = excluded.saved_ms",
                [(m, t, now_ms) for m, t in texts.items() if self._saved.get(m) != t],
            )
        self._saved = texts
