"""A fail-over onto the node that was checking the failed one, while its checks still run.

Real stage servers on loopback. Layers [0, 2) have a primary and one replica, which checks
every call of the primary (scripted draws) on its slower background thread, slower still
here: with deferred checks (as ``Client.generate`` steps) the checks queue up on it. The
primary's server then goes away, and the driver fails over to that very replica and
replays the history there. The checks still queued for the dead primary's calls must not
run on that cache after the replay: each would roll it back to the end of the step it
checks, and the next step would find positions missing (FAILED_PRECONDITION), one more
replay each time.
"""

from __future__ import annotations

import threading
import time

import numpy as np
from data_plane.stage_harness import MODEL, StageNode, reference_greedy
from data_plane.test_driver import PROMPT
from verification.test_catch_up_audits import swarm

from client.driver import PipelineDriver

NEW_TOKENS = 10
STOP_AFTER_TOKEN = 5
CHECK_S = 0.15  # each of the replica's checks takes at least this long


def slow_checks(node: StageNode) -> None:
    """Make every call the node runs for a verifier take CHECK_S longer."""
    stage = node.manager.find(MODEL, 0, 2).stage_for(0, 2)
    original = stage.forward

    def forward(*args, **kwargs):  # type: ignore[no-untyped-def]
        if threading.current_thread().name.startswith("tessera-check"):
            time.sleep(CHECK_S)
        return original(*args, **kwargs)

    stage.forward = forward


async def deferred_greedy(
    driver: PipelineDriver, new_tokens: int, stop_after: int, primary: StageNode
) -> list[int]:
    """Greedy decode with every step's checks deferred; the primary stops after token
    ``stop_after``."""
    logits = await driver.step(PROMPT, last_only=True, defer_checks=True)
    out: list[int] = []
    for index in range(new_tokens):
        out.append(int(np.argmax(logits[0])))
        if index == stop_after:
            await primary.server.stop(0)
        if index + 1 < new_tokens:
            logits = await driver.step([out[-1]], last_only=True, defer_checks=True)
    assert await driver.settle_deferred(wait=True) is None
    return out


async def test_checks_queued_on_the_replacement_do_not_roll_its_cache_back(
    start_node, keys, checkpoint
) -> None:
    driver, draws, primary, checker, mismatches = await swarm(start_node, keys)
    draws.armed = True  # every call of the primary is checked, on the replica
    slow_checks(checker)

    tokens = await deferred_greedy(driver, NEW_TOKENS, STOP_AFTER_TOKEN, primary)
    assert tokens == reference_greedy(checkpoint, PROMPT, NEW_TOKENS)
    # One fail-over, onto the replica, and no replay after it: its cache stayed the
    # pipeline's from the replay on.
    assert [(f.failed_node_id, f.replacement_node_ids, f.via) for f in driver.failovers] == [
        (primary.node_id, (checker.node_id,), "alternate")
    ]
    assert [h.node_id for h in driver.route][0] == checker.node_id
    stats = driver.verifier.stats
    assert not stats.findings and not mismatches
    # The checks that had run before the primary stopped were compared, and agreed.
    assert stats.checked[primary.node_id] >= 1
    await driver.close()
