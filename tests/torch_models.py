"""A small ResNet-style model for the tests of wsarena.torch (CPU and GPU): a stem, three residual blocks (one
that halves the resolution through a strided 1x1 shortcut, one grouped), a dilated 3x3, pooling and a linear head.
"""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def small_resnet(classes: int = 5) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),  # with bias
        nn.BatchNorm2d(8),
        nn.ReLU(),
        Block(8, 8),
        Block(8, 16, stride=2),
        Block(16, 16, groups=4),
        nn.Conv2d(16, 16, 3, padding="same", dilation=2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, classes),
    )


def step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward: the loss and every parameter's gradient (by name)."""
    model.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x).float(), target)
    loss.backward()
    return loss.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}
