"""The demo's image model (a small Flux trained on handwritten digits), and a yardstick for it:
which digit does an image show?"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

# Made by scripts/train_digits.py; prompt it "a handwritten digit seven" (or "... 7").
DIGITS_MODEL = Path(__file__).resolve().parents[1] / "assets" / "digits-flux"
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def digit_classifier() -> Callable[[np.ndarray], int]:
    """Nearest class mean of scikit-learn's 8x8 digits (it gets ~90% of those digits right),
    for square RGB images in [0, 1] with dark ink on white, as the model draws them."""
    from sklearn.datasets import load_digits

    data = load_digits()
    means = np.stack([data.images[data.target == d].mean(0) for d in range(10)])

    def classify(image: np.ndarray) -> int:
        gray = torch.from_numpy(np.asarray(image)).float().mean(-1)[None, None]
        ink = (1 - F.avg_pool2d(gray, gray.shape[-1] // 8)[0, 0].numpy()) * 16
        return int(np.argmin(((means - ink) ** 2).sum((1, 2))))

    return classify
