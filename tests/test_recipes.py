"""The reference recipes shared by examples and benchmarks: models, evaluation, augmentation."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from benchmarks.core.data import augment
from sbloader.recipes import (
    _BasicBlock,
    cosine_lr,
    error_rate,
    eval_batch_size,
    mlp,
    resnet18,
    small_cnn,
)


def test_resnet18_shapes_backbone_split_and_any_resolution():
    torch.manual_seed(0)
    m = resnet18(num_classes=7, in_channels=1).eval()
    x = torch.randn(3, 1, 32, 32)
    assert m(x).shape == (3, 7)
    assert m[:7](x).shape == (3, 512, 4, 4)  # the backbone a frozen prefix can take
    torch.testing.assert_close(m[7:](m[:7](x)), m(x))
    assert m(torch.randn(3, 1, 16, 16)).shape == (3, 7)  # downsampled selection inputs
    assert 11_000_000 < sum(p.numel() for p in m.parameters()) < 11_300_000
    assert any(isinstance(b, nn.BatchNorm2d) for b in m.modules())


def test_error_rate_counts_mistakes_and_restores_training_flags():
    model = small_cnn()
    model.train()
    model[1].eval()  # a deliberately frozen BatchNorm stays frozen
    x = torch.randn(10, 1, 28, 28)
    with torch.no_grad():
        model.eval()
        pred = model(x).argmax(1)
        model.train()
        model[1].eval()
    y = pred.clone()
    y[:3] = (y[:3] + 1) % 10
    assert error_rate(model, x, y, batch_size=4) == 0.3
    assert model.training and not model[1].training
    assert 0.0 <= error_rate(model, x, y, autocast=torch.bfloat16) <= 1.0


def test_error_rate_by_default_evaluates_in_the_devices_batch_size():
    """On a CPU the default is 128 examples a forward (1000 took 2.5x as long here), and the
    result does not depend on the batch size."""
    assert eval_batch_size("cpu") == 128 and eval_batch_size(torch.device("cpu")) == 128
    assert eval_batch_size("meta") == 1000
    seen = []
    model = nn.Linear(5, 3)
    model.register_forward_hook(lambda m, i, o: seen.append(len(i[0])))
    torch.manual_seed(1)
    x, y = torch.randn(300, 5), torch.randint(0, 3, (300,))
    err = error_rate(model, x, y)
    assert seen == [128, 128, 44]
    assert error_rate(model, x, y, batch_size=1000) == err


def test_error_rate_records_no_autograd_graph():
    """Evaluation runs under inference mode (a decorator moved to another function once left
    it recording the graph of every test batch: more time and memory for the same result)."""
    seen = []
    model = nn.Linear(5, 3)
    model.register_forward_hook(
        lambda m, i, o: seen.append((torch.is_inference_mode_enabled(), o.requires_grad))
    )
    error_rate(model, torch.randn(10, 5), torch.zeros(10, dtype=torch.long))
    assert seen == [(True, False)]


@pytest.mark.parametrize("shape", [(5,), (2, 7)], ids=["vectors", "sequences"])
def test_error_rate_of_models_whose_inputs_are_not_images(shape):
    """Only 4-D inputs (images) are laid out channels_last: vectors, and sequences of (channels,
    length), are evaluated as they are (channels_last refuses a 3-D tensor)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), 2))
    x, y = torch.randn(12, *shape), torch.randint(0, 2, (12,))
    expected = (model(x).argmax(1) != y).float().mean().item()
    assert error_rate(model, x, y) == pytest.approx(expected)


def test_error_rate_refuses_arguments_it_would_count_wrongly():
    """batch_size=-1 counted no batch and returned 0.0 error; one target broadcast against
    every prediction; no examples divided by zero."""
    model, x = small_cnn(), torch.randn(6, 1, 28, 28)
    y = torch.zeros(6, dtype=torch.long)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"should be >= 1, but got batch_size={bad}"):
            error_rate(model, x, y, batch_size=bad)
    with pytest.raises(ValueError, match="one target per input, but got 6 inputs and 1 targets"):
        error_rate(model, x, y[:1])
    with pytest.raises(ValueError, match="at least one example"):
        error_rate(model, x[:0], y[:0])


