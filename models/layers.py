"""Building blocks shared by the built-in models. Attribute names fix the state-dict names
(`conv`, `bn`, `fc`...), so keep them stable: stored weights are addressed by them."""

from __future__ import annotations

from torch import Tensor, nn


class ConvBlock(nn.Module):
    """conv - BatchNorm - ReLU - optional max-pool.

    `bias` defaults to False because BN's shift makes a conv bias redundant; the classic small
    CNNs (CNN5, LeNet-5) keep it so their parameter counts match the papers'.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        *,
        padding: int = 0,
        pool: int | None = None,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=padding, bias=bias)
        self.bn = nn.BatchNorm2d(out_channels)
        self.act = nn.ReLU(inplace=True)
        self.pool: nn.Module = nn.MaxPool2d(pool) if pool else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.pool(self.act(self.bn(self.conv(x))))
        return out


class ConvStage(nn.Module):
    """Several 3x3 ConvBlocks (padding 1) followed by one 2x2 max-pool (VGG style)."""

    def __init__(self, in_channels: int, widths: tuple[int, ...]) -> None:
        super().__init__()
        channels = (in_channels, *widths)
        self.convs = nn.Sequential(
            *(ConvBlock(channels[i], channels[i + 1], 3, padding=1) for i in range(len(widths)))
        )
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.pool(self.convs(x))
        return out


class FCBlock(nn.Module):
    """Optional flatten - linear - optional ReLU."""

    def __init__(
        self, in_features: int, out_features: int, *, flatten: bool = False, act: bool = True
    ) -> None:
        super().__init__()
        self.flatten: nn.Module = nn.Flatten() if flatten else nn.Identity()
        self.fc = nn.Linear(in_features, out_features)
        self.act: nn.Module = nn.ReLU(inplace=True) if act else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.act(self.fc(self.flatten(x)))
        return out
