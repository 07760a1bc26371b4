"""The GPO synthetic experiment (VSE∞ supplement B.3, Table 11): can a coefficient generator g(k, N) learn a
known pooling from (input set, pooled output) pairs, and does it generalise to set sizes it never saw?

Protocol (paper + docs/gpo_synthetic.md for what the paper leaves open):
- input: sets of N random vectors (i.i.d. standard normal, `dim` dimensions); target: the ground-truth
  pooling sum_k theta*_k(N) x_(k),d over each dimension's values sorted in descending order;
- patterns theta*(N): A (average), M-K (mean of the K largest), T-P% (mean of the top ceil(P% N)),
  L (weight of the k-th largest proportional to N - k: decreasing linearly to zero at k = N), all summing to 1;
- four generators, each producing scores that a softmax with GPO's temperature 0.1 turns into theta:
  Index+Interp. (a learned vector on [0, 1], linearly interpolated at (k-1)/(N-1), FSPool style),
  Cos/Sin+MLP (sin/cos position -> MLP; a position's score ignores N), Index+BiGRU (learned index embedding ->
  BiGRU), Cos/Sin+BiGRU (vsekit's `GPO` itself);
- training sizes N in [20, 100], MSE on the pooled outputs, Adam; evaluation on every N in [10, 120]:
  RMSE between predicted and true coefficients, per size over its N coefficients, then the root of the mean
  squared error over the sizes of a group: SEEN (20-100), UNSEEN smaller (10-19) and larger (101-120).

    from vsekit_lab.experiments.gpo_synthetic import run_gpo_synthetic, format_table
    result = run_gpo_synthetic(steps=300)
    print(format_table(result))
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from vsekit.errors import VseInputError
from vsekit.pooling.gpo import GPO, positional_encoding_1d

PATTERNS = ("A", "M-1", "M-10", "T-50%", "L")
DESIGNS = ("Index+Interp.", "Cos/Sin+MLP", "Index+BiGRU", "Cos/Sin+BiGRU")
GROUPS = {"seen": (20, 100), "smaller": (10, 19), "larger": (101, 120)}
TRAIN_SIZES = GROUPS["seen"]
MAX_SIZE = GROUPS["larger"][1]

# Table 11 of the VSE∞ supplement: design -> pattern -> (seen, unseen smaller, unseen larger)
PAPER = {
    "Index+Interp.": {
        "A": (0, 0, 0),
        "M-1": (0.065, 0.017, 0.070),
        "M-10": (0.030, 0.141, 0.014),
        "T-50%": (0.011, 0.039, 0.005),
        "L": (0.004, 0.016, 0.002),
    },
    "Cos/Sin+MLP": {
        "A": (0.012, 0.054, 0.006),
        "M-1": (0.003, 0.003, 0.003),
        "M-10": (0.047, 0.093, 0.030),
        "T-50%": (0.032, 0.096, 0.026),
        "L": (0.022, 0.065, 0.028),
    },
    "Index+BiGRU": {
        "A": (0.002, 0.006, 0.003),
        "M-1": (0.002, 0.004, 0.001),
        "M-10": (0.026, 0.052, 0.018),
        "T-50%": (0.011, 0.049, 0.007),
        "L": (0.008, 0.015, 0.005),
    },
    "Cos/Sin+BiGRU": {
        "A": (0, 0.002, 0),
        "M-1": (0.005, 0.010, 0.004),
        "M-10": (0.010, 0.031, 0.007),
        "T-50%": (0.006, 0.046, 0.004),
        "L": (0, 0.005, 0.001),
    },
}


def true_weights(pattern: str, n: int) -> torch.Tensor:
    """Ground-truth coefficients theta*_1..theta*_N (largest first) of a pattern for a set of size n."""
    if n < 1:
        raise VseInputError(f"set size must be >= 1, got {n}")
    k = torch.arange(1, n + 1, dtype=torch.float64)
    if pattern == "A":
        w = torch.ones(n, dtype=torch.float64)
    elif pattern.startswith("M-"):
        w = (k <= int(pattern[2:])).double()
    elif pattern.startswith("T-") and pattern.endswith("%"):
        w = (k <= math.ceil(float(pattern[2:-1]) / 100 * n)).double()
    elif pattern == "L":
        w = (n - k) if n > 1 else torch.ones(1, dtype=torch.float64)
    else:
        raise VseInputError(f"unknown pattern {pattern!r}; choose from A, M-K, T-P%, L")
    return (w / w.sum()).float()


def _masked_softmax(scores: torch.Tensor, sizes: torch.Tensor, temperature: float) -> torch.Tensor:
    mask = torch.arange(scores.shape[1], device=scores.device)[None, :] < sizes.to(scores.device)[:, None]
    return torch.softmax(scores.masked_fill(~mask, -1e4) / temperature, dim=1) * mask


class InterpGenerator(nn.Module):
    """Index+Interp.: `pieces + 1` learned scores on [0, 1], read at (k-1)/(N-1) by linear interpolation."""

    def __init__(self, pieces: int = 20, temperature: float = 0.1) -> None:
        super().__init__()
        self.values = nn.Parameter(torch.zeros(pieces + 1))
        self.pieces, self.temperature = pieces, temperature

    def forward(self, sizes: torch.Tensor, max_len: int) -> torch.Tensor:
        k = torch.arange(max_len, dtype=torch.float32, device=self.values.device)[None, :]
        pos = (k / (sizes.to(k.device)[:, None].float() - 1).clamp_min(1)).clamp(0, 1) * self.pieces
        lo = pos.floor().long().clamp(max=self.pieces - 1)
        frac = pos - lo
        scores = self.values[lo] * (1 - frac) + self.values[lo + 1] * frac
        return _masked_softmax(scores, sizes, self.temperature)


class MLPGenerator(nn.Module):
    """Cos/Sin+MLP: the score of position k is MLP(PE(k)), blind to the set size."""

    def __init__(self, d_pe: int = 32, d_hidden: int = 32, temperature: float = 0.1) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(d_pe, d_hidden),
            nn.ReLU(),
            nn.Linear(d_hidden, d_hidden),
            nn.ReLU(),
            nn.Linear(d_hidden, 1),
        )
        self.d_pe, self.temperature = d_pe, temperature

    def forward(self, sizes: torch.Tensor, max_len: int) -> torch.Tensor:
        scores = self.mlp(positional_encoding_1d(self.d_pe, max_len, self.mlp[0].weight.device)).squeeze(-1)
        return _masked_softmax(scores.expand(len(sizes), -1), sizes, self.temperature)


class IndexGRUGenerator(nn.Module):
    """Index+BiGRU: GPO's BiGRU and linear scorer fed a learned embedding of the index k (not sin/cos).

    Indices beyond the largest training size keep their random initial embedding, as in the paper's design.
    """

    def __init__(
        self, max_len: int = MAX_SIZE, d_pe: int = 32, d_hidden: int = 32, temperature: float = 0.1
    ) -> None:
        super().__init__()
        self.index = nn.Embedding(max_len, d_pe)
        self.gru = nn.GRU(d_pe, d_hidden, num_layers=1, batch_first=True, bidirectional=True)
        self.linear = nn.Linear(d_hidden, 1, bias=False)
        self.max_len, self.temperature = max_len, temperature

    def forward(self, sizes: torch.Tensor, max_len: int) -> torch.Tensor:
        if max_len > self.max_len:
            raise ValueError(f"the index embedding covers sizes up to {self.max_len}, asked for {max_len}")
        sizes = sizes.to("cpu", torch.int64).clamp(min=1)
        x = self.index.weight[:max_len].unsqueeze(0).expand(len(sizes), -1, -1)
        packed = pack_padded_sequence(x, sizes, batch_first=True, enforce_sorted=False)
        out, _ = pad_packed_sequence(self.gru(packed)[0], batch_first=True, total_length=max_len)
        half = out.shape[-1] // 2
        scores = self.linear((out[..., :half] + out[..., half:]) / 2).squeeze(-1)
        return _masked_softmax(scores, sizes, self.temperature)


class GPOGenerator(nn.Module):
    """Cos/Sin+BiGRU: vsekit's GPO (the design of the main paper)."""

    def __init__(self, d_pe: int = 32, d_hidden: int = 32, temperature: float = 0.1) -> None:
        super().__init__()
        self.gpo = GPO(d_pe, d_hidden, temperature)

    def forward(self, sizes: torch.Tensor, max_len: int) -> torch.Tensor:
        return self.gpo.weights_for_lengths(sizes, max_len)


