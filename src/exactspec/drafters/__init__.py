"""Drafters: what proposes tokens for the target to verify (see speculative/interfaces.Drafter)."""

STORE_MB = 64  # default MiB of the suffix drafter's store of earlier outputs (drafters/suffix.py)
