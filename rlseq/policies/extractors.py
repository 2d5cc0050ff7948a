"""Feature extractors (SB3 ``BaseFeaturesExtractor``): the IMPALA CNN of the Procgen paper, and a ``Dict``
extractor that sends images through it and concatenates the flattened vector keys.

For vector observations use SB3's own ``FlattenExtractor`` (what ``MlpPolicy`` / ``MlpLstmPolicy`` use).

**Image scaling, done once.** Inside SB3, ``preprocess_obs`` already divides ``uint8`` image spaces by 255 (the
policies' default ``normalize_images=True``) and hands the extractor float tensors: those are used as they come.
Raw ``uint8`` tensors (e.g. from code that bypasses ``preprocess_obs``) are divided by 255 here. So an image is
never scaled twice; with ``normalize_images=False`` SB3 passes unscaled floats, which are then the caller's
business.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from gymnasium import spaces
from stable_baselines3.common.preprocessing import get_flattened_obs_dim, is_image_space, is_image_space_channels_first
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
from torch import nn

__all__ = ["ImpalaCNN", "ImpalaCombinedExtractor"]


class _ResidualBlock(nn.Module):
    """``x + conv(relu(conv(relu(x))))`` with 3x3 convolutions that keep the channel count."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


class _ConvSequence(nn.Module):
    """IMPALA stage: 3x3 conv → 3x3 max-pool with stride 2 (halves H and W) → two residual blocks."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.res0 = _ResidualBlock(out_channels)
        self.res1 = _ResidualBlock(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.res1(self.res0(self.pool(self.conv(x))))


def _image_layout(space: spaces.Box) -> tuple[bool, int, int, int]:
    """``(channels_last, C, H, W)`` of an image space (SB3's VecTransposeImage makes spaces channel-first)."""
    if len(space.shape) != 3:
        raise ValueError(f"ImpalaCNN needs a 3-d image space, got shape {space.shape}")
    if is_image_space_channels_first(space):
        c, h, w = space.shape
        return False, c, h, w
    h, w, c = space.shape
    return True, c, h, w


class ImpalaCNN(BaseFeaturesExtractor):
    """The IMPALA CNN as used by the Procgen paper (Espeholt et al. 2018; Cobbe et al. 2020).

    Three stages with channels ``[16, 32, 32]`` (conv 3x3 → max-pool 3x3/2 → 2 residual blocks each), then
    ReLU → flatten → linear → ReLU to ``features_dim = 256``. A 64x64x3 frame becomes 32·8·8 = 2048 values
    before the linear layer.

    Input ``[B, C, H, W]`` (channel-first, as SB3 delivers after ``VecTransposeImage``) or ``[B, H, W, C]`` when
    the observation space itself is channel-last; float in [0, 1] (SB3 has scaled it) or raw ``uint8`` (scaled
    here, see the module docstring). Output ``[B, features_dim]``.
    """

    def __init__(
        self,
        observation_space: spaces.Box,
        features_dim: int = 256,
        channels: Sequence[int] = (16, 32, 32),
        normalized_image: bool = False,  # accepted for SB3 compatibility; scaling is decided by the dtype
    ) -> None:
        super().__init__(observation_space, features_dim)
        self.channels_last, c, h, w = _image_layout(observation_space)
        self.channels = tuple(int(ch) for ch in channels)
        stages = []
        for out in self.channels:
            stages.append(_ConvSequence(c, out))
            c, h, w = out, (h + 1) // 2, (w + 1) // 2  # max-pool 3/2 with padding 1: ceil(n / 2)
        self.stages = nn.Sequential(*stages)
        self.linear = nn.Linear(c * h * w, features_dim)

    def forward(self, observations: torch.Tensor) -> torch.Tensor:
        x = observations
        if x.dtype == torch.uint8:
            x = x.float() / 255.0
        if self.channels_last:
            x = x.permute(0, 3, 1, 2)
        x = self.stages(x)
        return torch.relu(self.linear(torch.relu(x).flatten(1)))


class ImpalaCombinedExtractor(BaseFeaturesExtractor):
    """``Dict`` observations: each image key through its own :class:`ImpalaCNN` (``cnn_output_dim`` features),
    every other key flattened, all concatenated (in the space's key order).

    For :class:`rlseq.envs.PrevActionReward` observations ``{"image", "prev_action", "prev_reward"}`` that is
    256 + n_actions + 1 features. Like SB3's ``CombinedExtractor``, with the IMPALA CNN instead of NatureCNN.
    """

    def __init__(
        self,
        observation_space: spaces.Dict,
        cnn_output_dim: int = 256,
        channels: Sequence[int] = (16, 32, 32),
        normalized_image: bool = False,
    ) -> None:
        super().__init__(observation_space, features_dim=1)  # set below, once the sizes are known
        extractors: dict[str, nn.Module] = {}
        total = 0
        for key, sub in observation_space.spaces.items():
            if is_image_space(sub, check_channels=False, normalized_image=normalized_image) and len(sub.shape) == 3:
                extractors[key] = ImpalaCNN(sub, features_dim=cnn_output_dim, channels=channels)
                total += cnn_output_dim
            else:
                extractors[key] = nn.Flatten()
                total += get_flattened_obs_dim(sub)
        self.extractors = nn.ModuleDict(extractors)
        self._features_dim = total

    def forward(self, observations: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([ext(observations[key].float() if not isinstance(ext, ImpalaCNN) else observations[key])
                          for key, ext in self.extractors.items()], dim=1)