def make_generator(design: str) -> nn.Module:
    """A coefficient generator: `gen(sizes[S], max_len) -> theta[S, max_len]` (rows sum to 1, zero padding)."""
    if design == "Index+Interp.":
        return InterpGenerator()
    if design == "Cos/Sin+MLP":
        return MLPGenerator()
    if design == "Index+BiGRU":
        return IndexGRUGenerator()
    if design == "Cos/Sin+BiGRU":
        return GPOGenerator()
    raise VseInputError(f"unknown design {design!r}; choose from {', '.join(DESIGNS)}")


def train_generator(
    design: str,
    pattern: str,
    steps: int = 300,
    sets_per_size: int = 1,
    dim: int = 16,
    lr: float = 3e-3,
    seed: int = 0,
    device: str | torch.device = "cpu",
    sizes: tuple[int, int] = TRAIN_SIZES,
) -> nn.Module:
    """Fit a generator to (set, pooled output) pairs of one pattern.

    Each step draws `sets_per_size` fresh random sets of every training size (`sizes`, inclusive; the paper's
    20..100) of `dim`-d vectors; the
    weights are computed once per size (they depend on N only, and a BiGRU's cost is set by the longest
    sequence, not by how many there are). Adam, learning rate x0.1 for the last 30% of the steps.
    """
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    dev = torch.device(device)
    gen = make_generator(design).to(dev)
    opt = torch.optim.Adam(gen.parameters(), lr=lr)
    lo, hi = sizes
    if not 1 <= lo <= hi:
        raise VseInputError(f"training sizes must satisfy 1 <= low <= high, got {sizes}")
    unique = torch.arange(lo, hi + 1)
    sizes_t = unique.repeat(sets_per_size)
    max_len = hi
    theta_true = torch.stack(
        [nn.functional.pad(true_weights(pattern, int(n)), (0, max_len - int(n))) for n in sizes_t]
    )
    theta_true = theta_true.to(dev)
    for step in range(steps):
        if step == int(0.7 * steps):
            for group in opt.param_groups:
                group["lr"] = lr * 0.1
        theta = gen(unique, max_len).repeat(sets_per_size, 1)  # [sets, max_len]
        x = torch.randn(len(sizes_t), max_len, dim, generator=g)
        x = x.masked_fill(torch.arange(max_len)[None, :, None] >= sizes_t[:, None, None], float("-inf"))
        x = x.to(dev).sort(dim=1, descending=True).values.nan_to_num(neginf=0.0)  # padding sorts last, then 0
        pred = (theta.unsqueeze(-1) * x).sum(1)
        target = (theta_true.unsqueeze(-1) * x).sum(1)
        loss = nn.functional.mse_loss(pred, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return gen


@torch.no_grad()
def coefficient_rmse(gen: nn.Module, pattern: str) -> dict[str, float]:
    """RMSE of predicted vs true coefficients for each size group (see the module docstring)."""
    out = {}
    for name, (lo, hi) in GROUPS.items():
        sizes = torch.arange(lo, hi + 1)
        theta = gen(sizes, hi).float().cpu()
        mse = [
            float(((theta[i, :n] - true_weights(pattern, int(n))) ** 2).mean()) for i, n in enumerate(sizes)
        ]
        out[name] = math.sqrt(sum(mse) / len(mse))
    return out


def _one_run(args: tuple) -> dict[str, float]:
    """One (design, pattern, seed) training + evaluation; a top-level function so worker processes can run it."""
    design, pattern, steps, sets_per_size, dim, lr, seed, device, threads = args
    if threads:
        torch.set_num_threads(threads)
    return coefficient_rmse(
        train_generator(design, pattern, steps, sets_per_size, dim, lr, seed, device), pattern
    )


def run_gpo_synthetic(
    designs: tuple[str, ...] = DESIGNS,
    patterns: tuple[str, ...] = PATTERNS,
    steps: int = 300,
    sets_per_size: int = 1,
    dim: int = 16,
    lr: float = 3e-3,
    seeds: tuple[int, ...] = (0,),
    device: str = "cpu",
    jobs: int = 1,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Train every (design, pattern) pair for each seed; RMSE per group, mean over seeds.

    `jobs > 1` runs the independent trainings in that many worker processes (one torch thread each); every run
    is seeded on its own, so the numbers do not depend on `jobs`.
    """
    tasks = [
        (d, p, steps, sets_per_size, dim, lr, s, device, 1 if jobs > 1 else 0)
        for d in designs
        for p in patterns
        for s in seeds
    ]
    t_start = time.perf_counter()
    if jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            outs = list(pool.map(_one_run, tasks))
    else:
        outs = []
        for task in tasks:
            outs.append(_one_run(task))
            if log:
                r = outs[-1]
                log(
                    f"{task[0]:14s} {task[1]:6s} seed {task[6]}: seen {r['seen']:.4f} smaller {r['smaller']:.4f} "
                    f"larger {r['larger']:.4f}  ({time.perf_counter() - t_start:.0f}s)"
                )
    by_key = dict(zip([(t[0], t[1], t[6]) for t in tasks], outs))
    results: dict[str, dict[str, dict[str, float]]] = {}
    for d in designs:
        results[d] = {}
        for p in patterns:
            runs = [by_key[(d, p, s)] for s in seeds]
            results[d][p] = {k: sum(r[k] for r in runs) / len(runs) for k in GROUPS}
    return {
        "results": results,
        "settings": {
            "steps": steps,
            "sets_per_size": sets_per_size,
            "dim": dim,
            "lr": lr,
            "seeds": list(seeds),
            "device": str(device),
            "seconds": round(time.perf_counter() - t_start, 1),
        },
    }


def _f(x: float) -> str:
    return "0" if round(x, 3) == 0 else f"{x:.3f}".lstrip("0")


def format_table(result: dict, paper: bool = True) -> str:
    """Markdown: ours (and the paper's Table 11 row under it) — seen, then unseen smaller / larger."""
    res = result["results"]
    patterns = list(next(iter(res.values())))
    head = ["design", "source"] + [f"seen {p}" for p in patterns] + [f"unseen {p} (s/l)" for p in patterns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for design, by_pattern in res.items():
        ours = [_f(by_pattern[p]["seen"]) for p in patterns]
        ours += [f"{_f(by_pattern[p]['smaller'])}/{_f(by_pattern[p]['larger'])}" for p in patterns]
        lines.append(f"| {design} | vsekit | " + " | ".join(ours) + " |")
        if paper and design in PAPER:
            ref = [_f(PAPER[design][p][0]) if p in PAPER[design] else "–" for p in patterns]
            ref += [
                f"{_f(PAPER[design][p][1])}/{_f(PAPER[design][p][2])}" if p in PAPER[design] else "–"
                for p in patterns
            ]
            lines.append(f"| {design} | paper | " + " | ".join(ref) + " |")
    return "\n".join(lines)


def ranking_summary(result: dict) -> dict:
    """The paper's three claims, checked on our numbers (mean RMSE over patterns)."""
    res = result["results"]
    mean = {d: {g: sum(r[g] for r in by.values()) / len(by) for g in GROUPS} for d, by in res.items()}
    overall = {d: (m["seen"] + m["smaller"] + m["larger"]) / 3 for d, m in mean.items()}
    kmax = [p for p in next(iter(res.values())) if p.startswith("M-")]
    out = {"mean_rmse": mean, "overall": overall, "best_overall": min(overall, key=overall.get)}
    if kmax and "Index+Interp." in res:
        km = {
            d: sum(res[d][p]["seen"] + res[d][p]["smaller"] + res[d][p]["larger"] for p in kmax)
            / (3 * len(kmax))
            for d in res
        }
        out["kmax_rmse"] = km
        out["interp_worst_on_kmax"] = max(km, key=km.get) == "Index+Interp."
    out["smaller_harder_than_larger"] = {d: m["smaller"] > m["larger"] for d, m in mean.items()}
    return out
