"""Which node agents a coordinator takes.

A node agent older than the coordinator's protocol would misread what it is sent:
protobuf drops the fields it does not know, so an old agent asked to relay a step, to
answer logit probes or to compute the last position only would answer something else, and
be found wrong and slashed for being old. So registration refuses an agent older than
``Settings.min_agent_version`` (``serve --min-agent-version``, default MIN_AGENT_VERSION:
the oldest release that speaks this protocol), and says how to upgrade. An operator raises
it to keep out a release with a known flaw.
"""

from __future__ import annotations

import re

from protos.quoting import shown

# The oldest node agent release that speaks this coordinator's protocol.
MIN_AGENT_VERSION = "0.1.0"
UPGRADE = "pip install -U 'tessera-swarm[node]'"

_RELEASE = re.compile(r"^(\d{1,6})\.(\d{1,6})\.(\d{1,6})")

Release = tuple[int, int, int]


def release(version: str) -> Release | None:
    """MAJOR.MINOR.PATCH of ``version`` ("0.3.1", "0.3.1rc2", "0.3.1+local"), or None. A
    pre-release counts as its release: a node that runs one has chosen to test it."""
    match = _RELEASE.match(version)
    return None if match is None else (int(match[1]), int(match[2]), int(match[3]))


def refusal(agent_version: str, minimum: str) -> str | None:
    """Why an agent of ``agent_version`` may not register here, or None."""
    least = release(minimum)
    assert least is not None, f"min_agent_version {minimum!r} is not MAJOR.MINOR.PATCH"
    found = release(agent_version)
    if found is None:
        said = f"says it is {shown(agent_version, 64)}" if agent_version else "says no version"
        return (
            f"this node agent {said}, and this coordinator takes Tessera {minimum} or newer: "
            f"install a release ({UPGRADE}) and start the node again"
        )
    if found < least:
        return (
            f"this node agent is Tessera {agent_version}, and this coordinator takes {minimum} "
            f"or newer, whose protocol it speaks: upgrade this machine ({UPGRADE}) and start "
            "the node again"
        )
    return None
