"""Two wrapped models, two optimizers, one loop: torch's DCGAN example, torch DDP and deft side by side.

The loop is the DCGAN example's (pytorch/examples, ``dcgan/main.py``), shrunk to MLPs with batch norm:
the discriminator's step accumulates two backwards without ``no_sync()`` (real, then the generator's
output detached); the generator's loss runs the discriminator a third time and its backward fills the
discriminator's gradients too, which no step takes and the next iteration's ``netD.zero_grad()``
clears. Each model has its own wrapper and optimizer. At ``epsilon = 0`` both models' parameters,
every loss and every output mean must equal torch DDP's to 1e-5, on each schedule mode of
:mod:`tests.compat._harness` (each wrapper gets its own). The biases before a batch norm have
gradients of pure rounding noise, which Adam scales up to steps of its learning rate: they match only
where deft adds the carried gradient before reducing, in torch DDP's order (after reducing, they were
0.014 apart).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

from tests._dist import run_ranks, values
from tests.compat._harness import close, deft_wrapper, worst_relative

NZ, STEPS = 8, 16


def _generator() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(NZ, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh())


def _discriminator() -> nn.Module:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 16), nn.BatchNorm1d(16),
                         nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())


def _real(rank: int, t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * t + rank)
    return torch.tanh(torch.randn(16, 16, generator=g) + 0.5)


def _train(netG: nn.Module, netD: nn.Module, optG: torch.optim.Optimizer, optD: torch.optim.Optimizer,
           rank: int) -> list[float]:
    """The DCGAN example's iteration; what it prints (errD, errG, D(x), D(G(z)) before and after)."""
    criterion = nn.BCELoss()
    logged = []
    for t in range(STEPS):
        real = _real(rank, t)
        noise = torch.randn(16, NZ, generator=torch.Generator().manual_seed(7 * t + rank))
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        output = netD(real).view(-1)
        errD_real = criterion(output, torch.full((16,), 1.0))
        errD_real.backward()
        D_x = output.mean().item()
        fake = netG(noise)
        output = netD(fake.detach()).view(-1)
        errD_fake = criterion(output, torch.full((16,), 0.0))
        errD_fake.backward()
        D_G_z1 = output.mean().item()
        errD = errD_real + errD_fake
        optD.step()
        # (2) Update G network: maximize log(D(G(z)))
        netG.zero_grad()
        output = netD(fake).view(-1)
        errG = criterion(output, torch.full((16,), 1.0))
        errG.backward()
        D_G_z2 = output.mean().item()
        optG.step()
        logged += [errD.item(), errG.item(), D_x, D_G_z1, D_G_z2]
    return logged


def gan_worker(rank: int, world: int, mode: str, workdir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("torch", "deft"):
        g, d = _generator(), _discriminator()
        if kind == "torch":
            netG: nn.Module = nn.parallel.DistributedDataParallel(g)
            netD: nn.Module = nn.parallel.DistributedDataParallel(d)
        else:
            for sub in ("G", "D"):
                os.makedirs(os.path.join(workdir, sub), exist_ok=True)
            netG = deft_wrapper(g, mode, 0.0, os.path.join(workdir, "G"), rank)
            netD = deft_wrapper(d, mode, 0.0, os.path.join(workdir, "D"), rank)
        optD = torch.optim.Adam(d.parameters(), lr=2e-3, betas=(0.5, 0.999))
        optG = torch.optim.Adam(g.parameters(), lr=2e-3, betas=(0.5, 0.999))
        logged = _train(netG, netD, optG, optD, rank)
        if kind == "deft":
            netG.flush()  # type: ignore[operator]
            netD.flush()  # type: ignore[operator]
            out["skipped_d"] = list(netD.plan_info.get("skipped_steps", []))  # type: ignore[union-attr]
        out[kind] = {"logged": logged, "params": [p.detach().flatten().tolist() for m in (g, d)
                                                  for p in m.parameters()]}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["forced", "given", "measured"])
def test_the_dcgan_loop_matches_torch_ddp_at_epsilon_zero(mode: str, tmp_path: Any) -> None:
    out = values(run_ranks(gan_worker, 2, (mode, str(tmp_path)), timeout=240))
    for v in out:
        worst = worst_relative(v["deft"]["params"], v["torch"]["params"])
        assert worst < 1e-5, f"parameters differ from torch DDP's by {worst:.3g}"
        assert close(v["deft"]["logged"], v["torch"]["logged"]), (v["deft"]["logged"], v["torch"]["logged"])
        # three D iterations per GAN iteration: real, fake (carried: one step applies both), and the
        # generator's backward through D, whose gradients no step takes (cleared: a skipped step)
        assert v["skipped_d"] == [3 * k + 2 for k in range(STEPS)], v["skipped_d"]
    assert out[0]["deft"]["params"] == out[1]["deft"]["params"]
