"""Rank workers for tests/test_integration_lightning.py: Lightning's Trainer in ranks started by
tests._dist.run_ranks.

The ranks exist before the Trainer: ``LOCAL_RANK`` in the environment makes Lightning's
``LightningEnvironment`` report that the processes were created externally (no launch), and
``devices=world, num_nodes=1`` give every rank its global rank; the default process group is already
initialized, so Lightning uses it. Every case trains the same classifier from the same seed on the
same data (each rank its shard through Lightning's ``DistributedSampler``), with
``accumulate_grad_batches=2``, norm clipping that engages, and a validation pass in the middle of the
epoch and at its end, through the strategy's wrapper.
"""

from __future__ import annotations

import glob
import logging
import os
import warnings
from typing import Any

import torch
from torch import nn

BATCH = 8
FEATURES = 16
CLASSES = 4
BATCHES_PER_EPOCH = 6  # per rank: 3 optimizer steps per epoch with accumulation 2
CLIP = 0.05
EXACT: dict[str, Any] = {"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 2, "bucket_cap_mb": 0.001,
                         "timeout_s": 30, "solver_time_limit_s": 0.1}
DEFAULT_EPSILON: dict[str, Any] = {k: v for k, v in EXACT.items() if k != "epsilon"}


def deferring(ckpt_dir: str, rank: int) -> dict[str, Any]:
    """``EXACT`` with a forced schedule (from this rank's own file) whose updates finish in the next
    forward: every bucket is sent in the backward, buckets 0 and 1 (the output side) are waited for and
    applied module by module just before their forward (``Update.deferred``). Checkpoints, validation
    and the end of ``fit`` then come while an update is still finishing. (Not with a global clip: deft
    applies a clipped update whole, at the step.)"""
    from deft.schedule import CommTask, Schedule, StagePlan, Update

    path = os.path.join(ckpt_dir, f"schedule.json.{rank}")
    net = module_class()()
    total = sum(p.numel() for p in net.parameters())
    numel = (total // 3, total // 3, total - 2 * (total // 3))
    P, S = "primary", "second"
    Schedule(cycle=1, links=(P, S), bucket_numel=numel, bucket_nbytes=tuple(4 * n for n in numel),
             stages=(StagePlan(0, "forward"),
                     StagePlan(0, "backward", (CommTask(0, 0, P), CommTask(1, 0, S), CommTask(2, 0, S)))),
             updates=(Update((0,), 0, finish_in_forward=True, deferred=(0, 1)),)).save(path)
    return {**EXACT, "schedule_path": path, "links": [{"name": P}, {"name": S}]}


def _quiet() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def dataset(world: int) -> torch.utils.data.TensorDataset:
    """Inputs with labels from a fixed random teacher, so that the loss can fall."""
    g = torch.Generator().manual_seed(7)
    n = BATCH * BATCHES_PER_EPOCH * world
    x = torch.randn(n, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(1)
    return torch.utils.data.TensorDataset(x, y)


def module_class() -> type:
    import lightning.pytorch as pl

    class Classifier(pl.LightningModule):
        """``manual``: False (automatic optimization), "plain" (backward and step in every training_step),
        "accumulate" (half the loss backward in every training_step, a step every second one, with
        ``clip_gradients`` and an LR scheduler stepped by hand) or "twice" (two ``manual_backward``
        calls in one training_step)."""

        def __init__(self, manual: bool | str = False, norms: bool = True) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.manual = manual
            self.net = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                     nn.Linear(64, CLASSES))
            self.automatic_optimization = not manual
            self.losses: list[float] = []
            self.val_losses: list[float] = []
            self.norms: list[float] = []
            self.record_norms = norms  # touching every gradient waits for it: no update is left finishing

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: list[torch.Tensor], idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            self.losses.append(float(loss))
            if self.manual in (True, "plain"):
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
            elif self.manual == "accumulate":
                opt = self.optimizers()
                self.manual_backward(loss / 2)
                if idx % 2 == 1:
                    self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
                    opt.step()
                    opt.zero_grad()
                    self.lr_schedulers().step()
            elif self.manual == "twice":
                opt = self.optimizers()
                self.manual_backward(loss / 2)
                self.manual_backward(loss / 2)
                opt.step()
                opt.zero_grad()
            return loss

        def validation_step(self, batch: list[torch.Tensor], idx: int) -> None:
            x, y = batch
            self.val_losses.append(float(nn.functional.cross_entropy(self(x), y)))

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:  # before clipping
            if not self.record_norms:
                return
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                                          for g in grads]))))

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
            if self.manual == "accumulate":
                return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)}
            return opt

    return Classifier


