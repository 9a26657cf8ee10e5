"""``planned_epochs`` with ``batches_per_epoch``: it counts training epochs of that many batches,
and the default policy plans (anneals the last eighth of) the passes over the data they make."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import EncodedDataset, IndexLoss
from torch.utils.data import DataLoader

from sbloader import SelectiveLoader, default_policy
from sbloader.policies import passes_within

N = 2048  # at 1/3 and batches of 64: 10.7 batches a selective pass, 32 an annealed one


def loader_for(**kw) -> SelectiveLoader:
    dl = DataLoader(
        EncodedDataset(N), batch_size=256, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    return SelectiveLoader(dl, IndexLoss(), batch_size=64, seed=0, **kw)


def measured(batch) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(IndexLoss()(x), y, reduction="none")


def train(loader: SelectiveLoader, epochs: int) -> list[list[int]]:
    """``epochs`` training epochs, each exactly ``len(loader)`` batches, with the training
    losses reported; the batches' dataset indices."""
    batches = []
    for _ in range(epochs):
        epoch = []
        for batch in loader:
            loader.feedback(batch.indices, measured(batch))
            epoch.append(batch.indices.tolist())
        assert len(epoch) == len(loader)
        batches += epoch
    return batches


def assert_anneal_completes(loader: SelectiveLoader, batches: list[list[int]]) -> None:
    """The planned passes all ended within the run, the last of them on all the data, every
    example yielded from its start to the run's end; the passes before it kept about 1/3."""
    passes = loader.planned_passes
    assert passes is not None and loader.policy.anneal_from_epoch == passes - 1
    assert loader.progress >= passes and loader.epoch >= passes - 1
    e = loader.stats.epochs
    last = e[passes - 1]
    assert last.target_rate == 1.0 and last.examples_selected == last.examples_seen == N
    start = sum(x.batches_yielded for x in e[: passes - 1])
    assert {i for b in batches[start:] for i in b} == set(range(N))
    assert all(0.2 < x.examples_selected / x.examples_seen < 0.5 for x in e[: passes - 1])


def test_planned_epochs_count_training_epochs_of_the_expected_length():
    """8 training epochs of "expected" (11) batches: 5 passes at 1/3 and one annealed pass of
    about 3 training epochs (85 of the 88 batches expected), so the anneal completes within
    the 8 epochs (planned as 8 passes, the run ended 62% into its only annealed pass)."""
    loader = loader_for(planned_epochs=8, batches_per_epoch="expected")
    assert len(loader) == 11 and loader.planned_epochs == 8 and loader.planned_passes == 6
    assert loader.policy.anneal_from_epoch == 5
    batches = train(loader, 8)
    assert_anneal_completes(loader, batches)
    assert loader.training_epoch == 8


def test_the_batches_after_the_planned_passes_train_on_all_the_data_too():
    """What the docs say of the batches left after the last planned pass (part of one more
    pass): they are full batches drawn with P = 1 from that pass, like the annealed pass's."""
    loader = loader_for(planned_epochs=8, batches_per_epoch="expected")
    passes = loader.planned_passes
    kept_all = []
    for _ in range(8):
        for batch in loader:
            loader.feedback(batch.indices, measured(batch))
            kept_all.append((loader.epoch, bool((batch.probabilities == 1).all())))
    assert loader.epoch == passes  # the run went on into one more pass
    after = [full for epoch, full in kept_all if epoch >= passes]
    assert len(after) == sum(1 for epoch, _ in kept_all if epoch == passes) > 0
    assert all(after)
    assert loader.stats.epochs[passes].target_rate == 1.0


def test_planned_epochs_count_training_epochs_of_an_int_length():
    """4 training epochs of 20 batches (80): 4 passes at 1/3 and one annealed, 74.7 expected."""
    loader = loader_for(planned_epochs=4, batches_per_epoch=20)
    assert loader.planned_passes == 5 and loader.policy.anneal_from_epoch == 4
    assert_anneal_completes(loader, train(loader, 4))


def test_too_short_a_run_for_the_anneal_warns_with_the_fix():
    """3 training epochs of 11 batches (33) cannot hold the warm-up pass and an annealed one
    (42.7): two passes are planned, and the warning names the planned_epochs that hold a
    selective pass between them (53.3 batches: 5 epochs)."""
    with pytest.warns(UserWarning, match=r"planned_epochs=3 .*batches_per_epoch=11") as w:
        loader = loader_for(planned_epochs=3, batches_per_epoch="expected")
    assert "planned_epochs=5" in str(w[0].message)
    assert loader.planned_passes == 2 and loader.policy.anneal_from_epoch == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loader_for(planned_epochs=5, batches_per_epoch="expected").planned_passes == 3


