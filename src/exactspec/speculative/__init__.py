"""The algorithm, no I/O: the one decode loop over a batch of rows (`loop.py`: propose, score, accept,
commit; `propose.py` and the lookup spacing beside it, `lookups.py`), the verifiers (`verify.py`,
`verify_torch.py`, the rules that apply them: `accept.py`), sampling and warps, the per-position target
law (`law.py`) and the grammars it masks with (`grammar.py`), a request's settings (`params.py`), the
prefix cache, and the interfaces the rest of the package implements (`interfaces.py`: the adapter, the
drafter, the γ policy and their optional capabilities). A fixed γ is a policy too (`fixed_gamma.py`);
auto γ lives in its own room (`exactspec.autogamma`), which this package never imports."""
