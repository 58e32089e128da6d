"""bench_peers' hosts and ranks per host: the flags refused with a message naming them, where each rank
runs and with which environment, and the world size in the report's headings (no testbed needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deft.testbed import Testbed
from tests._scripts import load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def peers(monkeypatch: pytest.MonkeyPatch) -> Any:
    return load_script(REPO / "benchmarks" / "bench_peers.py", monkeypatch)


@pytest.mark.parametrize(("argv", "message"), [
    (["--hosts", "1"], "--hosts: expected an integer >= 2"),
    (["--hosts", "0"], "--hosts: expected an integer >= 2"),
    (["--ranks-per-host", "0"], "--ranks-per-host: expected an integer in [1, 8]"),
    (["--ranks-per-host", "9"], "--ranks-per-host: expected an integer in [1, 8]"),
    (["--hosts", "8", "--ranks-per-host", "4"], "--hosts 8 x --ranks-per-host 4 = 32 ranks: at most 16"),
    (["--hosts", "two"], "--hosts: invalid int value"),
    (["--launcher", "mpirun"], "--launcher: invalid choice"),
])
def test_bad_layouts_are_refused_naming_the_flag(peers: Any, capsys: pytest.CaptureFixture[str], argv: list[str],
                                                  message: str) -> None:
    with pytest.raises(SystemExit) as e:
        peers.parse_args(["--rates", "50", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("item", "message"), [
    ("plan_lag_iters", "expected KEY=VALUE"),
    ("no_such_field=1", "'no_such_field' is not a scalar setting of deft's config"),
    ("links=1", "'links' is not a scalar setting"),
    ("plan_lag_iters=-3", "plan_lag_iters: expected an integer >= 0, got -3"),
])
def test_bad_deft_settings_are_refused_naming_the_item(peers: Any, capsys: pytest.CaptureFixture[str], item: str,
                                                       message: str) -> None:
    with pytest.raises(SystemExit) as e:
        peers.parse_args(["--rates", "50", "--deft-config", item])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_deft_settings_reach_every_runs_config(peers: Any, tmp_path: Path) -> None:
    args, _, _ = peers.parse_args(["--rates", "50", "--deft-config", "plan_lag_iters=0",
                                   "--deft-config", "solver=greedy", "--deft-config", "contention=true"])
    assert args.deft_config == {"plan_lag_iters": 0, "solver": "greedy", "contention": True}
    from deft.config import DeftConfig

    path = peers.run_config(Testbed(hosts=2, links=2, tag="argtest"), peers.SCHEMES["deft"], tmp_path / "deft.toml",
                            args)
    config = DeftConfig.load(path)
    assert (config.plan_lag_iters, config.solver, config.contention) == (0, "greedy", True)
    assert [lk.ifname for lk in config.links] == ["nic0", "nic1"]  # and the scheme's two links
    assert config.link_failover  # the default; the unguarded scheme turns it off, over --deft-config
    path = peers.run_config(Testbed(hosts=2, links=2, tag="argtest"), peers.SCHEMES["deft-unguarded"],
                            tmp_path / "unguarded.toml", args)
    config = DeftConfig.load(path)
    assert (config.link_failover, config.plan_lag_iters, len(config.links)) == (False, 0, 2)


def test_default_and_chosen_layouts(peers: Any) -> None:
    args, names, rates = peers.parse_args(["--rates", "50", "--schemes", "torch,deft"])
    assert (args.hosts, args.ranks_per_host, args.launcher) == (2, 1, "env")
    assert names == ["torch", "deft"] and rates == [50.0]
    args, _, _ = peers.parse_args(["--hosts", "2", "--ranks-per-host", "2", "--launcher", "torchrun"])
    assert (args.hosts, args.ranks_per_host, args.launcher) == (2, 2, "torchrun")
    args, _, _ = peers.parse_args(["--hosts", "8"])
    assert peers.Layout(args.hosts, args.ranks_per_host).words() == "8 ranks (8 hosts x 1 rank per host)"


def test_the_lm_model_reaches_each_runs_command(peers: Any) -> None:
    gpt2, _, _ = peers.parse_args(["--workload", "lm", "--rates", "50"])
    llama, _, _ = peers.parse_args(["--workload", "lm", "--rates", "50", "--lm-arch", "llama"])
    assert "--arch" not in peers.WORKLOADS["lm"].argv(gpt2, 0)  # GPT-2: the command an older tree also takes
    argv = peers.WORKLOADS["lm"].argv(llama, 0)
    assert argv[argv.index("--arch") + 1] == "llama"


def test_ranks_sit_host_by_host_with_torchruns_environment(peers: Any, tmp_path: Path) -> None:
    tb, config = Testbed(hosts=2, links=2, tag="argtest"), tmp_path / "deft.toml"
    argv = ["python", "train.py", "--json", "out.host{host}.json"]
    procs = peers.processes(tb, 2, argv, {"EXTRA": "1"}, config, alone=False)
    assert [(p.host, p.rank, p.env["RANK"], p.env["LOCAL_RANK"], p.env["GROUP_RANK"]) for p in procs] == [
        (0, 0, "0", "0", "0"), (0, 1, "1", "1", "0"), (1, 2, "2", "0", "1"), (1, 3, "3", "1", "1")]
    for p in procs:
        assert (p.env["WORLD_SIZE"], p.env["LOCAL_WORLD_SIZE"], p.env["EXTRA"]) == ("4", "2", "1")
        assert p.env["MASTER_ADDR"] == tb.addr(0, 0) and p.env["DEFT_CONFIG"] == str(config)
    # the floor: every rank a job of its own, and its own output file
    alone = peers.processes(tb, 2, argv, {}, config, alone=True)
    assert [p.argv[-1] for p in alone] == [f"out.host{r}.json" for r in range(4)]
    assert {(p.env["RANK"], p.env["WORLD_SIZE"]) for p in alone} == {("0", "1")}
    # torchrun: one process per host, the script and its arguments after torchrun's own
    runs = peers.processes(tb, 2, argv, {}, config, alone=False, launcher="torchrun")
    assert [p.host for p in runs] == [0, 1]
    for h, p in enumerate(runs):
        assert p.argv[p.argv.index("--node-rank") + 1] == str(h) and p.argv[p.argv.index("--nnodes") + 1] == "2"
        assert p.argv[p.argv.index("--nproc-per-node") + 1] == "2" and p.argv[-3:] == argv[1:]
        assert "RANK" not in p.env and p.env["GLOO_SOCKET_IFNAME"] == "nic0"


def test_every_table_names_the_world_size(peers: Any) -> None:
    rows = [peers.Row(name=n, runs=1, iter_s=s, iter_spread=(s, s), to_target={0.93: (None, 0, None)},
                      final_acc=0.9, final_mean=0.9, final_by_seed={0: 0.9}, best_acc=0.9, updates_per_iter=1.0,
                      time_s=10.0, plan="", load=None) for n, s in (("torch", 2.0), ("deft", 1.0))]
    heading = peers.table(50.0, rows, peers.WORKLOADS["cnn"], (0.93,), peers.Layout(2, 2))[0]
    assert heading == "### 50 Mbit/s, 4 ranks (2 hosts x 2 ranks per host)"
    # records from before --hosts: two hosts of one rank, the older plots' names
    assert peers.Layout.of({"name": "torch"}) == peers.Layout(2, 1) and peers.Layout(2, 1).suffix() == ""
    assert peers.Layout.of({"hosts": 4, "ranks_per_host": 1}).suffix() == "_4x1"


def _row(peers: Any, name: str, iter_s: float, to_93: float | None, final: float = 0.95) -> Any:
    return peers.Row(name=name, runs=1, iter_s=iter_s, iter_spread=(iter_s, iter_s),
                     to_target={0.93: (to_93, 1 if to_93 is not None else 0, None)}, final_acc=final,
                     final_mean=final, final_by_seed={0: final}, best_acc=0.97, updates_per_iter=1.0, time_s=10.0,
                     plan="", load=None)


def test_the_layout_table_says_where_deft_falls_short_of_two_hosts(peers: Any) -> None:
    wl = peers.WORKLOADS["cnn"]

    def one(pred: float, measured: float) -> tuple[Any, ...]:
        return (peers.PlanPrice(pred, measured, "window"),)

    two = peers.LayoutRows(peers.Layout(2, 1), _row(peers, "torch", 2.0, 40.0), _row(peers, "deft", 1.0, 20.0),
                           (0.93,), one(1.05, 1.0))  # 2.00x per iteration and to 93 %; predicted +5 %
    four = peers.LayoutRows(peers.Layout(4, 1), _row(peers, "torch", 3.0, 60.0), _row(peers, "deft", 2.0, 50.0),
                            (0.93,), one(1.5, 2.0))  # 1.50x, 1.20x; predicted -25 %
    eight = peers.LayoutRows(peers.Layout(8, 1), _row(peers, "torch", 6.0, 80.0),
                             _row(peers, "deft", 2.0, None, final=0.92),
                             (0.93,), one(2.1, 2.0))  # 3.00x per iteration, never reaches 93 %; predicted +5 %
    text = "\n".join(peers.scale_table(50.0, [two, four, eight], wl))
    assert "| 4 ranks (4 hosts x 1 rank per host) | 3000 | 2000 | 1.50x | 1500 / 2000 | -25.0% |" in text
    assert ("- 4 ranks (4 hosts x 1 rank per host): plan 1's prediction is -25.0% off its adaptation window "
            "(1500 against 2000 ms)") in text
    assert "- 4 ranks (4 hosts x 1 rank per host): deft's iteration ratio 1.50x is under its 2.00x" in text
    assert "- 4 ranks (4 hosts x 1 rank per host): to 93% deft's ratio 1.20x is under its 2.00x" in text
    assert "- 8 ranks (8 hosts x 1 rank per host): deft is not first to 93% (never against torch DDP's 80.0 s)" in text
    assert "8 ranks (8 hosts x 1 rank per host): deft's iteration ratio" not in text  # 3.00x holds
    assert ("- 8 ranks (8 hosts x 1 rank per host): deft's final test accuracy 0.920 is worse than torch DDP's 0.950 "
            "(best 0.970 against 0.970)") in text
    assert "4 ranks (4 hosts x 1 rank per host): deft's final" not in text  # level with torch DDP's
    assert "2 ranks (2 hosts x 1 rank per host): " not in text.split("Where deft falls short")[1]


def test_the_layout_table_says_where_deft_ends_on_a_worse_loss(peers: Any) -> None:
    wl = peers.WORKLOADS["lm"]  # lower is better
    price = (peers.PlanPrice(1.0, 1.0, "window"),)
    worse = peers.LayoutRows(peers.Layout(2, 1), _row(peers, "torch", 2.0, 40.0, final=3.10),
                             _row(peers, "deft", 1.0, 20.0, final=3.20), (0.93,), price)
    better = peers.LayoutRows(peers.Layout(2, 2), _row(peers, "torch", 2.0, 40.0, final=3.10),
                              _row(peers, "deft", 1.0, 20.0, final=3.05), (0.93,), price)
    text = "\n".join(peers.scale_table(250.0, [worse, better], wl))
    assert ("- 2 ranks (2 hosts x 1 rank per host): deft's final validation loss 3.200 is worse than torch DDP's "
            "3.100") in text
    assert "4 ranks (2 hosts x 2 ranks per host): deft's final" not in text
    # level at the table's three decimals is not worse
    level = peers.LayoutRows(peers.Layout(2, 1), _row(peers, "torch", 2.0, 40.0, final=3.1002),
                             _row(peers, "deft", 1.0, 20.0, final=3.1004), (0.93,), price)
    assert "deft's final" not in "\n".join(peers.scale_table(250.0, [level], wl))


def _deft_doc(records: list[dict[str, Any]], steady_s: float, predicted_s: float) -> dict[str, Any]:
    return {"summary": {"iter_s_mean": steady_s, "schedule": {"predicted_iteration_s": predicted_s,
                                                              "plan_info": {"adapt": records}}}}


def test_every_plan_is_priced_against_its_own_measurement(peers: Any) -> None:
    # plan A predicted 3.0, its window 2.4; plan B predicted 1.8, its window 2.4; back to A. The schedule
    # the run ended on carries A's measured 2.4 as its prediction: no new prediction, nothing added.
    back = [{"schedule": "a", "predicted_s": 3.0, "measured_s": 2.4, "new_schedule": "b", "new_predicted_s": 1.8,
             "decision": "try the schedule planned on the corrected profile"},
            {"schedule": "b", "predicted_s": 1.8, "measured_s": 2.4,
             "decision": "slower than a (2400.0 ms): back to it"}]
    got = peers.plan_prices(_deft_doc(back, 2.35, 2.4))
    assert [(p.predicted_s, p.measured_s, p.on) for p in got] == [(3.0, 2.4, "window"), (1.8, 2.4, "window")]
    assert [round(p.error, 3) for p in got] == [0.25, -0.25]
    # a plan installed by the last window is priced against the run's steady iteration
    tried = back[:1]
    got = peers.plan_prices(_deft_doc(tried, 2.0, 1.8))
    assert [(p.predicted_s, p.measured_s, p.on) for p in got] == [(3.0, 2.4, "window"), (1.8, 2.0, "run")]
    # no adaptation: the schedule's prediction against the steady iteration
    got = peers.plan_prices(_deft_doc([], 1.0, 1.1))
    assert [(p.predicted_s, p.measured_s, p.on) for p in got] == [(1.1, 1.0, "run")]


def _run(name: str, losses: list[float]) -> dict[str, Any]:
    return {"summary": {"name": name}, "evals": [{"iter": 10 * (i + 1), "val_loss": v} for i, v in enumerate(losses)]}


def test_the_loss_target_is_torch_ddps_at_80_percent_of_its_run(peers: Any) -> None:
    runs = [_run("deft", [3.0, 2.9, 2.8, 2.7, 2.6]), _run("torch", [3.1, 3.0, 2.95, 2.85, 2.8])]
    assert peers.WORKLOADS["lm"].targets(runs) == (2.85,)


def test_without_torch_ddp_the_loss_target_is_the_median_over_every_run(peers: Any) -> None:
    """Not the first run's own value, which that run reaches exactly and the others by chance."""
    runs = [_run("deft", [3.0, 2.9, 2.8, 2.70, 2.6]), _run("deft-fp16", [3.0, 2.9, 2.8, 2.72, 2.6]),
            _run("deft", [3.0, 2.9, 2.8, 2.76, 2.6])]
    assert peers.WORKLOADS["lm"].targets(runs) == (2.72,)


