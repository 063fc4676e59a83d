"""The placement plans, and the measurements they were made with, kept in the
coordinator's database so that a restart keeps them.

A restarted coordinator that planned from scratch cut a new layout from whichever node
re-attached first, and moved shards between nodes that held them a moment before: each
node fetched its new layers again (on a real swarm, gigabytes per node for one deploy),
and live sessions failed over. With the last plans loaded, the first re-plan after a
restart starts from them (placement's `restore`), and the planner's hysteresis keeps
every shard where it was.

A plan is a row per model: its JSON (boundaries, holders, pipelines, share). A row that
does not parse (a hand-edited database, a newer coordinator's format) is skipped with a
warning: the model is then planned afresh, as before this store existed.

The nodes' measured speeds and round trips (coordinator/measurements.py) are saved with
each plan, a row per node: planned again with the nodes' claims instead, a layout sized by
what was measured could look worse than a fresh one by more than the hysteresis, and move.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

import sqlite_utils

from coordinator.measurements import Measurements
from coordinator.planner import ModelPlan, Shard

log = logging.getLogger("tessera.placement")

MIGRATION_NAME = "placement plans"
MEASUREMENTS_MIGRATION_NAME = "node measurements"


def create_plan_table(db: sqlite_utils.Database) -> None:
    db.execute(
        "CREATE TABLE IF NOT EXISTS placement_plans ("
        "model TEXT PRIMARY KEY, plan_json TEXT NOT NULL, saved_ms INTEGER NOT NULL)"
    )


def create_measurements_table(db: sqlite_utils.Database) -> None:
    db.execute(
        "CREATE TABLE IF NOT EXISTS node_measurements ("
        "node_id TEXT PRIMARY KEY, state_json TEXT NOT NULL, saved_ms INTEGER NOT NULL)"
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
        boundaries = [_layer(b) for b in data["boundaries"]]
        holders = {
            str(node_id): Shard(model, *(_layer(x) for x in span))
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


def _layer(value: Any) -> int:
    if type(value) is not int:  # not a float to truncate, nor a bool
        raise ValueError(f"not a layer index: {value!r}")
    return value


class PlanStore:
    """Reads and writes the `placement_plans` and `node_measurements` tables; only this
    class knows their SQL."""

    def __init__(self, db: sqlite_utils.Database) -> None:
        self._db = db
        self._plans: dict[str, str] = {}  # what placement_plans holds, by model
        self._measured: dict[str, str] = {}  # what node_measurements holds, by node

    def load(self) -> dict[str, ModelPlan]:
        plans: dict[str, ModelPlan] = {}
        for model, text in self._db.execute(
            "SELECT model, plan_json FROM placement_plans ORDER BY model"
        ).fetchall():
            self._plans[model] = text
            try:
                plans[model] = plan_from_json(model, text)
            except ValueError as exc:
                log.warning("the saved plan of model %s is unusable (%s); planning it afresh",
                            model, exc)  # fmt: skip
        return plans

    def load_measurements(self, into: Measurements) -> None:
        """Put the saved measurements back into `into`; a node whose row does not parse is
        skipped with a warning (its claim stands until it is measured again)."""
        for node_id, text in self._db.execute(
            "SELECT node_id, state_json FROM node_measurements ORDER BY node_id"
        ).fetchall():
            self._measured[node_id] = text
            try:
                into.restore(node_id, json.loads(text))
            except (ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError
                log.warning("the saved measurements of node %s are unusable (%s); it is "
                            "measured again", node_id, exc)  # fmt: skip

    def save(self, plans: Mapping[str, ModelPlan], measurements: Measurements) -> None:
        """Make the tables hold exactly `plans` and what `measurements` knows; writes
        nothing that did not change."""
        self._plans = self._sync(
            "placement_plans", "model", "plan_json", self._plans,
            {name: plan_to_json(p) for name, p in plans.items()},
        )  # fmt: skip
        self._measured = self._sync(
            "node_measurements", "node_id", "state_json", self._measured,
            {n: json.dumps(measurements.snapshot(n), sort_keys=True)
             for n in sorted(measurements.known())},
        )  # fmt: skip

    def _sync(
        self, table: str, key: str, column: str, held: dict[str, str], texts: dict[str, str]
    ) -> dict[str, str]:
        """Make `table` (which holds `held`) hold `texts`; returns what it holds now."""
        if texts == held:
            return held
        now_ms = int(time.time() * 1000)
        with self._db.atomic():
            self._db.conn.executemany(
                f"DELETE FROM {table} WHERE {key} = ?", [(k,) for k in held if k not in texts]
            )
            self._db.conn.executemany(
                f"INSERT INTO {table} ({key}, {column}, saved_ms) VALUES (?, ?, ?) "
                f"ON CONFLICT({key}) DO UPDATE SET {column} = excluded.{column}, "
                "saved_ms = excluded.saved_ms",
                [(k, t, now_ms) for k, t in texts.items() if held.get(k) != t],
            )
        return texts
