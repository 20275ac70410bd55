"""The algorithm, no I/O: the one decode loop over a batch of rows (`loop.py`), the verifiers
(`verify.py`, `verify_torch.py`), sampling and warps, the per-position target law (`law.py`) and the
grammars it masks with (`grammar.py`), the cost model and auto γ, and the two interfaces the rest of
the package implements (`interfaces.py`)."""
