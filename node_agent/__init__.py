"""The Tessera node agent: runs on a volunteer's PC and lends its GPU (or CPU) to the swarm."""

__version__ = "0.1.0"
