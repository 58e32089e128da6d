"""DeftConfig: every knob of deft, its default, and strict loading from TOML or a dict.

``epsilon`` is the one accuracy/speed knob: the preserver accepts a schedule only when the predicted
loss ratio of the schedule's batch-size sequence against plain data parallelism lies in
``[1 - epsilon, 1 + epsilon]``. ``epsilon == 0`` forbids any delayed update: deft then only reorders
communication and assigns links, and gives the same parameters as torch DDP.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from deft._json import Fields, JsonDict, JsonValue
from deft.errors import ContractError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

#: Environment variable naming a TOML config, used when no config is passed.
CONFIG_ENV = "DEFT_CONFIG"
LINK_BACKENDS = ("auto", "nccl", "gloo")
SOLVERS = ("exact", "greedy")
#: ``"auto"``: the plan sends a bucket in fp16 or bf16 (or int8, where fewer bytes) where the links are the
#: bound and the preserver accepts the rounding (deft.solver.codecs, deft.preserver.codec_error; never at
#: ``epsilon == 0``);
#: ``"none"``: every bucket exact; ``"fp16" | "bf16" | "powersgd"``: torch's comm hook on every bucket;
#: ``"int8"``: deft's 8-bit hook on every bucket (deft.runtime.int8_hook: block-scaled, stochastically rounded).
COMPRESSIONS = ("auto", "none", "fp16", "bf16", "int8", "powersgd")
#: Under ``compression = "auto"``: the profile iterations' codec (deft.runtime.codecs.first_iteration). ``"auto"``:
#: every bucket is sent with the codec the preserver accepts on the first iteration's gradients when
#: that iteration's all-reduces waited longer after the backward than its forward and backward took
#: (the links are the bound; int8 where they stay the bound even in 16 bits); ``"always"``: whenever the
#: preserver accepts it, in 16 bits whatever the timing; ``"never"``: exact.
PROFILE_CODECS = ("auto", "always", "never")
#: How a merged update of ``k`` iterations scales the learning rate of its one optimizer step:
#: ``"none"`` (the same lr: k times fewer steps of the same size), ``"linear"`` (``k * lr``, Goyal et
#: al.'s rule for SGD) or ``"sqrt"`` (``sqrt(k) * lr``, the usual rule for Adam). Off by default.
MERGE_LR_SCALINGS = ("none", "linear", "sqrt")
#: Local-steps mode (``local_steps = H > 0``; deft.runtime.local_steps): what the ranks average every H
#: steps: ``"average"`` the parameters (post-local SGD), ``"diloco"`` the pseudo-gradient, stepped by an
#: outer SGD with Nesterov momentum (DiLoCo).
LOCAL_OUTERS = ("average", "diloco")
#: Local-steps mode's period: ``"fixed"`` averages every ``local_steps`` steps; ``"adacomm"`` takes
#: ``local_steps`` as the largest period and chooses it from measurements, then lowers it as the loss
#: falls (deft.runtime.local_period: AdaComm, Wang and Joshi 2019).
LOCAL_PERIODS = ("fixed", "adacomm")


@dataclass(frozen=True)
class LinkConfig:
    """One communication link. ``backend="auto"``: the first link runs the default process group's
    backend for the model's device (as torch DDP does: NCCL on CUDA under ``init_process_group("nccl")``),
    the others gloo."""

    name: str
    backend: str = "auto"
    ifname: str | None = None


@dataclass(frozen=True)
class DeftConfig:
    """Every knob of deft (see the module docstring for ``epsilon``); validated on construction.

    ``from_dict``/``load`` reject unknown settings and wrongly typed values, naming the file and field.
    """

    epsilon: float = 0.01
    links: tuple[LinkConfig, ...] = (LinkConfig("primary"),)
    bucket_cap_mb: float = 25.0
    # The warm-up's first bucket under a chained comm hook (PowerSGD): torch 2.13's rule, 1 MB when
    # bucket_cap_mb is left at its default, bucket_cap_mb itself when it is given (the constructor's
    # bucket_cap_mb argument sets both, as in torch DDP)
    first_bucket_cap_mb: float = 1.0
    partition_numel: int = 6_500_000
    solver: str = "exact"
    # CP-SAT budget per knapsack solve, as deterministic work (x solver.plan.WORK_PER_SECOND units), not
    # wall seconds: the same profile gives the same plan under any load; one decision (a plan, or the
    # preserver's tries together) spends at most solver.plan.EXACT_BUDGET_LIMITS such budgets before the
    # greedy takes over
    solver_time_limit_s: float = 1.0
    # The knapsack search stops once its packing is certified within this share of the optimum: it packs
    # measured comm seconds, whose spread between profile iterations is several times this; a tenth of
    # it made CP-SAT spend most of the GPT-2's first decision certifying tries the preserver then
    # rejected, for the same plans (benchmarks/results/planner_gap.md)
    solver_relative_gap: float = 2e-2
    # 1 + 3 iterations before planning: the warm-up timer measures the real all-reduces, rotated over the
    # links, so 3 profile iterations see every bucket on every link of two; and every warm-up iteration
    # runs at torch DDP's pace, which time to accuracy pays (measured: benchmarks/results/peers.md).
    warmup_iters: int = 1
    profile_iters: int = 3
    # The last profile iteration (of two or more) holds its backward's sends to its end: the links'
    # contention for the CPU is measured and priced (deft.profile.Link.contention; none on CUDA). Off by
    # default: on the GPT-2 its plans ran slower (benchmarks/results/prices.md)
    contention: bool = False
    # The mirror: the gloo links' drag, their sends slowed by the compute beside them, is fitted from the
    # profile iterations' sends beside and after the backward and priced (deft.profile.Link.drag; none
    # on CUDA). Off by default: it did not move the first plans' error (benchmarks/results/prices_drag.md)
    drag: bool = False
    # What the paced rank's sends wait for the last rank to reach them (the profile iterations' sends
    # measure it) is priced as each link's lag per send (deft.profile.Link.lag_s; measured:
    # benchmarks/results/prices_lag.md)
    rank_wait: bool = True
    # The compute of the iterations run while rank 0 plans in the background, against the profile
    # iterations': sped up beyond adapt_tolerance and the profile iterations' spread, the first plan is priced
    # on the profile's compute scaled by it (deft.runtime.compute_drift; benchmarks/results/prices_drift.md)
    compute_drift: bool = True
    preserver: bool = True
    preserver_max_tries: int = 10
    capacity_growth: float = 1.25
    recheck_every: int = 200
    # Stale (delayed) updates when the stability check cannot run (no curvature, an optimizer it does not
    # model): refused by default, torch DDP's maths being the safe path; true lets the walk alone judge them
    # (deft.preserver.feedback, "Stability").
    stale_unchecked: bool = False
    forward_updates: bool = True   # lag-free plans: updates may finish in the next forward (deft.solver.lagfree)
    compression: str = "auto"      # see COMPRESSIONS
    profile_codec: str = "auto"    # see PROFILE_CODECS
    powersgd_rank: int = 4
    powersgd_start_iter: int = 2   # plain all-reduce before (PowerSGD needs > 1 with error feedback)
    # Rank 0 plans (and, when adapting, re-plans) in a background thread while training goes on; every rank
    # switches at the first iteration boundary where rank 0's thread is done, after at most this many
    # iterations. 0: plan inside the iteration that ends the profile (deft.runtime.planning).
    plan_lag_iters: int = 6
    # The planner thread's nice value (Linux; 0: the training's own priority): it should use the CPU the
    # training leaves idle, which shortens the time to accuracy (measured: benchmarks/results/peers.md).
    planner_nice: int = 10
    # Opt-in: Python's GIL switch interval (ms) while a scheduled run has a gloo link, restored by close():
    # gloo's worker threads run a hook's completion callbacks (torch's PowerSGD, a user's hook) and hold
    # the link until they have the GIL, which a busy training thread keeps up to this long
    # (deft.runtime.switch_interval; benchmarks/results/gloo_callbacks.md). 0: leave Python's own (5 ms); off
    # by default, as its passes on the GPT-2 disagreed (benchmarks/results/switch_interval_lm.md).
    switch_interval_ms: float = 0.0
    adapt: bool = True             # check the running schedule against measured time; re-plan (deft.runtime.adapt)
    adapt_window: int = 6          # iterations measured per decision
    adapt_max_replans: int = 2
    adapt_tolerance: float = 0.10  # relative prediction error that is accepted
    s_star: float = 0.0
    # A merged update of k iterations steps with lr x 1, k or sqrt(k) (MERGE_LR_SCALINGS; the preserver's walk
    # prices the same factor). Off by default (measured: benchmarks/results/preserver_validation.md).
    merge_lr_scaling: str = "none"
    timeout_s: float = 300.0
    # A non-primary link whose collective fails or misses its deadline is lost: the ranks agree, send its
    # buckets again on the primary and re-plan without it (deft.runtime.failover). The deadline is
    # link_deadline_factor x the profiled time of the bytes on that link, at least link_deadline_s (the
    # floor alone before the profile), at most timeout_s. false: every wait has timeout_s, a loss ends the run.
    link_failover: bool = True
    # Opt-in: a gloo link of CPU tensors runs one collective at a time, in launch order (its group has one gloo
    # worker thread, deft.runtime.link_queue); gloo's own two at once end the first late for its deadline
    # (benchmarks/results/link_queue.md, where it measured faster and where slower).
    link_queue: bool = False
    # Several ranks per host: gloo links all-reduce inside each host, then across hosts (deft.runtime.hierarchy).
    # "auto": where torchrun's variables show several ranks on each of several hosts; true: the same, warning
    # when it cannot; false: flat.
    hierarchical: str | bool = "auto"
    link_deadline_s: float = 30.0
    link_deadline_factor: float = 20.0
    # Local-steps mode (deft.runtime.local_steps, docs/DESIGN.md "Local steps"): H > 0 replaces the gradient
    # schedule: every rank steps on its own gradient and every H steps the ranks average (local_outer).
    # 0: off. Needs epsilon > 0 (epsilon 0 promises torch DDP's maths).
    local_steps: int = 0
    local_outer: str = "average"     # see LOCAL_OUTERS
    local_outer_lr: float = 0.7      # "diloco": the outer SGD's learning rate (the paper's 0.7)
    local_outer_momentum: float = 0.9  # "diloco": the outer SGD's Nesterov momentum (the paper's 0.9)
    local_warmup_iters: int = 0      # gradient all-reduce (torch DDP's maths) for this many steps first
    # The averaging overlaps the next local steps (Streaming DiLoCo) and is applied, keeping the local
    # progress since its snapshot, after local_overlap_iters more steps (1 <= D <= H) on every rank;
    # false: every rank waits for it at the averaging step (post-local SGD / DiLoCo exactly).
    local_overlap: bool = True
    local_overlap_iters: int = 1
    # "adacomm" (LOCAL_PERIODS): local_steps is H_max; the running period starts at H_0, the smallest whose
    # exposed averaging time per step is at most 10 % of the measured compute (measured over the first
    # period, run at H_max), then follows AdaComm's H_l = ceil(sqrt(F_l / F_0) H_0) in [max(1, D), H_0] on
    # the losses given to ddp.observe_loss (none: H stays H_0). Every rank decides from values agreed at
    # the averaging points.
    local_period: str = "fixed"
    # World size 1 runs solo (deft.runtime.solo_mode): no gradient crosses a link, so deft installs no gradient
    # hook and profiles, plans and schedules nothing; the module runs as under torch DDP on one rank. false runs
    # deft's whole machinery on one rank anyway (to profile deft itself).
    solo: bool = True
    profile_path: str | None = None
    schedule_path: str | None = None
    extra: JsonDict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate("<config>")

    def validate(self, source: str) -> None:
        def bad(name: str, problem: str) -> ContractError:
            return ContractError(source, name, problem)

        if not 0.0 <= self.epsilon <= 1.0:
            raise bad("epsilon", f"expected a number in [0, 1], got {self.epsilon}")
        if not self.links:
            raise bad("links", "expected at least one link")
        names = [lk.name for lk in self.links]
        if len(set(names)) != len(names):
            raise bad("links", f"link names must be unique, got {names}")
        for i, lk in enumerate(self.links):
            if lk.backend not in LINK_BACKENDS:
                raise bad(f"links[{i}].backend", f"expected one of {', '.join(LINK_BACKENDS)}, got {lk.backend!r}")
            if i > 0 and lk.backend == "nccl":
                raise bad(f"links[{i}].backend", "only the first (primary) link may be NCCL")
        if self.bucket_cap_mb <= 0:
            raise bad("bucket_cap_mb", f"expected > 0, got {self.bucket_cap_mb}")
        if self.first_bucket_cap_mb <= 0:
            raise bad("first_bucket_cap_mb", f"expected > 0, got {self.first_bucket_cap_mb}")
        if self.partition_numel < 1:
            raise bad("partition_numel", f"expected >= 1, got {self.partition_numel}")
        if self.solver not in SOLVERS:
            raise bad("solver", f"expected one of {', '.join(SOLVERS)}, got {self.solver!r}")
        for name in ("solver_time_limit_s", "timeout_s", "link_deadline_s", "link_deadline_factor"):
            if getattr(self, name) <= 0:
                raise bad(name, f"expected > 0, got {getattr(self, name)}")
        if not 0 <= self.solver_relative_gap < 1:
            raise bad("solver_relative_gap", f"expected in [0, 1), got {self.solver_relative_gap}")
        if self.merge_lr_scaling not in MERGE_LR_SCALINGS:
            raise bad("merge_lr_scaling", f"expected one of {', '.join(MERGE_LR_SCALINGS)}, "
                      f"got {self.merge_lr_scaling!r}")
        if self.compression not in COMPRESSIONS:
            raise bad("compression", f"expected one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")
        if self.profile_codec not in PROFILE_CODECS:
            raise bad("profile_codec", f"expected one of {', '.join(PROFILE_CODECS)}, got {self.profile_codec!r}")
        if self.powersgd_rank < 1:
            raise bad("powersgd_rank", f"expected an integer >= 1, got {self.powersgd_rank}")
        if self.powersgd_start_iter < 2:
            raise bad("powersgd_start_iter", f"expected an integer >= 2 (PowerSGD with error feedback and warm "
                      f"start), got {self.powersgd_start_iter}")
        if not 0 < self.adapt_tolerance < 1:
            raise bad("adapt_tolerance", f"expected in (0, 1), got {self.adapt_tolerance}")
        if self.adapt_max_replans < 0:
            raise bad("adapt_max_replans", f"expected an integer >= 0, got {self.adapt_max_replans}")
        for name in ("warmup_iters", "profile_iters", "preserver_max_tries", "recheck_every", "adapt_window",
                     "plan_lag_iters"):
            low = 0 if name in ("warmup_iters", "plan_lag_iters") else 1
            if getattr(self, name) < low:
                raise bad(name, f"expected an integer >= {low}, got {getattr(self, name)}")
        if not 0 <= self.switch_interval_ms <= 5:
            raise bad("switch_interval_ms", f"expected a number of milliseconds in [0, 5] (0: Python's own "
                      f"interval; it is 5 by default), got {self.switch_interval_ms}")
        if not 0 <= self.planner_nice <= 19:
            raise bad("planner_nice", f"expected an integer in [0, 19] (a nice value), got {self.planner_nice}")
        if self.capacity_growth <= 1.0:
            raise bad("capacity_growth", f"expected > 1, got {self.capacity_growth}")
        if not (self.hierarchical == "auto" or isinstance(self.hierarchical, bool)):
            raise bad("hierarchical", f'expected "auto", true or false, got {self.hierarchical!r}')
        self._validate_local(bad)

    def _validate_local(self, bad: Callable[[str, str], ContractError]) -> None:
        """The local-steps fields (deft.runtime.local_steps)."""
        for name in ("local_steps", "local_warmup_iters"):
            if getattr(self, name) < 0:
                raise bad(name, f"expected an integer >= 0, got {getattr(self, name)}")
        if self.local_outer not in LOCAL_OUTERS:
            raise bad("local_outer", f"expected one of {', '.join(LOCAL_OUTERS)}, got {self.local_outer!r}")
        if not self.local_outer_lr > 0:
            raise bad("local_outer_lr", f"expected > 0, got {self.local_outer_lr}")
        if not 0 <= self.local_outer_momentum < 1:
            raise bad("local_outer_momentum", f"expected in [0, 1), got {self.local_outer_momentum}")
        if self.local_overlap_iters < 1:
            raise bad("local_overlap_iters", f"expected an integer >= 1, got {self.local_overlap_iters}")
        if self.local_period not in LOCAL_PERIODS:
            raise bad("local_period", f"expected one of {', '.join(LOCAL_PERIODS)}, got {self.local_period!r}")
        if self.local_steps == 0:
            if self.local_period != "fixed":
                raise bad("local_period", f"{self.local_period!r} chooses the period of local-steps mode: set "
                          "local_steps > 0 (its largest period H_max) or local_period = \"fixed\"")
            return
        if self.epsilon == 0:
            raise bad("local_steps", f"local steps (H = {self.local_steps}) change the maths of every update, and "
                      "epsilon = 0 promises torch DDP's exact maths: set epsilon > 0 or local_steps = 0")
        if self.local_overlap and self.local_overlap_iters > self.local_steps:
            raise bad("local_overlap_iters", f"expected at most local_steps ({self.local_steps}"
                      f"{', the largest period' if self.local_period == 'adacomm' else ''}): an averaging is "
                      f"applied before the next one starts, got {self.local_overlap_iters}")
        if self.compression not in ("auto", "none"):
            raise bad("compression", f"local steps (local_steps = {self.local_steps}) average parameters exactly; "
                      f"a gradient codec ({self.compression!r}) has nothing to compress there: use \"auto\" or "
                      "\"none\"")

    @property
    def link_names(self) -> tuple[str, ...]:
        return tuple(lk.name for lk in self.links)

    def to_dict(self) -> JsonDict:
        d = asdict(self)
        d["links"] = [asdict(lk) for lk in self.links]
        return d

    @classmethod
    def from_dict(cls, doc: Mapping[str, JsonValue], source: str = "<dict>") -> DeftConfig:
        f = Fields(doc, source, "")
        known = {fl.name for fl in fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ContractError(source, unknown[0], f"unknown setting; known settings are {', '.join(sorted(known))}")
        kw: dict[str, JsonValue | tuple[LinkConfig, ...]] = {}
        defaults = cls.__dataclass_fields__
        if "hierarchical" in doc:
            kw["hierarchical"] = doc["hierarchical"]  # "auto", true or false: checked by validate
        for name in known - {"links", "extra", "profile_path", "schedule_path", "hierarchical"}:
            if name not in doc:
                continue
            default = defaults[name].default
            if isinstance(default, bool):
                if not isinstance(doc[name], bool):
                    raise f.error(name, f"expected true or false, got {doc[name]!r}")
                kw[name] = doc[name]
            elif isinstance(default, int):
                kw[name] = f.int(name)
            elif isinstance(default, float):
                kw[name] = f.float(name, minimum=None)
            else:
                kw[name] = f.str(name)
        for name in ("profile_path", "schedule_path"):
            if name in doc:
                kw[name] = f.opt_str(name)
        if "links" in doc:
            kw["links"] = tuple(
                LinkConfig(name=lf.str("name"), backend=lf.str("backend", "auto", choices=LINK_BACKENDS),
                           ifname=lf.opt_str("ifname"))
                for lf in f.items("links")
            )
        if "extra" in doc:
            kw["extra"] = f.dict("extra")
        cfg = object.__new__(cls)
        base = cls()
        for fl in fields(cls):
            object.__setattr__(cfg, fl.name, kw.get(fl.name, getattr(base, fl.name)))
        cfg.validate(source)
        return cfg

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> DeftConfig:
        p = Path(path)
        try:
            doc = tomllib.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ContractError(str(p), "<file>", "no such config file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ContractError(str(p), "<file>", f"cannot read config file: {e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ContractError(str(p), "<file>", f"not valid TOML: {e}") from None
        return cls.from_dict(doc, str(p))

    @classmethod
    def resolve(cls, config: DeftConfig | str | os.PathLike[str] | JsonDict | None) -> DeftConfig:
        """Accept what users pass: a DeftConfig, a TOML path, a dict, or nothing (then the TOML file named by
        ``$DEFT_CONFIG`` if set, else the defaults)."""
        if config is None:
            # Lets an unchanged training script pick up a deployment's links (the testbed sets it).
            env = os.environ.get(CONFIG_ENV)
            return cls.load(env) if env else cls()
        if isinstance(config, DeftConfig):
            return config
        if isinstance(config, dict):
            return cls.from_dict(config)
        if not isinstance(config, (str, os.PathLike)):
            raise ContractError("<argument>", "config", "expected a DeftConfig, a TOML path, a dict or None, "
                                f"got {type(config).__name__}")
        return cls.load(config)
