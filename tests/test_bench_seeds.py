"""benchmarks/bench_seeds.py's report: per-run reduction, means, paired tests, wins; no training.

The synthetic runs are written to tmp_path in train_cnn.py's ``--json`` layout. Every expected number
is derived here by hand or by a second method: means and standard deviations as literal sums, the
t statistic by its formula, its p-value from the closed-form CDF of Student's t with 4 degrees of
freedom, the Wilcoxon p-value by enumerating all sign assignments of the ranks.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_seeds  # noqa: E402

FIRST, SECOND = "powersgd", "deft-powersgd"
# Final accuracies per seed 0..4; the differences SECOND - FIRST are 0.01, 0.02, 0.03, 0.05, 0.04.
FIRST_FINAL = [0.80, 0.82, 0.84, 0.86, 0.88]
SECOND_FINAL = [0.81, 0.84, 0.87, 0.91, 0.92]


def write_run(run_dir: Path, scheme: str, seed: int, final: float, loss: float | None = None,
              losses: list[float] | None = None) -> Path:
    """A run whose evaluations are 0.5, final - 0.02, final + 0.01, final: so best = final + 0.01 and
    the mean of the last three = final - 0.01 / 3; its final test loss is 1 - final unless given."""
    accs = [0.5, final - 0.02, final + 0.01, final]
    doc = {"summary": {"seed": seed, "params": 1234, "schedule": {}},
           "evals": [{"iter": 10 * (i + 1), "test_acc": a, "test_loss": 2.0 - i * 0.1} for i, a in enumerate(accs)],
           "iters": [{"iter": i + 1, "loss": v} for i, v in enumerate(losses or [2.0, 1.5, 1.0])]}
    doc["evals"][-1]["test_loss"] = 1.0 - final if loss is None else loss
    path = run_dir / f"{scheme}_{seed}.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


@pytest.fixture
def runs(tmp_path: Path) -> dict[str, list[bench_seeds.SeedRun]]:
    for seed, (a, b) in enumerate(zip(FIRST_FINAL, SECOND_FINAL, strict=True)):
        write_run(tmp_path, FIRST, seed, a, losses=[2.0, 1.5, 1.0, 0.9])
        write_run(tmp_path, SECOND, seed, b, losses=[2.0, 1.5, 1.1, 0.8])
    return bench_seeds.load_runs(tmp_path, [FIRST, SECOND], list(range(5)))


def t_cdf_4(t: float) -> float:
    """Student's t CDF, 4 degrees of freedom: 1/2 + (3/8) x/sqrt(1 + x^2/4) (1 - x^2 / (12 (1 + x^2/4)))."""
    u = 1 + t * t / 4
    return 0.5 + 3 / 8 * t / math.sqrt(u) * (1 - t * t / (12 * u))


def wilcoxon_exact(d: list[float]) -> float:
    """Two-sided signed-rank p-value by enumerating every sign pattern (distinct nonzero |d| only)."""
    ranks = {v: r + 1 for r, v in enumerate(sorted(abs(x) for x in d))}
    w_plus = sum(ranks[abs(x)] for x in d if x > 0)
    total = len(d) * (len(d) + 1) / 2
    observed = min(w_plus, total - w_plus)
    extreme = 0
    for signs in itertools.product((0, 1), repeat=len(d)):
        w = sum(r for r, s in zip(range(1, len(d) + 1), signs, strict=True) if s)
        extreme += min(w, total - w) <= observed
    return extreme / 2 ** len(d)


def test_one_run_reduces_to_final_best_last_three_and_loss(runs: dict[str, list[bench_seeds.SeedRun]]) -> None:
    r = runs[FIRST][0]  # evaluations 0.5, 0.78, 0.81, 0.80
    assert (r.scheme, r.seed, r.iters) == (FIRST, 0, 40)
    assert r.final_acc == pytest.approx(0.80)
    assert r.best_acc == pytest.approx(0.81)
    assert r.last3_acc == pytest.approx((0.78 + 0.81 + 0.80) / 3)
    assert r.final_loss == pytest.approx(0.20)
    assert r.losses == (2.0, 1.5, 1.0, 0.9)
    assert r.plan is None  # an empty schedule: not a deft plan


