"""A stand-in for the ``torchvision`` names that Opacus 1.6.0's ``privacy_engine_test.py`` imports
(``models.resnet18``, ``models.densenet121``, ``transforms.Compose/ToTensor/Normalize``,
``datasets.FakeData``), used only when torchvision is not installed.

What the tests rely on is kept:

* ``FakeData(size, image_size, num_classes, transform)``: item ``i`` is an image drawn from
  ``torch.randn(image_size)`` under seed ``i`` and a label ``randint(num_classes)`` under the
  same seed (torchvision's generation), mapped into [0, 1] (torchvision round-trips it through
  an 8-bit PIL image) and passed through ``transform``;
* ``ToTensor`` (identity on a tensor already in [0, 1]) and ``Normalize(mean, std)``;
* ``resnet18()`` / ``densenet121()``: small convolutional nets with ``BatchNorm2d`` layers (what
  Opacus' module validator refuses and ``ModuleValidator.fix`` replaces) and, for densenet,
  a ``classifier`` linear head — the only properties the tests use (they never train them).
"""

from __future__ import annotations

import sys
import types

import torch
from torch import nn
from torch.utils.data import Dataset


class FakeData(Dataset):
    def __init__(self, size=1000, image_size=(3, 224, 224), num_classes=10, transform=None,
                 target_transform=None, random_offset=0):
        self.size, self.image_size, self.num_classes = size, tuple(image_size), num_classes
        self.transform, self.target_transform = transform, target_transform
        self.random_offset = random_offset

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        if index >= len(self):
            raise IndexError(f"{type(self).__name__} index out of range")
        state = torch.get_rng_state()
        torch.manual_seed(index + self.random_offset)
        img = torch.randn(*self.image_size)
        target = torch.randint(0, self.num_classes, size=(1,), dtype=torch.long)[0]
        torch.set_rng_state(state)
        img = torch.sigmoid(img)  # into [0, 1], as an 8-bit image read back would be
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, int(target)


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class ToTensor:
    def __call__(self, x):
        return torch.as_tensor(x, dtype=torch.float32)


class Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x):
        return (x - self.mean) / self.std


class _SmallBNNet(nn.Module):
    def __init__(self, num_classes=1000):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8),
                                      nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.classifier = nn.Linear(8, num_classes)

    def forward(self, x):
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        return self.classifier(torch.flatten(self.features(x), 1))


def resnet18(weights=None, num_classes=1000):
    return _SmallBNNet(num_classes)


def densenet121(weights=None, num_classes=1000):
    return _SmallBNNet(num_classes)


def mobilenet_v3_small(weights=None, num_classes=1000):
    return _SmallBNNet(num_classes)


def install() -> bool:
    """Register the stand-in as ``torchvision`` if torchvision is missing; ``True`` if it did."""
    try:
        import torchvision  # noqa: F401
        return False
    except ImportError:
        pass
    root = types.ModuleType("torchvision")
    models = types.ModuleType("torchvision.models")
    transforms = types.ModuleType("torchvision.transforms")
    datasets = types.ModuleType("torchvision.datasets")
    models.resnet18, models.densenet121 = resnet18, densenet121
    models.mobilenet_v3_small = mobilenet_v3_small
    transforms.Compose, transforms.ToTensor, transforms.Normalize = Compose, ToTensor, Normalize
    datasets.FakeData = FakeData
    root.models, root.transforms, root.datasets = models, transforms, datasets
    root.__stand_in__ = True
    sys.modules.update({"torchvision": root, "torchvision.models": models,
                        "torchvision.transforms": transforms, "torchvision.datasets": datasets})
    return True


def uninstall() -> None:
    """Take the stand-in out of ``sys.modules`` again (the Opacus test modules imported while it
    was installed keep their references). Left installed, it would make other modules that
    probe for torchvision (Lightning: ``importlib.util.find_spec``) fail on its missing
    ``__spec__``."""
    if not getattr(sys.modules.get("torchvision"), "__stand_in__", False):
        return
    for name in ("torchvision", "torchvision.models", "torchvision.transforms",
                 "torchvision.datasets"):
        sys.modules.pop(name, None)
