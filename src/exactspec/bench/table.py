"""`exactspec tune --table`: the paper's analysis (Leviathan et al. 2023, Table 3 and Theorem 3.8) on the
user's own target, drafters and workloads.

Per drafter x temperature x workload: α measured while decoding the workload's prompts at one fixed γ,
c = the drafter's time per token / T(1), the speed-up at that γ predicted by Theorem 3.8 (verifying
γ+1 tokens costs one step) and by our cost model (the measured T(γ+1)/T(1)), the speed-up measured
side by side against our plain decoding of the same prompts (interleaved, one process), and the
optimal γ under each model. Runs are fixed-length at T > 0 (as in the bench), so sampled lengths do
not swamp the ratio. With lenience values < 1 (lossy, see verify.py) each cell is repeated per value:
α and the speed-up rise as L falls, and the output stops being the target's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..speculative import theory
from ..engine import Engine
from ..speculative.sampling import SamplingParams
from ..stats import Stats, total
from .workloads import load_workload


@dataclass
class TableRow:
    drafter: str
    temperature: float
    workload: str
    lenience: float  # 1 = exact
    gamma: int  # the γ the row was measured at
    alpha: float  # per-token acceptance (Stats.alpha)
    c: float  # drafter's time per token / T(1)
    predicted_thm38: float  # Theorem 3.8 at γ
    predicted_tk: float  # our T(k) cost model at γ
    measured: float  # tokens/s speculative / tokens/s plain, same prompts
    best_gamma_thm38: int
    best_gamma_tk: int

    def to_dict(self) -> dict:
        return asdict(self)


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams, max_new: int, gamma: int,
         draft: str) -> Stats:
    stats = [Stats() for _ in prompts]
    for i, ids in enumerate(prompts):
        for _ in engine.stream_ids(ids, params, max_new, gamma, i, stats[i], draft, stop_on_eos=params.greedy):
            pass
    return total(stats)


def measure_table(engine: Engine, drafters: list[str], temperatures: list[float], workloads: list[str],
                  gamma: int = 4, prompts: int = 2, max_new_tokens: int = 32, progress=None,
                  leniences: list[float] = (1.0,)) -> list[TableRow]:
    rows = []
    for workload in workloads:
        prompt_ids = [engine.encode(p) for p in load_workload(workload)[:prompts]]
        for temperature, drafter, lenience in ((t, d, ln) for t in temperatures for d in drafters for ln in leniences):
            params = SamplingParams(temperature=temperature, lenience=lenience)
            cost = engine.cost_model(drafter)
            plain, spec = [], []
            for ids in prompt_ids:  # interleaved per prompt: machine noise hits both sides alike
                plain.append(_run(engine, [ids], SamplingParams(temperature=temperature), max_new_tokens, 0,
                                  "none"))
                spec.append(_run(engine, [ids], params, max_new_tokens, gamma, drafter))
                if progress is not None:
                    progress.update(1)
            plain_s, spec_s = total(plain), total(spec)
            alpha = spec_s.alpha or 0.0
            c = cost.draft_s_per_token / cost.target_s[0]
            rows.append(TableRow(
                drafter, temperature, workload, lenience, gamma, alpha, c,
                predicted_thm38=theory.walltime_factor(alpha, gamma, c),
                predicted_tk=cost.predicted_speedup(alpha, gamma),
                measured=(spec_s.tokens_per_s or 0.0) / (plain_s.tokens_per_s or float("inf")),
                best_gamma_thm38=theory.optimal_gamma(alpha, c, max_gamma=cost.max_gamma),
                best_gamma_tk=cost.best_gamma(alpha)))
    return rows


def to_markdown(rows: list[TableRow], ratios: list[float]) -> str:
    lenient = any(r.lenience != 1 for r in rows)
    lines = ["| drafter | T | workload | " + ("lenience | " if lenient else "") + "α | c | γ | predicted (Thm 3.8) | "
             "predicted (T(k)) | measured | best γ (Thm 3.8) | best γ (T(k)) |",
             "|---|---|---|" + ("---|" if lenient else "") + "---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.drafter} | {r.temperature:g} | {r.workload} | "
                     + (f"{r.lenience:g}{'' if r.lenience == 1 else ' (lossy)'} | " if lenient else "")
                     + f"{r.alpha:.2f} | {r.c:.3f} | {r.gamma} | "
                     f"{r.predicted_thm38:.2f}× | {r.predicted_tk:.2f}× | {r.measured:.2f}× | "
                     f"{r.best_gamma_thm38} | {r.best_gamma_tk} |")
    lines.append("\nT(k)/T(1), k = 1..: " + ", ".join(f"{x:.2f}" for x in ratios))
    return "\n".join(lines)