def gan_class() -> type:
    """Lightning's manual-optimization GAN: a generator and a discriminator, an optimizer each, a
    backward and a step per network in every training_step (``toggle_optimizer`` around each)."""
    import lightning.pytorch as pl

    class GAN(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, FEATURES))
            self.discriminator = nn.Sequential(nn.Linear(FEATURES, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
            self.automatic_optimization = False

        def forward(self, z: torch.Tensor) -> torch.Tensor:
            return self.generator(z)

        def training_step(self, batch: list[torch.Tensor], idx: int) -> None:
            real, _ = batch
            opt_g, opt_d = self.optimizers()
            z = torch.randn(real.shape[0], 8)
            ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
            bce = nn.functional.binary_cross_entropy_with_logits
            self.toggle_optimizer(opt_g)
            self.manual_backward(bce(self.discriminator(self(z)), ones))
            opt_g.step()
            opt_g.zero_grad()
            self.untoggle_optimizer(opt_g)
            self.toggle_optimizer(opt_d)
            fake = self(z).detach()
            self.manual_backward((bce(self.discriminator(real), ones) + bce(self.discriminator(fake), zeros)) / 2)
            opt_d.step()
            opt_d.zero_grad()
            self.untoggle_optimizer(opt_d)

        def configure_optimizers(self) -> Any:
            return (torch.optim.Adam(self.generator.parameters(), lr=2e-3),
                    torch.optim.Adam(self.discriminator.parameters(), lr=2e-3))

    return GAN


def fit(world: int, strategy: Any, steps: int, precision: str = "32-true", ckpt_dir: str | None = None,
        ckpt_path: str | None = None, module: Any = None, callbacks: list[Any] | None = None,
        manual: bool | str = False, clip: bool = True, compiled: bool = False, gan: bool = False,
        backbone: bool = False) -> Any:
    """A fresh module trained by a fresh Trainer for ``steps`` optimizer steps; the module.
    ``compiled``: ``fit`` gets ``torch.compile(module)`` (Lightning compiles its forward and steps),
    compiled afresh as in a process of its own (Dynamo would reuse an earlier run's code for the class).
    ``backbone``: the module's ``backbone`` is its first two layers (what Lightning's finetuning callbacks
    freeze and unfreeze)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = gan_class()() if gan else module_class()(manual, norms=clip)
    if backbone:
        module.backbone = module.net[:4]
    given: Any = module
    if compiled:
        torch._dynamo.reset()
        given = torch.compile(module, backend="aot_eager")
    data = dataset(world)
    train = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)
    val = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)
    callbacks = list(callbacks or [])
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}-{step}", save_top_k=-1))
    trainer = pl.Trainer(accelerator="cpu", devices=world, num_nodes=1, strategy=strategy, precision=precision,
                         max_steps=steps, accumulate_grad_batches=1 if manual or gan else 2,
                         gradient_clip_val=CLIP if clip and not (manual or gan) else None,
                         val_check_interval=BATCHES_PER_EPOCH // 2, limit_val_batches=2, num_sanity_val_steps=0,
                         logger=False, enable_checkpointing=ckpt_dir is not None, callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=ckpt_dir)
    trainer.fit(given, train, val, ckpt_path=ckpt_path)
    return module


def params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def strategy(config: dict[str, Any], **kw: Any) -> Any:
    from deft.integrations.lightning import DeftStrategy

    return DeftStrategy(deft_config=config, **kw)


def naive_strategy(config: dict[str, Any]) -> Any:
    """The obvious integration: ``DDPStrategy`` building deft's wrapper in ``_setup_model``, nothing else."""
    import lightning.pytorch as pl

    import deft

    class NaiveDeftStrategy(pl.strategies.DDPStrategy):
        def _setup_model(self, model: nn.Module) -> nn.Module:
            return deft.DistributedDataParallel(model, config=config)

    return NaiveDeftStrategy()


def keeper() -> Any:
    """A callback holding the strategy's deft wrapper (``DeftStrategy.deft_ddp``), whose ``update_log``
    stays readable after ``fit`` has handed back the bare module."""
    import lightning.pytorch as pl

    class KeepWrapper(pl.Callback):
        ddp: Any = None

        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.ddp = trainer.strategy.deft_ddp

    return KeepWrapper()


def _deft_fit(world: int, config: dict[str, Any], steps: int, **kw: Any) -> tuple[Any, list[int]]:
    """``fit`` under ``DeftStrategy``; the module and the iterations its wrapper applied, in order."""
    module, its, _ = _deft_fit_recorded(world, config, steps, **kw)
    return module, its


def _deft_fit_recorded(world: int, config: dict[str, Any], steps: int, **kw: Any) -> tuple[Any, list[int], Any]:
    """:func:`_deft_fit`, and the wrapper's ``plan_info["used_before_forward"]``."""
    keep = keeper()
    module = fit(world, strategy(config), steps, callbacks=[keep, *kw.pop("callbacks", [])], **kw)
    used = keep.ddp.plan_info.get("used_before_forward")
    return module, sorted(t for _, its in keep.ddp.update_log for t in its), used


def parity_worker(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    """Every case, in the same ranks: torch DDP's run first, then deft's from the same seed; each a
    dict of plain values (``worst``: the largest parameter difference from its reference)."""
    os.environ["LOCAL_RANK"] = str(rank)
    _quiet()
    from deft.errors import DeftError

    # two epochs and one step of the third: fit() stops right after that step, with no validation after
    # it (a validation forward would apply what is still finishing)
    steps = BATCHES_PER_EPOCH + 2
    out: dict[str, Any] = {}
    for precision in ("32-true", "bf16-mixed"):  # clipping engaged, deft's own plan
        ref = fit(world, "ddp", steps, precision)
        ours, its = _deft_fit(world, EXACT, steps, precision=precision)
        out[precision] = {"worst": worst(params(ours), params(ref)), "applied": its, "norms": ref.norms,
                          "val": ours.val_losses, "ref_val": ref.val_losses, "losses": ours.losses,
                          "ref_losses": ref.losses}
    # updates finishing in the next forward, checkpoints saved by ModelCheckpoint at every validation
    forced = deferring(ckpt_dir, rank)
    ref = fit(world, "ddp", steps, clip=False)
    ours, its, used = _deft_fit_recorded(world, forced, steps, ckpt_dir=ckpt_dir, clip=False)
    out["deferring"] = {"worst": worst(params(ours), params(ref)), "applied": its,
                        "val": ours.val_losses, "ref_val": ref.val_losses, "used_before_forward": used}
    saved = sorted(os.path.basename(f) for f in glob.glob(os.path.join(ckpt_dir, "*.ckpt")))
    end_of_second = os.path.join(ckpt_dir, f"epoch=1-step={BATCHES_PER_EPOCH}.ckpt")
    resumed, its = _deft_fit(world, forced, steps, ckpt_path=end_of_second, clip=False)
    # which checkpoints hold deft's record: every one, those between a step's micro-batches included
    with_record = sorted(f for f in saved if "deft" in torch.load(os.path.join(ckpt_dir, f), weights_only=False))
    out["resumed"] = {"worst": worst(params(resumed), params(ours)), "applied": its, "saved": saved,
                      "with_record": with_record}
    # torch.compile(module) given to fit, on the same schedule
    ref_compiled = fit(world, "ddp", steps, clip=False, compiled=True)
    ours, its = _deft_fit(world, forced, steps, clip=False, compiled=True)
    out["compiled"] = {"worst": worst(params(ours), params(ref_compiled)), "applied": its,
                       "vs_eager": worst(params(ref_compiled), params(ref))}
    # the obvious integration, on the same schedule
    naive = fit(world, naive_strategy(forced), steps, clip=False)
    out["naive"] = {"worst": worst(params(naive), params(ref))}
    # the default epsilon: more steps, so that a plan runs after the profile
    default, its = _deft_fit(world, DEFAULT_EPSILON, 3 * steps)
    out["default"] = {"applied": its, "losses": default.losses, "steps": 3 * steps,
                      "finite": all(bool(p.isfinite().all()) for p in default.parameters())}
    # manual optimization: backward and step in every training_step, exact and with the forced schedule;
    # accumulated over two training_steps with clip_gradients and a scheduler stepped by hand
    ref = fit(world, "ddp", steps, manual="plain")
    for name, cfg in (("manual", EXACT), ("manual_deferring", forced)):
        ours, its = _deft_fit(world, cfg, steps, manual="plain")
        out[name] = {"worst": worst(params(ours), params(ref)), "applied": its, "losses": ours.losses,
                     "ref_losses": ref.losses}
    ref = fit(world, "ddp", steps, manual="accumulate")
    ours, its = _deft_fit(world, EXACT, steps, manual="accumulate")
    out["manual_accumulate"] = {"worst": worst(params(ours), params(ref)), "applied": its,
                                "batches": len(ours.losses)}
    # Lightning's BackboneFinetuning: the backbone frozen when the module is wrapped, unfrozen into a new
    # param group at the second epoch; neither wrapper averages its gradient, each rank steps its own
    from lightning.pytorch.callbacks import BackboneFinetuning

    def finetuning() -> list[Any]:
        return [BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_lr=1e-3, verbose=False)]

    ref = fit(world, "ddp", steps, clip=False, backbone=True, callbacks=finetuning())
    ours, its = _deft_fit(world, EXACT, steps, clip=False, backbone=True, callbacks=finetuning())
    out["backbone_finetuning"] = {"worst": worst(params(ours), params(ref)), "applied": its,
                                  "params": [p.flatten().tolist() for p in params(ours)]}
    # a comm hook given to the strategy on the CPU: strategy="ddp" leaves it out there, and so must deft
    import lightning.pytorch as pl
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = {"ddp_comm_hook": default_hooks.fp16_compress_hook}
    ref = fit(world, pl.strategies.DDPStrategy(**hook), steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = fit(world, strategy(EXACT, **hook), steps)
    out["comm_hook_on_cpu"] = {"worst": worst(params(ours), params(ref)),
                               "warned": [str(w.message) for w in caught if "ddp_comm_hook" in str(w.message)],
                               "vs_exact": worst(params(ref), params(fit(world, "ddp", steps)))}
    # refused: a GAN's two optimizers at setup; a second manual_backward in one training_step, before it runs
    for name, kw in (("gan", {"gan": True}), ("twice", {"manual": "twice"})):
        try:
            fit(world, strategy(EXACT), steps, **kw)
            out[name] = ""
        except DeftError as e:
            out[name] = str(e)
    return out
