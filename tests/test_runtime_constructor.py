"""A torch DDP constructor line works verbatim with deft.

One gloo rank in a fresh process: torch DDP's positional order (``module, device_ids, output_device,
dim, broadcast_buffers, ...``) and keyword arguments are accepted; deft's own arguments are
keyword-only, and passing the optimizer where torch puts ``device_ids`` is a clear error; arguments
deft cannot honour raise naming them; the wrapper carries torch DDP's attributes of its arguments with
torch DDP's values. With one rank and ``epsilon = 0`` a step applies the plain
gradient, so the parameters equal those of the same model trained without any wrapper (after
``ddp.flush()``: a lag-free plan applies an update of the last iteration just before the next forward).
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import nn

from tests._dist import run_ranks, values


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _train(model: nn.Module, forward: Any, finish: Any, steps: int = 3) -> list[list[float]]:
    """``steps`` SGD steps through ``forward``, then ``finish()`` (deft: ``flush``, which applies an update a
    lag-free plan leaves for the next forward), then the parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for t in range(steps):
        x = torch.arange(12, dtype=torch.float32).reshape(3, 4) / (t + 1)
        forward(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    finish()
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def _forward_flags(ddp: nn.Module) -> list[bool]:
    """``require_forward_param_sync`` as built, after an evaluation forward, after a training iteration,
    after one under ``no_sync()`` and after the next."""
    x = torch.ones(3, 4)
    flags = [ddp.require_forward_param_sync]
    with torch.no_grad():
        ddp(x)
    flags.append(ddp.require_forward_param_sync)
    ddp(x).sum().backward()
    flags.append(ddp.require_forward_param_sync)
    with ddp.no_sync():  # type: ignore[operator]
        ddp(x).sum().backward()
    flags.append(ddp.require_forward_param_sync)
    ddp(x).sum().backward()
    flags.append(ddp.require_forward_param_sync)
    return flags


def constructor_worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    import deft
    from deft.errors import DeftError

    cfg = {"epsilon": 0.0, "warmup_iters": 1, "profile_iters": 1, "timeout_s": 30}
    out: dict[str, Any] = {}
    # torch DDP lines, verbatim apart from the class (a config comes from DEFT_CONFIG or the defaults;
    # here the keyword keeps the test short).
    m = _model()
    ddp = deft.DistributedDataParallel(m, None, None, 0, True, config=cfg)
    out["positional"] = _train(m, ddp, ddp.flush)
    ddp.close()
    m = _model()
    ddp = deft.DistributedDataParallel(m, device_ids=None, output_device=None, broadcast_buffers=False,
                                       bucket_cap_mb=25, find_unused_parameters=True, gradient_as_bucket_view=True,
                                       static_graph=False, config=cfg)
    out["keywords"] = _train(m, ddp, ddp.flush)
    ddp.close()
    # torch DDP's attributes of its arguments, read by user code and trainers, against torch DDP's own
    group = dist.new_group([0])
    kwargs = dict(dim=0, process_group=group, bucket_cap_mb=2, find_unused_parameters=True, static_graph=False)
    ours, ref = deft.DistributedDataParallel(_model(), config=cfg, **kwargs), nn.parallel.DistributedDataParallel(
        _model(), **kwargs)
    ref._set_static_graph()
    ours._set_static_graph()
    names = ("device_ids", "output_device", "device_type", "dim", "find_unused_parameters", "gradient_as_bucket_view",
             "static_graph", "bucket_bytes_cap", "broadcast_buffers", "require_backward_grad_sync",
             "parameters_to_ignore")
    out["attributes"] = {n: tuple(sorted(v) if isinstance(v, set) else v for v in (getattr(ours, n), getattr(ref, n)))
                         for n in names}
    out["same_group"] = ours.process_group is group and ref.process_group is group
    with ours.no_sync():
        out["flag_in_no_sync"] = ours.require_backward_grad_sync
    out["flag_after"] = ours.require_backward_grad_sync
    out["forward_flags"] = (_forward_flags(ours), _forward_flags(ref))
    out["isinstance"] = isinstance(ours, nn.parallel.DistributedDataParallel)
    to_save = ours.module if isinstance(ours, nn.parallel.DistributedDataParallel) else ours  # the saving idiom
    out["saved_keys"] = (sorted(to_save.state_dict()), sorted(_model().state_dict()))
    pickled = {}  # torch.save of the wrapper itself on a process group of its own: refused by both
    for kind, wrapper in (("deft", ours), ("torch", ref)):
        try:
            torch.save(wrapper, io.BytesIO())
            pickled[kind] = None
        except Exception as e:  # torch raises a RuntimeError, deft a DeftError
            pickled[kind] = f"{type(e).__name__}: {e}"
    out["pickled"] = pickled
    ours.close()
    m = _model()
    out["plain"] = _train(m, m, lambda: None)

    errors = {}
    for name, kwargs in {"optimizer_positional": {"device_ids": torch.optim.SGD(_model().parameters(), lr=0.1)},
                         "mixed_precision": {"mixed_precision": object()},
                         "cpu_device_ids": {"device_ids": [0]}}.items():
        try:
            deft.DistributedDataParallel(_model(), config=cfg, **kwargs)
            errors[name] = None
        except DeftError as e:
            errors[name] = str(e)
    sync_bn = nn.Sequential(nn.Linear(4, 8), nn.SyncBatchNorm(8))
    for kind, wrap in (("deft", lambda: deft.DistributedDataParallel(sync_bn, config=cfg)),
                       ("torch", lambda: nn.parallel.DistributedDataParallel(sync_bn))):
        try:
            wrap()
            errors[f"sync_batch_norm_{kind}"] = None
        except (DeftError, ValueError) as e:
            errors[f"sync_batch_norm_{kind}"] = str(e)
    out["errors"] = errors
    return out


@pytest.mark.slow
def test_torch_ddp_constructor_lines_carry_over() -> None:
    (out,) = values(run_ranks(constructor_worker, 1, timeout=120))
    for key in ("positional", "keywords"):
        for ours, ref in zip(out[key], out["plain"], strict=True):
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=1e-6, atol=1e-6)
    for name, (ours, ref) in out["attributes"].items():
        assert ours == ref, (name, ours, ref)
    assert out["same_group"] and out["flag_in_no_sync"] is False and out["flag_after"] is True
    ours_flags, torch_flags = out["forward_flags"]
    assert ours_flags == torch_flags == [True, False, True, False, True]
    assert out["isinstance"]
    keys, plain_keys = out["saved_keys"]
    assert keys == plain_keys
    assert "default process group" in out["pickled"]["torch"], out["pickled"]
    assert out["pickled"]["deft"].startswith("DeftError: torch.save or copy.deepcopy of the wrapper: supported "
                                             "with the default process group only"), out["pickled"]
    errors = out["errors"]
    assert "device_ids" in errors["optimizer_positional"] and "optimizer=" in errors["optimizer_positional"]
    assert "mixed_precision" in errors["mixed_precision"]
    assert "device_ids must be None" in errors["cpu_device_ids"]
    # refused at construction on the CPU, as torch DDP refuses it
    assert "SyncBatchNorm layers only work with GPU modules" in errors["sync_batch_norm_torch"]
    deft_error = errors["sync_batch_norm_deft"]
    assert deft_error is not None and "module '1' is a SyncBatchNorm" in deft_error


def test_device_ids_read_as_torch_ddp_sets_them() -> None:
    """torch DDP's attributes: the indices given (``output_device`` the first of them unless given) for a
    module on an accelerator, ``None`` for a CPU module or no ``device_ids`` (the CUDA branch, without one)."""
    from deft.runtime.compat import torch_device_ids

    cuda = torch.device("cuda", 1)
    assert torch_device_ids([torch.device("cuda", 1)], None, cuda) == ([1], 1)
    assert torch_device_ids(["cuda:1"], "cuda:0", cuda) == ([1], 0)
    assert torch_device_ids(None, None, cuda) == (None, None)
    assert torch_device_ids([], None, cuda) == (None, None)
    assert torch_device_ids(None, None, torch.device("cpu")) == (None, None)