def test_per_scheme_mean_and_sample_sd(runs: dict[str, list[bench_seeds.SeedRun]]) -> None:
    final = bench_seeds.spread([r.final_acc for r in runs[FIRST]])
    assert final.mean == pytest.approx((0.80 + 0.82 + 0.84 + 0.86 + 0.88) / 5)  # 0.84
    assert final.sd == pytest.approx(math.sqrt((0.04**2 + 0.02**2 + 0 + 0.02**2 + 0.04**2) / 4))
    second = bench_seeds.spread([r.final_acc for r in runs[SECOND]])
    assert second.mean == pytest.approx(0.87)
    assert second.sd == pytest.approx(math.sqrt((0.06**2 + 0.03**2 + 0 + 0.04**2 + 0.05**2) / 4))
    best = bench_seeds.spread([r.best_acc for r in runs[SECOND]])
    last3 = bench_seeds.spread([r.last3_acc for r in runs[SECOND]])
    loss = bench_seeds.spread([r.final_loss for r in runs[SECOND]])
    assert (best.mean, best.sd) == (pytest.approx(0.88), pytest.approx(second.sd))
    assert last3.mean == pytest.approx(0.87 - 0.01 / 3)
    assert loss.mean == pytest.approx(0.13)


def test_paired_t_test_and_wilcoxon_against_hand_values(runs: dict[str, list[bench_seeds.SeedRun]]) -> None:
    d = [0.01, 0.02, 0.03, 0.05, 0.04]
    mean = sum(d) / 5  # 0.03
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 4)  # sqrt(0.001 / 4)
    t = mean / (sd / math.sqrt(5))  # = 3 sqrt(2)
    assert t == pytest.approx(3 * math.sqrt(2))
    p_t = 2 * (1 - t_cdf_4(t))
    p_w = wilcoxon_exact(d)
    assert p_w == pytest.approx(2 / 32)  # every difference positive: only the all-plus and all-minus patterns
    pr = bench_seeds.paired(runs[FIRST], runs[SECOND], "final_acc")
    assert (pr.metric, pr.n) == ("final_acc", 5)
    assert pr.mean_diff == pytest.approx(mean)
    assert pr.sd_diff == pytest.approx(sd)
    assert pr.t == pytest.approx(t, rel=1e-9)
    assert pr.p_t == pytest.approx(p_t, rel=1e-9)
    assert pr.p_wilcoxon == pytest.approx(p_w)
    half = 2.7764 * sd / math.sqrt(5)  # t_{0.975, 4} = 2.7764 (printed t tables)
    assert pr.ci == (pytest.approx(mean - half, abs=1e-6), pytest.approx(mean + half, abs=1e-6))
    # the loss falls by as much as the accuracy rises (loss = 1 - final): the same test, sign flipped
    lo = bench_seeds.paired(runs[FIRST], runs[SECOND], "final_loss")
    assert (lo.mean_diff, lo.t, lo.p_t) == (pytest.approx(-mean), pytest.approx(-t), pytest.approx(p_t))

    text = bench_seeds.render(runs, command="cmd --seeds 0-4")
    row = next(ln for ln in text.splitlines() if ln.startswith("| final test accuracy |"))
    ci = f"{mean - half:+.4f} .. {mean + half:+.4f}"
    assert row == f"| final test accuracy | +0.0300 | {ci} | {sd:.4f} | {t:.3f} | {p_t:.3f} | {p_w:.3f} |"
    assert "| `powersgd`: torch DDP + PowerSGD (rank 4) | 0.8400 ± 0.0316 |" in text
    assert "| 3 | 0.8600 | 0.8700 |" in text  # seed 3: FIRST's final, best
    assert f"Wins on final accuracy: `{SECOND}` on 5 seed(s) (0, 1, 2, 3, 4), `{FIRST}` on 0 (none)" in text
    assert "First iteration whose training loss (rank 0) differs: 3 on every seed." in text
    assert "```\ncmd --seeds 0-4\n```" in text


def test_wilcoxon_by_enumeration_with_mixed_signs(tmp_path: Path) -> None:
    # differences +0.05, -0.01, +0.03, +0.04, -0.02, +0.06: ranks 5, 1, 3, 4, 2, 6 -> W- = 3
    diffs = [0.05, -0.01, 0.03, 0.04, -0.02, 0.06]
    for seed, dv in enumerate(diffs):
        write_run(tmp_path, FIRST, seed, 0.80)
        write_run(tmp_path, SECOND, seed, 0.80 + dv)
    runs = bench_seeds.load_runs(tmp_path, [FIRST, SECOND], list(range(6)))
    pr = bench_seeds.paired(runs[FIRST], runs[SECOND], "final_acc")
    # sign patterns of ranks 1..6 whose smaller rank sum is <= 3: {}, {1}, {2}, {3}, {1,2}, twice (either side)
    assert pr.p_wilcoxon == pytest.approx(10 / 64)
    assert wilcoxon_exact(diffs) == pytest.approx(10 / 64)


