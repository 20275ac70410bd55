"""Exactness checks that take a device: run by tests/models/test_device.py (CPU always, CUDA when present) and
by scripts/gpu-check on a lent GPU, which has PyTorch and transformers but no pytest or scipy — so
this module imports neither. Each check raises AssertionError when the property fails."""

from __future__ import annotations

import itertools

import torch

from exactspec.drafters.model import ModelDrafter
from exactspec.drafters.ngram import NGramDrafter
from exactspec.drafters.suffix import PromptLookupDrafter
from exactspec.models.fast_llama import FastLlamaLM
from exactspec.models.torch_hf import HFCausalLM
from exactspec.speculative.loop import decode, decode_batch
from exactspec.speculative.sampling import SamplingParams, warp
from exactspec.speculative.verify import verify_reference
from exactspec.speculative.verify_torch import verify_rows

VOCAB = 8
PROMPT = [3, 5, 2, 3, 5]
LENGTH = 3  # tokens per continuation in the chi-square check -> VOCAB**3 = 512 outcomes


def devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def tiny_llama(seed: int, device: str, vocab: int = VOCAB, sharpness: float = 8.0, layers: int = 2):
    """A random Llama whose next-token laws are far from uniform (the conftest recipe), on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
        model.model.embed_tokens.weight.mul_(sharpness)
    return model.to(device)


def check_forward_matches_transformers(device: str) -> None:
    """Prefill, k-token forwards and rollbacks: the lean forward's logits equal transformers', in
    batch-invariant mode (the CPU default) and without it (the CUDA default)."""
    module = tiny_llama(3, device, vocab=16)
    ids = torch.randint(0, 16, (1, 40), generator=torch.Generator().manual_seed(0))
    for invariant in (True, False):
        hf, fast = HFCausalLM(module, set()), FastLlamaLM(module, set(), capacity=8, batch_invariant=invariant)
        for lm in (hf, fast):
            lm.prefill(ids[:, :10])
        for start, k, keep in [(10, 4, 12), (12, 6, 15), (15, 1, 16), (16, 9, 25)]:
            a, b = hf.forward(ids[:, start : start + k]), fast.forward(ids[:, start : start + k])
            assert a.device.type == b.device.type == torch.device(device).type
            assert torch.allclose(a, b, atol=1e-4), f"invariant={invariant}: max diff {(a - b).abs().max():.2e}"
            hf.truncate(keep)
            fast.truncate(keep)


def verifier_cases(n: int = 64, vocab: int = 12, seed: int = 0):
    """n random verification cases (γ = 1..6, half with draft laws, half point masses) whose uniforms
    force every acceptance length 0..γ: drafts before the target length get u = 0 (accepted whenever
    p(x) > 0), the one at it gets u just below 1 (rejected unless p(x) >= q(x))."""
    gen = torch.Generator().manual_seed(seed)
    for c in range(n):
        gamma = 1 + c % 6
        want = (c // 6) % (gamma + 1)
        target = torch.softmax(3 * torch.randn(gamma + 1, vocab, generator=gen), -1)
        draft = torch.softmax(3 * torch.randn(gamma, vocab, generator=gen), -1) if c % 2 else None
        ids = torch.randint(0, vocab, (gamma,), generator=gen)
        u = torch.rand(gamma + 1, generator=gen)
        u[:want] = 0.0
        if want < gamma:  # the draft least favoured by p / q there, so that u just below 1 rejects it
            u[want] = 1 - 1e-6
            ids[want] = (target[want] / (draft[want] if draft is not None else 1.0)).argmin()
        yield ids.tolist(), draft, target, u


def check_verifier_matches_reference(device: str) -> None:
    """verify_rows, batched over all cases at once (padded), equals verify_reference case by case."""
    cases = list(verifier_cases())
    for with_draft in (True, False):
        group = [c for c in cases if (c[1] is not None) == with_draft]
        K, V = max(len(c[0]) for c in group), group[0][2].shape[-1]
        ids = torch.zeros(len(group), K, dtype=torch.long)
        target, uniforms = torch.zeros(len(group), K + 1, V), torch.zeros(len(group), K + 1)
        draft = torch.zeros(len(group), K, V) if with_draft else None
        for j, (d, q, p, u) in enumerate(group):
            g = len(d)
            ids[j, :g], target[j, : g + 1], uniforms[j, : g + 1] = torch.tensor(d), p, u
            target[j, g + 1 :] = 1.0 / V  # padding a correct verifier never reads
            if with_draft:
                draft[j, :g] = q
        gammas = torch.tensor([len(c[0]) for c in group])
        accepted, nxt = verify_rows(ids.to(device), gammas, None if draft is None else draft.to(device),
                                    target.to(device), uniforms.to(device))
        seen = set()
        for j, (d, q, p, u) in enumerate(group):
            expected = verify_reference(d, q, p, u.tolist())
            got = d[: int(accepted[j])] + [int(nxt[j])]
            assert got == expected, (j, got, expected)
            seen.add((len(d), int(accepted[j])))
        assert {n for _, n in seen} == set(range(K + 1)), f"acceptance lengths covered: {sorted(seen)}"


def check_greedy_identity(device: str) -> None:
    """Greedy speculative output == plain greedy, token for token, both adapters, model and n-gram drafts."""
    target_module, draft_module = tiny_llama(0, device), tiny_llama(1, device, sharpness=4.0, layers=1)
    greedy = SamplingParams(temperature=0)
    for target in (FastLlamaLM(target_module, set()), HFCausalLM(target_module, set())):
        plain = list(decode(target, None, PROMPT, greedy, 0, 40))
        for gamma in (1, 3, 5):
            for drafter in (ModelDrafter(HFCausalLM(draft_module, set())), PromptLookupDrafter(),
                            NGramDrafter(VOCAB)):
                out = list(decode(target, drafter, PROMPT, greedy, gamma, 40, torch.Generator().manual_seed(0)))
                assert out == plain, (type(target).__name__, drafter.name, gamma)


def exact_law(target_module, params: SamplingParams) -> torch.Tensor:
    """[VOCAB**LENGTH] probability of every continuation under the warped target, by enumeration."""
    device = next(target_module.parameters()).device
    seqs = torch.tensor(list(itertools.product(range(VOCAB), repeat=LENGTH)))  # [N, L]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], dim=1).to(device)
    with torch.no_grad():
        logits = target_module(input_ids=ids).logits.float().cpu()  # [N, P+L, V]
    probs = warp(logits[:, len(PROMPT) - 1 : -1], params)  # [N, L, V]
    return probs.gather(-1, seqs[..., None]).squeeze(-1).double().prod(-1)


def chi_square_p(counts: torch.Tensor, law: torch.Tensor) -> float:
    """p-value of counts ~ Multinomial(law), pooling cells with expected count < 5 (no scipy:
    the chi-square survival function is the regularised upper incomplete gamma Q(df/2, x/2))."""
    if counts[law == 0].sum() > 0:  # a continuation the target gives zero probability was sampled
        return 0.0
    expected = law * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].sum()[None].double()])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64), stat / 2))


def always_accept(draft_ids, draft_probs, target_probs, generator=None):
    """A planted bug: accept every draft and take the bonus greedily."""
    return draft_ids + [int(target_probs[len(draft_ids)].argmax())]


def sample_counts(target, make_drafter, params, gamma, samples: int, verifier=None, rows: int = 500) -> torch.Tensor:
    """Counts of `samples` continuations drawn as the rows of batches of `rows` (one target forward per
    iteration serves them all); sample i has its own drafter and generator (seeded 1234 + i)."""
    counts = torch.zeros(VOCAB**LENGTH)
    extra = {} if verifier is None else {"verifier": verifier}
    for start in range(0, samples, rows):
        n = min(rows, samples - start)
        gens = [torch.Generator().manual_seed(1234 + start + r) for r in range(n)]
        out = [[] for _ in range(n)]
        for r, tokens in decode_batch(target, [make_drafter() for _ in range(n)], [PROMPT] * n, params, gamma, LENGTH,
                                      gens, **extra):
            out[r] += tokens
        for seq in out:
            counts[sum(t * VOCAB ** (LENGTH - 1 - i) for i, t in enumerate(seq))] += 1
    return counts


def check_chi_square_exactness(device: str, samples: int = 1500) -> None:
    """Speculative samples (model drafts, warped) follow the exact target law; the same test rejects
    a planted always-accept verifier (negative control)."""
    target_module, draft_module = tiny_llama(0, device), tiny_llama(1, device, sharpness=4.0, layers=1)
    target = FastLlamaLM(target_module, set(), capacity=16)

    def own_draft() -> ModelDrafter:  # each row's drafter keeps its own draft cache
        return ModelDrafter(HFCausalLM(draft_module, set()))

    params = SamplingParams(temperature=0.9, top_k=6)
    law = exact_law(target_module, params)
    counts = sample_counts(target, own_draft, params, 2, samples)
    p = chi_square_p(counts, law)
    assert p > 1e-3, f"chi-square p={p:.2e}"
    bad = sample_counts(target, own_draft, params, 2, samples, verifier=always_accept)
    assert chi_square_p(bad, law) < 1e-6, "the negative control was not rejected"


def check_batch_equals_rows(device: str) -> None:
    """A batch (one forward per iteration, on-device verification off the CPU) gives each row exactly
    what it gives alone with the same seed, sampled and greedy."""
    target = FastLlamaLM(tiny_llama(0, device), set(), capacity=16)
    prompts = [[3, 5, 2, 3, 5, 7, 2], [1, 2], [4, 4, 4, 4, 4, 4, 4, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [6]]
    for params in (SamplingParams(temperature=1.0, top_k=6), SamplingParams(temperature=0)):
        for make in (PromptLookupDrafter, lambda: NGramDrafter(VOCAB)):
            seeds = [10, 11, 12, 13]
            gens = [torch.Generator().manual_seed(s) for s in seeds]
            batch = {r: [] for r in range(len(prompts))}
            for r, tokens in decode_batch(target, [make() for _ in prompts], prompts, params, 3, 16, gens):
                batch[r] += tokens
            alone = [list(decode(target, make(), p, params, 3, 16, torch.Generator().manual_seed(s)))
                     for p, s in zip(prompts, seeds)]
            assert [batch[r] for r in range(len(prompts))] == alone


CHECKS = {
    "forward_matches_transformers": check_forward_matches_transformers,
    "verifier_matches_reference": check_verifier_matches_reference,
    "greedy_identity": check_greedy_identity,
    "chi_square_exactness": check_chi_square_exactness,
    "batch_equals_rows": check_batch_equals_rows,
}