def test_a_plan_of_two_passes_warns_that_nothing_is_selected():
    """4 training epochs of 11 batches (44) fit the warm-up pass and the annealed one (42.7)
    but no selective pass between them: the policy never selects by loss, which is warned of
    (as planned_epochs=2 without batches_per_epoch), naming the fix."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = loader_for(planned_epochs=4, batches_per_epoch="expected")
    assert loader.planned_passes == 2 and loader.policy.anneal_from_epoch == 1
    (warning,) = caught
    assert "make 2 passes over the data, which leave the default policy no selective pass" in (
        str(warning.message)
    )
    assert "planned_epochs=5" in str(warning.message)


def test_without_batches_per_epoch_planned_epochs_are_passes():
    loader = loader_for(planned_epochs=8)
    assert loader.planned_passes == 8 and loader.policy.anneal_from_epoch == 7
    assert loader_for(batches_per_epoch="expected").planned_passes is None
    assert loader_for(batches_per_epoch=11).policy.anneal_from_epoch is None
    explicit = loader_for(policy=default_policy(epochs=8), batches_per_epoch=11)
    assert explicit.planned_passes is None and explicit.policy.anneal_from_epoch == 7


def test_two_planned_passes_warn_that_nothing_is_selected():
    """planned_epochs=2 makes the default policy a warm-up epoch and an annealed one, no
    selective epoch: warned, naming the fix; 3 passes have one and do not warn."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        two = loader_for(planned_epochs=2)
    # once, by the loader's name for it (default_policy's own warning is not repeated)
    assert [str(w.message)[:55] for w in caught] == [
        "planned_epochs=2 leaves the default policy no selective"
    ]
    assert two.policy.anneal_from_epoch == 1 and two.policy.warmup_epochs == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        three = loader_for(planned_epochs=3)
    assert three.policy.anneal_from_epoch == 2


def test_passes_are_kept_where_the_data_size_is_unknown():
    """An int batches_per_epoch over a source of unknown size: the passes it makes cannot be
    estimated, so planned_epochs stays passes, with a warning naming the fix."""
    x = torch.randn(64, 6)
    batches = [(x[i : i + 16], torch.zeros(16, dtype=torch.long)) for i in range(0, 64, 16)]
    with pytest.warns(UserWarning, match="dataset_size="):
        loader = SelectiveLoader(
            batches, IndexLoss(), batch_size=8, planned_epochs=8, batches_per_epoch=2
        )
    assert loader.planned_passes == 8 and loader.policy.anneal_from_epoch == 7


def test_the_pure_count_matches_the_plan_it_fits():
    """passes_within: the largest P whose plan fits, by brute force over P."""
    for steady, full in ((2048 / 3 / 64, 32.0), (7.1, 21.3), (1.0, 9.0), (3.0, 3.0)):
        for budget in range(1, 400, 7):
            fits = []
            for p in range(2, 500):
                annealed = p - default_policy(epochs=p).anneal_from_epoch
                if (p - annealed) * steady + annealed * full <= budget:
                    fits.append(p)
            assert passes_within(budget, steady, full) == (max(fits) if fits else None)


def test_lightning_max_epochs_anneal_with_the_expected_length():
    """selective_loader passes the Trainer's max_epochs: with batches_per_epoch="expected", 8
    Lightning epochs of 7 batches (512 examples, batches of 24) plan 5 passes, and the last
    training epochs train on the annealed pass, which ends within the run."""
    pl = pytest.importorskip("lightning.pytorch")
    lightning_sb = pytest.importorskip("sbloader.integrations.lightning")
    from torch import nn

    n = 512

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
            self.trained: list[list[int]] = []

        def forward(self, x):
            return self.net(x)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            source = DataLoader(EncodedDataset(n), batch_size=64, shuffle=True, generator=g)
            return lightning_sb.selective_loader(
                self, source, batch_size=24, seed=0, batches_per_epoch="expected"
            )

        def training_step(self, batch, batch_idx):
            x, y, sb = batch
            self.trained.append(sb["indices"].tolist())
            return (torch.nn.functional.cross_entropy(self(x / n), y, reduction="none")).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Module()
    trainer = pl.Trainer(
        max_epochs=8,
        accelerator="cpu",
        devices=1,
        callbacks=[lightning_sb.SelectiveLoaderCallback()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module)
    loader = trainer.train_dataloader.loader
    assert loader.planned_epochs == 8 and len(loader) == 7 and loader.planned_passes == 5
    assert loader.policy.anneal_from_epoch == 4
    assert trainer.global_step == len(module.trained) == 8 * 7
    e = loader.stats.epochs
    assert loader.progress >= 5 and e[4].examples_selected == e[4].examples_seen == n
    assert all(x.examples_selected < 0.5 * n for x in e[:4])
    start = sum(x.batches_yielded for x in e[:4])  # the annealed pass's first batch
    assert start <= 6 * 7  # (at least) the last two Lightning epochs train on annealed passes
    assert {i for b in module.trained[start:] for i in b} == set(range(n))