def test_error_rate_refuses_targets_outside_the_models_classes():
    """A model of another num_classes than the labels (labels up to 9, three outputs) was scored
    as making every such example a mistake: an error rate, not an error."""
    model, x = mlp(num_classes=3, in_features=4, hidden=8), torch.randn(6, 4)
    for y, shown in ((torch.tensor([0, 1, 2, 9, 0, 1]), "0 to 9"), (-torch.ones(6).long(), "-1")):
        with pytest.raises(ValueError, match=rf"class indices in \[0, 3\) .* range from {shown}"):
            error_rate(model, x, y)
    with pytest.raises(ValueError, match=r"targets of shape \(6, 3\)"):
        error_rate(model, x, torch.eye(3)[[0, 1, 2, 0, 1, 2]])  # one-hot rows


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((float("nan"), 1.0, 10), "base_lr should be finite"),
        ((-0.1, 1.0, 10), r"base_lr should be >= 0"),
        ((0.1, float("nan"), 10), "position should be finite"),
        (("0.1", 1.0, 10), "base_lr should be a number"),
    ],
)
def test_cosine_lr_refuses_a_rate_or_position_that_is_no_number(args, match):
    """A NaN position or base_lr gave a NaN rate, which an optimizer takes, unsaid."""
    with pytest.raises((ValueError, TypeError), match=match):
        cosine_lr(*args)


@pytest.mark.parametrize("make", [mlp, small_cnn, resnet18])
@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_the_reference_models_refuse_sizes_that_are_no_positive_int(make, bad):
    """num_classes=0 built a classifier of no outputs and True one of one output, unsaid."""
    match = rf"num_classes should be .*num_classes={bad}"
    with pytest.raises((ValueError, TypeError), match=match):
        make(num_classes=bad)
    other = "in_features" if make is mlp else "in_channels"
    with pytest.raises((ValueError, TypeError), match=rf"{other} should be"):
        make(**{other: bad})


@pytest.mark.parametrize("total", [0, -10.0, float("nan")])
def test_cosine_lr_refuses_a_total_that_is_not_positive(total):
    """total=0 divided by zero, and a negative total gave base_lr at every position."""
    with pytest.raises(ValueError, match="total should"):
        cosine_lr(0.1, 5.0, total)


def test_cosine_lr_holds_base_lr_before_the_start_and_0_past_the_end():
    """Keyed on loader.progress, which can pass the planned total (a last pass that ends after
    it): the rate stays 0 there instead of rising again (to base_lr at twice the total), and
    is base_lr at any position before 0."""
    assert cosine_lr(0.1, 10.5, 10) == 0.0 and cosine_lr(0.1, 20.0, 10) == 0.0
    assert cosine_lr(0.1, -1.0, 10) == 0.1


def test_the_reference_models_are_the_documented_architectures():
    """The benchmarks' results are of these models (and a frozen prefix cuts small_cnn after
    its eighth module): mlp is 784-1024-1024-10 with a ReLU after each hidden layer; small_cnn
    conv32-BN-ReLU-pool, conv64-BN-ReLU-pool, fc128-ReLU, fc10; each residual block of
    resnet18 ends in a ReLU of its sum, so its output is never negative."""

    def kinds(model):
        return [type(m).__name__ for m in model]

    assert kinds(mlp()) == ["Flatten", "Linear", "ReLU", "Linear", "ReLU", "Linear"]
    assert [m.out_features for m in mlp() if isinstance(m, nn.Linear)] == [1024, 1024, 10]
    image = ["Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d"]
    assert kinds(small_cnn()) == [*image, *image, "Flatten", "Linear", "ReLU", "Linear"]
    torch.manual_seed(0)
    model, lowest = resnet18(num_classes=10, in_channels=1).eval(), []
    for block in model.modules():
        if isinstance(block, _BasicBlock):
            block.register_forward_hook(lambda m, i, o: lowest.append(float(o.min())))
    with torch.no_grad():
        model(torch.randn(2, 1, 16, 16))
    assert len(lowest) == 8 and min(lowest) >= 0.0


def test_benchmark_augmentation_shifts_and_flips_each_image_whole():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 2, 8, 8)
    out = augment(x, g, flip=True, pad=2)
    assert out.shape == x.shape
    padded = nn.functional.pad(x, (2,) * 4)
    flipped = nn.functional.pad(x.flip(3), (2,) * 4)
    for i in range(16):
        crops = [
            p[i, :, dy : dy + 8, dx : dx + 8]
            for p in (padded, flipped)
            for dy in range(5)
            for dx in range(5)
        ]
        assert any(torch.equal(out[i], c) for c in crops), i
    # Not the identity for every image, and reproducible from the generator.
    assert not torch.equal(out, x)
    again = augment(x, torch.Generator().manual_seed(0), flip=True, pad=2)
    assert torch.equal(out, again)