def test_wins_count_ties_and_losses(tmp_path: Path) -> None:
    for seed, (a, b) in enumerate([(0.90, 0.95), (0.9833333333333333, 0.9833333333333333), (0.95, 0.90)]):
        write_run(tmp_path, FIRST, seed, a)
        write_run(tmp_path, SECOND, seed, b)
    runs = bench_seeds.load_runs(tmp_path, [FIRST, SECOND], [0, 1, 2])
    w = bench_seeds.wins(runs[FIRST], runs[SECOND])
    assert (w.second, w.first, w.tied) == ((0,), (2,), (1,))


def test_all_equal_runs_have_no_test(tmp_path: Path) -> None:
    for seed in (0, 1):
        write_run(tmp_path, FIRST, seed, 0.9)
        write_run(tmp_path, SECOND, seed, 0.9)
    runs = bench_seeds.load_runs(tmp_path, [FIRST, SECOND], [0, 1])
    pr = bench_seeds.paired(runs[FIRST], runs[SECOND], "final_acc")
    assert (pr.mean_diff, pr.t, pr.p_t, pr.ci, pr.p_wilcoxon) == (0.0, None, None, None, None)
    assert "| final test accuracy | +0.0000 | - | 0.0000 | - | - | - |" in bench_seeds.render(runs, command="c")


def test_one_scheme_has_no_paired_section(tmp_path: Path) -> None:
    write_run(tmp_path, "torch", 0, 0.9)
    text = bench_seeds.render(bench_seeds.load_runs(tmp_path, ["torch"], [0]), command="c")
    assert "## Per scheme" in text and "## Paired" not in text
    assert "| `torch`: torch DDP | 0.9000 ± 0.0000 |" in text


def test_deft_plan_is_listed(tmp_path: Path) -> None:
    path = write_run(tmp_path, SECOND, 0, 0.9)
    doc = json.loads(path.read_text(encoding="utf-8"))
    doc["summary"]["schedule"] = {"K": [1], "schedule": {"bucket_numel": [10, 20]}}
    path.write_text(json.dumps(doc), encoding="utf-8")
    runs = bench_seeds.load_runs(tmp_path, [SECOND], [0])
    assert runs[SECOND][0].plan == "K = [1], buckets [10, 20]"
    assert f"`{SECOND}` planned: K = [1], buckets [10, 20] (1 of 1 seeds)." in bench_seeds.render(runs, "c")


def test_write_fragment_keeps_the_hand_written_reading(tmp_path: Path) -> None:
    out = tmp_path / "seeds.md"
    out.write_text("# old report\n\nold table\n\n## What it says (written by hand)\n\nthe reading\n", encoding="utf-8")
    bench_seeds.write_fragment("# new report\n", out)
    assert out.read_text(encoding="utf-8") == "# new report\n\n## What it says (written by hand)\n\nthe reading\n"
    fresh = tmp_path / "fresh.md"
    bench_seeds.write_fragment("# new report\n", fresh)
    assert fresh.read_text(encoding="utf-8") == "# new report\n"


def test_parse_seeds() -> None:
    assert bench_seeds.parse_seeds("0-7") == list(range(8))
    assert bench_seeds.parse_seeds("0-2,5,1") == [0, 1, 2, 5]
    with pytest.raises(ValueError, match="runs backwards"):
        bench_seeds.parse_seeds("3-1")
    with pytest.raises(ValueError, match="'x'"):
        bench_seeds.parse_seeds("0,x")
    with pytest.raises(ValueError, match="unknown scheme 'ddp'"):
        bench_seeds.parse_schemes("torch,ddp")


def test_bad_run_files_name_the_file_and_the_field(tmp_path: Path) -> None:
    with pytest.raises(bench_seeds.SeedRunError, match=r"missing run files powersgd_0\.json, powersgd_1\.json"):
        bench_seeds.load_runs(tmp_path, [FIRST], [0, 1])
    path = write_run(tmp_path, FIRST, 0, 0.9)
    doc = json.loads(path.read_text(encoding="utf-8"))
    del doc["evals"][2]["test_acc"]
    path.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(bench_seeds.SeedRunError, match=r"powersgd_0\.json: 'evals\[2\]' has no 'test_acc'"):
        bench_seeds.load_run(path, FIRST, 0)
    doc["evals"] = doc["evals"][:2]
    path.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(bench_seeds.SeedRunError, match=r"'evals': expected a list of at least 3 .* got 2"):
        bench_seeds.load_run(path, FIRST, 0)
    write_run(tmp_path, FIRST, 3, 0.9)
    with pytest.raises(bench_seeds.SeedRunError,
                       match=r"powersgd_3\.json: 'summary\.seed' is 3 but the file name says seed 4"):
        bench_seeds.load_run(tmp_path / "powersgd_3.json", FIRST, 4)
    (tmp_path / "powersgd_5.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(bench_seeds.SeedRunError, match=r"powersgd_5\.json: not JSON"):
        bench_seeds.load_run(tmp_path / "powersgd_5.json", FIRST, 5)
