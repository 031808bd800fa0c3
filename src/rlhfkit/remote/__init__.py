"""Rewards served over HTTP: the client behind `reward: http://host:port/path` (client.py) and
`rlhfkit serve-reward` (server.py), which speak one JSON contract (docs/remote.md)."""
