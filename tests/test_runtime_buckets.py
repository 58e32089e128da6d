"""The flat gradient layout: buckets as element ranges that may cut parameters and dtypes."""

from __future__ import annotations

import pytest
import torch

from deft.errors import ContractError
from deft.runtime.buckets import FlatLayout, ddp_like_bucket_numel


def _params() -> list[torch.Tensor]:
    return [torch.zeros(4), torch.zeros(3, dtype=torch.bfloat16), torch.zeros(5), torch.zeros(2, dtype=torch.float16)]


def test_buckets_cut_parameters_and_dtypes_into_contiguous_slices() -> None:
    ps = _params()
    order = [2, 1, 0, 3]  # ready order differs from registration order
    lay = FlatLayout(order, ["a", "b", "c", "d"], ps, (6, 6, 2))
    # flat: c[0:5] b[5:8] a[8:12] d[12:14]; fp32 buffer: c then a; bf16: b; fp16: d
    assert [lay.slots[i].flat_offset for i in range(4)] == [8, 5, 0, 12]
    assert lay.slots[0].dtype_offset == 5 and lay.slots[2].dtype_offset == 0
    segs = [[(s.dtype, s.start, s.end) for s in b] for b in lay.segments]
    assert segs[0] == [(torch.float32, 0, 5), (torch.bfloat16, 0, 1)]
    assert segs[1] == [(torch.bfloat16, 1, 3), (torch.float32, 5, 9)]  # c is fp32 too: 5..9 in fp32 buffer
    assert segs[2] == [(torch.float16, 0, 2)]
    assert lay.param_buckets == [[1], [0, 1], [0], [2]]
    assert lay.bucket_params == [(2, 1), (1, 0), (3,)]
    assert lay.bucket_nbytes() == (5 * 4 + 2, 2 * 2 + 4 * 4, 2 * 2)
    bufs = lay.new_buffers(torch.device("cpu"))
    for i, p in enumerate(ps):
        lay.param_view(bufs, i).copy_(torch.arange(p.numel()) + 10 * i)
    # Every element belongs to exactly one bucket view.
    seen = torch.cat([v.float() for b in range(lay.n_buckets) for v in lay.bucket_views(bufs, b)])
    expect = torch.cat([torch.arange(ps[i].numel()).float() + 10 * i for i in order])
    assert sorted(seen.tolist()) == sorted(expect.tolist())


def test_bucket_sizes_must_cover_the_model() -> None:
    with pytest.raises(ContractError, match=r"bucket_numel.*14 trainable elements"):
        FlatLayout([0, 1, 2, 3], ["a", "b", "c", "d"], _params(), (6, 6))


def test_ddp_like_buckets_respect_cap_and_dtype() -> None:
    ps = [torch.zeros(300), torch.zeros(300), torch.zeros(300, dtype=torch.bfloat16), torch.zeros(10)]
    cap_mb = 2500 / 2**20  # 2500 bytes: two fp32 tensors of 1200 bytes fit, a third does not
    assert ddp_like_bucket_numel([0, 1, 2, 3], ps, cap_mb) == (600, 300, 10)
    assert ddp_like_bucket_numel([0, 1, 2, 3], ps, cap_mb, first_cap_mb=1000 / 2**20) == (300, 300, 300, 10)