def test_a_report_from_saved_runs_describes_them_as_they_ran(peers: Any, capsys: pytest.CaptureFixture[str]) -> None:
    made = ("sudo .venv/bin/python benchmarks/bench_peers.py --workload lm --rates 250 --iters 120 --eval-every 12 "
            "--seeds 2,3 --schemes deft,deft-fp16 --save-runs /tmp/runs --no-write")
    args = peers.parse_args(["--workload", "lm", "--rates", "250", "--from-runs", "/tmp/runs"])[0]
    peers.adopt_run_shape(args, [made])
    assert (args.iters, args.eval_every, args.skip_iters) == (120, 12, 12)
    # a flag this command sets stays; commands that disagree, or name a scheme no longer known, say nothing
    args = peers.parse_args(["--workload", "lm", "--iters", "60", "--from-runs", "/tmp/runs"])[0]
    peers.adopt_run_shape(args, [made, made.replace("--eval-every 12", "--eval-every 6"),
                                 made.replace("deft-fp16", "no-such-scheme").replace("--iters 120", "--iters 90")])
    capsys.readouterr()
    assert (args.iters, args.eval_every) == (60, 20)  # the lm workload's own


def test_hosts_are_pinned_where_each_gets_a_core_and_the_report_says_how_they_used_the_cores(peers: Any) -> None:
    # auto: pinned where every host has a core of its own, not where hosts would share one
    assert peers.pin_hosts("auto", 2, 2) is True
    assert peers.pin_hosts("auto", 4, 2) is False
    assert peers.pin_hosts("auto", 8, 16) is True
    assert peers.pin_hosts("on", 8, 2) is True and peers.pin_hosts("off", 2, 16) is False
    with pytest.raises(ValueError, match="expected 'on', 'off' or 'auto', got 'yes'"):
        peers.pin_hosts("yes", 2, 2)
    # the flags win over the machine's cores either way
    assert peers.parse_args(["--hosts", "8", "--pin-hosts"])[0].pin_hosts is True
    assert peers.parse_args(["--hosts", "2", "--no-pin-hosts"])[0].pin_hosts is False
    assert peers.parse_args(["--hosts", "2", "--ranks-per-host", "2", "--no-pin-hosts"])[0].pin_hosts is False

    def run(pinned: bool | None) -> dict[str, Any]:
        return {"summary": {} if pinned is None else {"pinned": pinned}}

    assert "on its own share of the cores" in peers.pinning([run(True), run(True)])
    assert "every host's ranks on every core" in peers.pinning([run(False), run(None)])  # older runs: unpinned
    assert "some runs" in peers.pinning([run(True), run(None)])
