"""Auto γ: how many drafts each iteration verifies, priced by measured costs.

`costs.py` prices an iteration (the target's T(k) by context depth and batch, a drafter's time);
`acceptance.py` learns α by match length and kind of copy; `policy.py` is the policy the decode loop
asks (`AutoGamma`, with its probe schedule `Probes`); `learned.py` is what an engine learns across
requests (the shared costs, acceptance and probes, saved costs, each request's view); `measure.py`
times the forwards that start the prices: the room's one file with I/O. The loop reaches the policy
only through the protocols of `speculative/interfaces.py`: nothing in `speculative/` imports this room."""
