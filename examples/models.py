"""Models for the examples and benchmarks, defined here (no torchvision).

:class:`DigitsCNN` is sized so that, at 250 Mbit/s between two CPU ranks, gradient communication
dominates computation, as in docs/DESIGN.md section 6 (a 4.4M-parameter CNN): 4.4 million parameters
(17.6 MB of fp32 gradients; a 2-rank ring all-reduce sends that much per rank, ~0.56 s at 250 Mbit/s)
spread over layers of very different sizes, so bucketing, partitioning and link assignment all have
something to decide.
"""

from __future__ import annotations

import torch
from torch import nn


def _conv_block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


class DigitsCNN(nn.Module):
    """VGG-style CNN for 1x32x32 images, 10 classes, ~4.4M parameters.

    Shapes (default ``width=64``): 32x32 -> [conv 64, conv 64, pool] 16x16 -> [conv 128, conv 128, pool]
    8x8 -> [conv 256, pool] 4x4 -> flatten 4096 -> fc 832 -> fc 512 -> fc 10 (dropout before the
    hidden fcs). 4,395,786 parameters: 3.4M in the first fc, 0.55M in the convolutions. One training
    iteration at batch 32 takes ~0.25-0.3 s on one CPU core, so at 250 Mbit/s communication (~0.56 s
    per iteration on one link) is about twice the computation.
    """

    def __init__(self, num_classes: int = 10, width: int = 64, hidden: int = 832) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            _conv_block(1, w), _conv_block(w, w), nn.MaxPool2d(2),
            _conv_block(w, 2 * w), _conv_block(2 * w, 2 * w), nn.MaxPool2d(2),
            _conv_block(2 * w, 4 * w), nn.MaxPool2d(2),
        )
        flat = 4 * w * 4 * 4
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(0.3), nn.Linear(flat, hidden), nn.ReLU(inplace=True),
            nn.Dropout(0.3), nn.Linear(hidden, 512), nn.ReLU(inplace=True),
            nn.Linear(512, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


MODELS = {"digits_cnn": DigitsCNN}
