"""Logits to probabilities (temperature, top-k, top-p) and sampling with explicit generators.

The same function shapes the target's p and the draft's q, so that the acceptance ratio
p/q compares the two distributions that are actually sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Temperatures below the smallest normal float32 cannot divide float32 logits (they round
# to 0 or lose their digits); they sample what their limit samples, the argmax: greedy.
MIN_TEMPERATURE = float(torch.finfo(torch.float32).tiny)


# Logits per block in `argmax`: a row's blocks' maxima, then the winning block's argmax.
ARGMAX_BLOCK = 1024


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1), the same indices (the first largest; NaN counts as largest), in a
    tenth of the time on a CPU for large vocabularies: torch's CPU argmax is a scalar loop
    (4.4 ms for 16 rows of Gemma 3's 262k logits, 6% of a verify step), its amax is
    vectorized (0.4 ms). The first largest lies in the first block whose maximum is the
    row's, at that block's own argmax."""
    width = logits.shape[-1]
    if logits.device.type != "cpu" or width < 2 * ARGMAX_BLOCK:
        return logits.argmax(-1)
    rows = logits.reshape(-1, width)
    whole = width // ARGMAX_BLOCK * ARGMAX_BLOCK
    maxima = rows[:, :whole].reshape(len(rows), -1, ARGMAX_BLOCK).amax(-1)  # (N, blocks)
    if whole < width:
        maxima = torch.cat([maxima, rows[:, whole:].amax(-1, keepdim=True)], 1)
    starts = maxima.argmax(-1, keepdim=True) * ARGMAX_BLOCK
    # The winning block's indices; a short last block repeats its last index (after the
    # real ones, so never the first largest).
    indices = (starts + torch.arange(ARGMAX_BLOCK)).clamp_(max=width - 1)
    best = rows.gather(1, indices).argmax(-1, keepdim=True)
    return indices.gather(1, best).reshape(logits.shape[:-1])


class NonFiniteLogits(ValueError):
    """A model gave NaN or infinite logits for some rows: no token can be chosen there."""

    def __init__(self, role: str, rows: list[int]):
        super().__init__(f"the {role} model gave non-finite logits (NaN or infinity) for batch row(s) {rows}; "
                         "its weights or configuration are broken (e.g. NaN weights, rms_norm_eps NaN or negative)")
        self.role, self.rows = role, rows


def non_finite_rows(logits: torch.Tensor, counts: list[int] | None = None) -> list[int]:
    """Rows b of logits (B, T, V) or (B, V) whose first counts[b] positions hold NaN or +inf,
    or no finite value (-inf alone marks a token impossible, which a model may do)."""
    # A row's maximum is NaN (amax propagates it), +inf, or -inf (no finite value) exactly where
    # it cannot give a token: one reduction (Gemma's 262k logits at width 25: 1 ms, where
    # isfinite(logits).all() took 25).
    peaks = logits.amax(-1)
    if bool(torch.isfinite(peaks).all()):
        return []
    bad = ~torch.isfinite(peaks if logits.dim() == 3 else peaks[:, None])  # (B, T)
    if counts is not None:
        bad &= torch.arange(bad.shape[1], device=bad.device)[None] < torch.tensor(counts, device=bad.device)[:, None]
    return bad.any(-1).nonzero().flatten().tolist()


def check_finite(logits: torch.Tensor, role: str, counts: list[int] | None = None) -> None:
    """Raise NonFiniteLogits naming the rows whose logits cannot give a token."""
    rows = non_finite_rows(logits, counts)
    if rows:
        raise NonFiniteLogits(role, rows)


@dataclass(frozen=True)
class Sampler:
    """How one row turns logits into a distribution: temperature 0 is greedy (the argmax)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        return probabilities(logits, self.temperature, self.top_k, self.top_p)


GREEDY = Sampler()


def row_probabilities(logits: torch.Tensor, samplers: list[Sampler]) -> torch.Tensor:
    """Distributions (B, ..., V) from logits (B, ..., V), row b shaped by samplers[b]. Rows
    with the same settings are computed together, by the same function as a row alone."""
    first = samplers[0]
    if all(s == first for s in samplers):
        return first.probabilities(logits)
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    groups: dict[Sampler, list[int]] = {}
    for row, sampler in enumerate(samplers):
        groups.setdefault(sampler, []).append(row)
    for sampler, rows in groups.items():
        index = torch.tensor(rows, device=logits.device)
        out[index] = sampler.probabilities(logits[index])
    return out


def probabilities(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """Turn logits (..., V) into a distribution (..., V) in float32.

    Temperature 0 (or below MIN_TEMPERATURE) gives a one-hot distribution on the argmax, so
    greedy drafting and greedy targets go through the same rejection rule as sampled ones.
    Any other temperature is exact: the largest logit is subtracted first, so a tiny
    temperature sends the others to -inf (probability 0) instead of overflowing to NaN.
    """
    raw = logits.float()
    if temperature < MIN_TEMPERATURE:
        return torch.nn.functional.one_hot(argmax(raw), raw.shape[-1]).float()
    logits = (raw - raw.amax(-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        # Ranked by the logits before scaling: a huge temperature can round distinct logits
        # to one value, and the largest must still come first.
        order = raw.masked_fill(logits == float("-inf"), float("-inf")).argsort(dim=-1, descending=True, stable=True)
        sorted_logits = logits.gather(-1, order)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p; the top token
        # always stays (the smallest set reaching any top_p > 0 holds it, even when top_p
        # rounds to 0 in float32).
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generators: list[torch.Generator], active: list[bool] | None = None) -> torch.Tensor:
    """Draw one token per row of probs (B, V), row b from generators[b]: (B,) long.

    Inverse-CDF sampling with one uniform per row: one generator per row keeps each row's
    draws independent of the rest of the batch, and a single vectorized search serves all.
    Rows that are not `active` draw nothing from their generator (their token is padding).
    """
    cdf = probs.double().cumsum(-1)  # (B, V)
    usable = (cdf[:, -1] > 0) & torch.isfinite(cdf[:, -1])
    if not bool(usable.all()):  # never a silent token 0
        raise ValueError(f"cannot sample: the distributions of batch rows {(~usable).nonzero().flatten().tolist()} "
                         "have no probability mass or are not finite")
    counts = [1] * len(generators) if active is None else [int(a) for a in active]
    u = uniform(counts, 1, generators, probs.device).double() * cdf[:, -1:]  # (B, 1)
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(1)
    # Rounding can push u past the last cdf step: fall back to the last token with mass.
    last_with_mass = (probs > 0).long().cumsum(-1).argmax(-1)
    return torch.minimum(tokens, last_with_mass)


def uniform(counts: list[int], width: int, generators: list[torch.Generator], device) -> torch.Tensor:
    """(B, width) uniforms: row b draws counts[b] values in [0, 1) from generators[b] and is
    padded with 1.0. Drawing only what a row uses keeps its stream independent of the batch."""
    rows = []
    for count, gen in zip(counts, generators):
        drawn = torch.rand(count, generator=gen, device=device)
        rows.append(torch.cat([drawn, torch.ones(width - count, device=device)]))
    return torch.stack(rows)


def make_generators(seeds: list[int | None], device) -> list[torch.Generator]:
    """One generator per row; a None seed draws a fresh one from the OS."""
    gens = []
    for seed in seeds:
        gen = torch.Generator(device=device)
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(seed)
        gens.append(gen)
    return gens
