"""mu and sigma estimators, validated on linear regression where they are known in closed form.

Model: x ~ N(0, H) with H diagonal, y = x·w* + ε, ε ~ N(0, s²), per-sample loss ½(x·w - y)². With
δ = w - w* the per-sample gradient is z = (x·δ - ε) x, and (Isserlis' theorem)

    g = H δ,   Σ = Cov z = (δᵀHδ + s²) H + g gᵀ,
    mu = |g|²,  tr Σ = (δᵀHδ + s²) tr H + |g|²,  gᵀΣg = (δᵀHδ + s²) gᵀHg + |g|⁴,
    u_aᵀΣu_b = (δᵀHδ + s²) u_aᵀHu_b + (g·u_a)(g·u_b).

Ranks draw fresh samples at fixed w, so the per-step estimates of mu and tr Σ are independent draws,
and so are the errors of the cross term given its directions (martingale differences): tolerances
are 5 standard errors of the mean over the simulated steps, measured from their spread. The ratio
that gives sigma² uses directions that carry over between steps; its standard error comes from
block means over blocks much longer than the directions' memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from sklearn import datasets

from deft.errors import ContractError
from deft.preserver.noise import (
    DirectionPair,
    LocalStats,
    NoiseEstimator,
    StepEstimate,
    all_gather_stats,
    local_stats,
    step_estimate,
)
from tests._dist import run_ranks
from tests._dist import values as rank_values


@dataclass
class LinReg:
    h: np.ndarray
    delta: np.ndarray
    s: float

    @property
    def c(self) -> float:
        return float(self.delta @ (self.h * self.delta)) + self.s ** 2

    @property
    def g(self) -> np.ndarray:
        return self.h * self.delta

    @property
    def mu(self) -> float:
        return float(self.g @ self.g)

    @property
    def trace(self) -> float:
        return self.c * float(self.h.sum()) + self.mu

    @property
    def sigma2(self) -> float:
        return self.c * float(self.g @ (self.h * self.g)) + self.mu ** 2

    def bilinear(self, u: np.ndarray, v: np.ndarray) -> float:
        """uᵀ Σ v."""
        return self.c * float(u @ (self.h * v)) + float(self.g @ u) * float(self.g @ v)

    def cov(self) -> np.ndarray:
        return self.c * np.diag(self.h) + np.outer(self.g, self.g)

    def per_sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = rng.standard_normal((n, self.h.size)) * np.sqrt(self.h)
        eps = rng.normal(0.0, self.s, n)
        return (x @ self.delta - eps)[:, None] * x


def make(d: int, scale: float, s: float, seed: int) -> LinReg:
    rng = np.random.default_rng(seed)
    return LinReg(h=np.linspace(0.2, 2.0, d), delta=scale * rng.standard_normal(d) / math.sqrt(d), s=s)


def simulate(draw, bilinear, ranks: int, batch: int, steps: int, rng: np.random.Generator, decay: float = 0.9):
    """R ranks of ``batch`` fresh samples per step (``draw(n)`` returns n per-sample gradients), with
    directions kept as :class:`DirectionPair` does: interleaved EMAs of the averaged gradient.

    Returns the step estimates and, per step, the exact u_aᵀΣu_b of the directions used (NaN when
    ``bilinear`` is None)."""
    dirs: list[np.ndarray | None] = [None, None]
    out: list[StepEstimate] = []
    exact: list[float] = []
    for t in range(steps):
        g_r = draw(ranks * batch).reshape(ranks, batch, -1).mean(1)
        ua, ub = dirs
        have = ua is not None and ub is not None
        parts = [LocalStats(float(v @ v), float(v @ ua) if have else None, float(v @ ub) if have else None, batch)
                 for v in g_r]
        g_bar = g_r.mean(0)
        est = step_estimate(parts, float(g_bar @ g_bar), float(ua @ ub) if have else None)
        assert est is not None
        out.append(est)
        exact.append(bilinear(ua, ub) if have and bilinear is not None else math.nan)
        slot = t % 2
        dirs[slot] = g_bar.copy() if dirs[slot] is None else decay * dirs[slot] + (1 - decay) * g_bar
    return out, np.array(exact)


def mean_se(x: np.ndarray) -> tuple[float, float]:
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size))


def ratio_and_block_se(est: list[StepEstimate], blocks: int = 20) -> tuple[float, float]:
    """E[cross] / E[dot] over the steps with directions, and its standard error from block means."""
    c = np.array([e.cross for e in est if e.cross is not None])
    d = np.array([e.dot for e in est if e.dot is not None])
    rho = c.sum() / d.sum()
    n = (c.size // blocks) * blocks
    cb = c[:n].reshape(blocks, -1).mean(1)
    db = d[:n].reshape(blocks, -1).mean(1)
    se = float((cb - rho * db).std(ddof=1) / math.sqrt(blocks) / db.mean())
    return float(rho), se


def test_closed_form_covariance_matches_per_sample_gradients():
    lr = make(d=6, scale=1.5, s=0.7, seed=0)
    z = lr.per_sample(np.random.default_rng(1), 400_000)
    emp_g = z.mean(0)
    emp_cov = np.cov(z, rowvar=False)
    # Per-entry standard errors of the empirical moments, from the samples themselves.
    se_g = z.std(0, ddof=1) / math.sqrt(len(z))
    assert np.all(np.abs(emp_g - lr.g) < 5 * se_g)
    zc = z - emp_g
    se_cov = np.sqrt(np.var(zc[:, :, None] * zc[:, None, :], axis=0) / len(z))
    assert np.all(np.abs(emp_cov - lr.cov()) < 5 * se_cov + 1e-12)


@pytest.mark.parametrize("ranks,batch,scale", [(2, 32, 3.0), (4, 32, 3.0), (8, 16, 0.3)])
def test_linear_regression_unbiased_and_sigma_consistent(ranks, batch, scale):
    lr = make(d=20, scale=scale, s=0.5, seed=ranks)
    rng = np.random.default_rng(10 + ranks)
    steps = 4000
    est, exact = simulate(lambda n: lr.per_sample(rng, n), lr.bilinear, ranks, batch, steps, rng)
    for name, values, truth in [("mu", np.array([e.mu for e in est]), lr.mu),
                                ("trace", np.array([e.trace for e in est]), lr.trace)]:
        m, se = mean_se(values)
        assert abs(m - truth) < 5 * se, (name, m, truth, se)
        assert se < 0.05 * truth  # the check is not vacuous
    # The cross term is unbiased for u_aᵀΣu_b of the directions it used.
    m, se = mean_se(np.array([e.cross for e in est[2:]]) - exact[2:])
    assert abs(m) < 5 * se
    # sigma² = mu * E[cross] / E[dot] is consistent for gᵀΣg. The cross term is heavy-tailed (a
    # sample covariance over R - 1 degrees of freedom), so the block standard error is itself noisy:
    # over 36 independent seeds and these settings the largest |z| was 4.4, hence 5.
    rho, rho_se = ratio_and_block_se(est[2:])
    truth = lr.sigma2 / lr.mu
    assert abs(rho - truth) < 5 * rho_se, (rho, truth, rho_se)
    assert rho_se < 0.1 * truth


def _digits_per_sample_gradients(train_steps: int) -> np.ndarray:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add contention on a shared machine
    try:
        return _digits_gradients(train_steps)
    finally:
        torch.set_num_threads(threads)


def _digits_gradients(train_steps: int) -> np.ndarray:
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    x_np, y_np = datasets.load_digits(return_X_y=True)
    x = torch.tensor(x_np / 16.0, dtype=torch.float32)
    y = torch.tensor(y_np)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(train_steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return torch.nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    per = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([g.reshape(len(x), -1) for g in per.values()], 1).double().numpy()


def test_real_mlp_on_digits():
    """A 64-32-10 tanh MLP after 100 full-batch SGD steps on sklearn's digits (1797 samples): exact
    per-sample gradients give the population g and Σ; ranks sample with replacement, so Σ / b is
    exactly the covariance of a rank's gradient. Here gᵀΣg / |g|² is ~30x smaller than the variance
    in a typical noise direction, the case that defeats a single noisy direction."""
    z = _digits_per_sample_gradients(train_steps=100)
    n = len(z)
    g = z.mean(0)
    zc = z - g
    mu, trace = float(g @ g), float((zc * zc).sum() / n)
    sigma2 = float(np.sum((zc @ g) ** 2) / n)

    def bilinear(u, v):
        return float((zc @ u) @ (zc @ v) / n)

    rng = np.random.default_rng(1)
    ranks, batch, steps = 4, 16, 2000
    est, _ = simulate(lambda k: z[rng.integers(0, n, k)], None, ranks, batch, steps, rng)
    for name, values, truth in [("mu", np.array([e.mu for e in est]), mu),
                                ("trace", np.array([e.trace for e in est]), trace)]:
        m, se = mean_se(values)
        assert abs(m - truth) < 5 * se, (name, m, truth, se)
    rho, rho_se = ratio_and_block_se(est[2:])
    assert abs(rho - sigma2 / mu) < 5 * rho_se, (rho, sigma2 / mu, rho_se)  # 5: see the linear case
    assert rho_se < 0.25 * sigma2 / mu
    # The alternative this design rejects: the previous averaged gradient as the only direction,
    # sigma² ~ mu * ûᵀΣû. Even with û's exact directional variance it overshoots several-fold.
    naive = []
    for _ in range(50):
        u = z[rng.integers(0, n, ranks * batch)].mean(0)
        naive.append(bilinear(u, u) / float(u @ u))
    assert mu * float(np.mean(naive)) > 5 * sigma2


def test_estimator_smooths_to_sigma():
    lr = make(d=20, scale=3.0, s=0.5, seed=4)
    rng = np.random.default_rng(3)
    est, _ = simulate(lambda n: lr.per_sample(rng, n), lr.bilinear, 4, 32, 3000, rng)
    ne = NoiseEstimator(decay=0.999)
    for e in est[:2]:
        got = ne.add(e)
        assert got is not None and got.sigma is None  # no directions in the first two steps
    for e in est[2:]:
        ne.add(e)
    got = ne.estimate
    assert got is not None and got.sigma2 is not None and got.rho_stderr is not None
    rel_se = math.hypot(got.mu_stderr / got.mu, got.rho_stderr / got.rho)
    assert rel_se < 0.05
    # 5 standard errors, doubled for the directions' autocorrelation the reported error ignores.
    assert abs(got.sigma2 / lr.sigma2 - 1.0) < 10 * rel_se
    assert got.mu == pytest.approx(lr.mu, rel=5 * got.mu_stderr / got.mu)


def test_estimator_counts_and_stderr():
    est = NoiseEstimator(decay=0.95)
    assert est.estimate is None
    rng = np.random.default_rng(5)
    values = rng.normal(2.0, 0.5, size=400)
    for v in values:
        est.add(StepEstimate(mu=float(v), trace=3.0, cross=2.0, dot=4.0, parts=4, batch=32))
    e = est.estimate
    assert e is not None
    n_eff = (1 + 0.95) / (1 - 0.95)  # the stationary Kish size (sum w)² / sum w²
    assert e.steps == pytest.approx(n_eff, rel=1e-6)
    assert e.samples == pytest.approx(n_eff * 4 * 32, rel=1e-6)
    assert e.mu_stderr == pytest.approx(0.5 / math.sqrt(n_eff), rel=0.3)
    assert e.rho == pytest.approx(0.5) and e.rho_stderr == pytest.approx(0.0, abs=1e-6)
    assert e.trace == pytest.approx(3.0)
    assert e.sigma == pytest.approx(math.sqrt(e.mu * 0.5))
    assert e.noise_scale == pytest.approx(3.0 / e.mu)


def test_bias_correction_first_step_is_the_value():
    est = NoiseEstimator(decay=0.99)
    e = est.add(StepEstimate(mu=5.0, trace=1.0, cross=6.0, dot=3.0, parts=2, batch=8))
    assert e is not None
    assert e.mu == 5.0 and e.rho == 2.0 and e.steps == 1.0 and math.isinf(e.mu_stderr)


def test_clamping_and_unknown_sigma():
    est = NoiseEstimator()
    e = est.add(StepEstimate(mu=-1.0, trace=10.0, cross=None, dot=None, parts=2, batch=8))
    assert e is not None and e.mu == 0.0 and e.sigma is None and e.rho is None
    # Directions that disagree on average (dot <= 0): no rho yet.
    e = est.add(StepEstimate(mu=1.0, trace=10.0, cross=1.0, dot=-0.5, parts=2, batch=8))
    assert e is not None and e.rho is None and e.sigma is None
    # A negative cross term (noise) gives rho 0, never a negative variance.
    est2 = NoiseEstimator()
    e = est2.add(StepEstimate(mu=1.0, trace=10.0, cross=-1.0, dot=0.5, parts=2, batch=8))
    assert e is not None and e.rho == 0.0 and e.sigma == 0.0


def test_one_rank_is_unknown():
    assert step_estimate([LocalStats(4.0, 1.0, 1.0, 32)], 4.0, 1.0) is None
    est = NoiseEstimator()
    assert est.update([LocalStats(4.0, 1.0, 1.0, 32)], 4.0, 1.0) is None
    assert est.unknown_steps == 1
    e = est.update([LocalStats(4.0, 1.0, 1.0, 16), LocalStats(2.0, 0.0, 0.0, 16)], 2.5, 1.0)
    assert e is not None and e.unknown_steps == 1


def test_two_ranks_closed_form():
    # g_1 = (2, 0), g_2 = (0, 0), b = 10: A = 2, G = 1, tr Σ = b R (A - G)/(R-1) = 20,
    # mu = (R G - A)/(R - 1) = 0. u_a = (1, 0), u_b = (1, 1): p = (2, 0), q = (2, 0), so
    # cross = b * (1*1 + (-1)(-1)) / 1 = 20, dot = 1.
    e = step_estimate([LocalStats(4.0, 2.0, 2.0, 10), LocalStats(0.0, 0.0, 0.0, 10)], 1.0, 1.0)
    assert e == StepEstimate(mu=0.0, trace=20.0, cross=20.0, dot=1.0, parts=2, batch=10)
    # Without the directions' dot product there is no cross term.
    e = step_estimate([LocalStats(4.0, 2.0, 2.0, 10), LocalStats(0.0, 0.0, 0.0, 10)], 1.0)
    assert e is not None and e.cross is None and e.dot is None


def test_local_stats_and_direction_pair_match_numpy():
    rng = np.random.default_rng(3)
    sizes = (7, 1, 130)
    steps = [[rng.standard_normal(n) for n in sizes] for _ in range(5)]
    pair = DirectionPair(decay=0.8)
    assert pair.get() is None and pair.dot() is None
    ref: list[np.ndarray | None] = [None, None]
    for t, pieces in enumerate(steps):
        pair.observe([torch.tensor(p, dtype=torch.float32) for p in pieces])
        flat = np.concatenate(pieces)
        ref[t % 2] = flat if ref[t % 2] is None else 0.8 * ref[t % 2] + 0.2 * flat
    got = pair.get()
    assert got is not None
    ua, ub = (torch.cat(d).double().numpy() for d in got)
    assert np.allclose(ua, ref[0], rtol=1e-5, atol=1e-6) and np.allclose(ub, ref[1], rtol=1e-5, atol=1e-6)
    assert pair.dot() == pytest.approx(float(ref[0] @ ref[1]), rel=1e-5)

    pieces = [rng.standard_normal(n) for n in sizes]
    g = np.concatenate(pieces)
    grads = [torch.tensor(p, dtype=torch.float32) for p in pieces]
    st = local_stats(grads, got, batch=32)
    assert st.sq_norm == pytest.approx(float(g @ g), rel=1e-5)
    assert st.proj_a == pytest.approx(float(g @ ref[0]), rel=1e-4)
    assert st.proj_b == pytest.approx(float(g @ ref[1]), rel=1e-4)
    assert st.batch == 32
    none = local_stats(grads, None, 32)
    assert none.proj_a is None and none.proj_b is None
    bad = ([torch.zeros(7), torch.zeros(2), torch.zeros(130)], got[1])
    with pytest.raises(ContractError, match=r"directions\[0\]\[1\]"):
        local_stats(grads, bad, 32)
    with pytest.raises(ContractError, match=r"directions\[1\]"):
        local_stats(grads, (got[0], [torch.zeros(7)]), 32)
    with pytest.raises(ContractError, match="averaged"):
        pair.observe([torch.zeros(7)])


@pytest.mark.parametrize("parts,g2,field", [
    ([], 1.0, "parts"),
    ([LocalStats(-1.0, 0.0, 0.0, 8), LocalStats(1.0, 0.0, 0.0, 8)], 1.0, "parts[0].sq_norm"),
    ([LocalStats(1.0, 0.0, 0.0, 8), LocalStats(1.0, 0.0, 0.0, 4)], 1.0, "parts[1].batch"),
    ([LocalStats(1.0, 0.0, 0.0, 0), LocalStats(1.0, 0.0, 0.0, 0)], 1.0, "parts[0].batch"),
    ([LocalStats(1.0, float("nan"), 0.0, 8), LocalStats(1.0, 0.0, 0.0, 8)], 1.0, "parts[0].proj_a"),
    ([LocalStats(1.0, 0.0, 0.0, 8), LocalStats(1.0, 0.0, 0.0, 8)], -1.0, "mean_sq_norm"),
])
def test_bad_input(parts, g2, field):
    with pytest.raises(ContractError) as e:
        step_estimate(parts, g2, 1.0)
    assert e.value.field == field


def test_bad_decay():
    with pytest.raises(ContractError, match="decay"):
        NoiseEstimator(decay=1.0)
    with pytest.raises(ContractError, match="decay"):
        DirectionPair(decay=-0.1)


def gather_worker(rank: int, world: int) -> list[list[list[float | int | None]]]:
    """Two all-gathers of this rank's statistics (rank 2 has no directions in the first); each result as
    ``[sq_norm, proj_a, proj_b, batch]`` per rank."""
    mine = LocalStats(float(rank + 1), None if rank == 2 else 0.5 * rank, 1.0, batch=8)
    out = []
    for stats in (mine, LocalStats(1.0, float(rank), -float(rank), 8)):
        out.append([[x.sq_norm, x.proj_a, x.proj_b, x.batch] for x in all_gather_stats(stats)])
    return out


@pytest.mark.slow
def test_all_gather_stats_three_ranks() -> None:
    results = rank_values(run_ranks(gather_worker, 3, timeout=120))
    for first, second in results:
        # rank 2 had no directions: nobody gets projections
        assert [x[0] for x in first] == [1.0, 2.0, 3.0] and all(x[1] is None and x[2] is None for x in first)
        assert [x[1] for x in second] == [0.0, 1.0, 2.0] and [x[2] for x in second] == [0.0, -1.0, -2.0]
        assert all(x[3] == 8 for x in second)


def test_training_loop_recipe_with_autograd():
    """The module docstring's recipe, with gradients from loss.backward() on 4 simulated ranks of a
    torch linear model held at fixed weights, against the closed-form mu and sigma²."""
    lr = make(d=10, scale=3.0, s=0.5, seed=21)
    w_star = torch.zeros(10, dtype=torch.float64)
    w = torch.tensor(lr.delta, dtype=torch.float64, requires_grad=True)  # w - w* = δ
    gen = torch.Generator().manual_seed(5)
    sqrt_h = torch.tensor(np.sqrt(lr.h))
    ranks, batch, steps = 4, 32, 800
    pair, est = DirectionPair(decay=0.9), NoiseEstimator(decay=1.0 - 1.0 / steps)
    for _ in range(steps):
        locals_, grads = [], []
        for _r in range(ranks):
            x = torch.randn(batch, 10, generator=gen, dtype=torch.float64) * sqrt_h
            y = x @ w_star + lr.s * torch.randn(batch, generator=gen, dtype=torch.float64)
            w.grad = None
            (0.5 * (x @ w - y) ** 2).mean().backward()
            g = w.grad.detach().clone()
            locals_.append(local_stats([g[:4], g[4:]], pair.get(), batch))  # two "buckets"
            grads.append(g)
        avg = torch.stack(grads).mean(0)
        pieces = [avg[:4], avg[4:]]
        est.update(locals_, float(sum(torch.dot(p, p) for p in pieces)), pair.dot())
        pair.observe(pieces)
    got = est.estimate
    assert got is not None and got.sigma2 is not None and got.rho_stderr is not None
    assert got.samples == pytest.approx(got.steps * ranks * batch)
    assert abs(got.mu - lr.mu) < 5 * got.mu_stderr
    rel_se = math.hypot(got.mu_stderr / got.mu, got.rho_stderr / got.rho)
    # 5 standard errors, doubled for the directions' autocorrelation the reported error ignores.
    assert abs(got.sigma2 / lr.sigma2 - 1.0) < 10 * rel_se
    assert rel_se < 0.05
