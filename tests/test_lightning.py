"""sbloader.integrations.lightning with the real Lightning on the CPU: the batches and their
selection results in training_step, and kill-and-resume equal to the uninterrupted run at an
end-of-epoch checkpoint and mid-epoch (where Lightning has fetched one batch ahead)."""

from __future__ import annotations

import doctest
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import checkout_env, run_python
from torch import nn
from torch.utils.data import DataLoader

from sbloader import Phased, RandomBackprop, SelectiveBackprop, SelectiveLoader, Traditional
from sbloader.datasets import ArrayDataset

pl = pytest.importorskip("lightning.pytorch")
lightning_sb = pytest.importorskip("sbloader.integrations.lightning")
SelectiveLoaderCallback = lightning_sb.SelectiveLoaderCallback
selective_loader = lightning_sb.selective_loader

ROOT = Path(__file__).resolve().parents[1]
N = 512


def data() -> ArrayDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 8, generator=g)
    y = (x[:, :4] + 0.5 * torch.randn(N, 4, generator=g)).argmax(1)
    return ArrayDataset(x, y)


def warmup_then_sb():
    return Phased(SelectiveBackprop(0.5), warmup_epochs=1, warmup_policy=RandomBackprop(0.5))


class Classifier(pl.LightningModule):
    """Records the dataset indices (and weights) of every batch handed to training_step."""

    def __init__(self, policy=warmup_then_sb, naive: bool = False, **options) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        self.policy, self.naive, self.options = policy, naive, options
        self.trained: list[list[int]] = []
        self.weights: list[torch.Tensor] = []

    def forward(self, x):
        return self.net(x)

    def train_dataloader(self):
        source = DataLoader(
            data(), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(1)
        )
        options = dict(policy=self.policy(), batch_size=24, seed=0, **self.options)
        if self.naive:  # what a user would write without the integration
            return SelectiveLoader(source, self, metadata_key="sb", **options)
        return selective_loader(self, source, **options)

    def training_step(self, batch, batch_idx):
        x, y, sb = batch
        self.trained.append(sb["indices"].tolist())
        self.weights.append(sb["weights"])
        return (F.cross_entropy(self(x), y, reduction="none") * sb["weights"]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


class Validated(Classifier):
    """A Classifier with a validation loop logging ``val_loss`` (for checkpoints on it)."""

    def val_dataloader(self):
        return DataLoader(data(), batch_size=128)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))


def trainer(epochs: int = 3, callbacks=(), naive: bool = False, **kwargs):
    extra = [] if naive else [SelectiveLoaderCallback()]
    return pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        callbacks=[*extra, *callbacks],
        logger=False,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def test_import_sbloader_does_not_import_lightning():
    code = "import sys, sbloader; assert 'lightning' not in sys.modules; print('ok')"
    out = run_python(code, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_fit_hands_training_step_full_batches_with_their_selection_results():
    module = Classifier()
    t = trainer(epochs=2)
    t.fit(module)
    loader = t.train_dataloader.loader
    assert loader.epoch == 2 and loader.metadata_key == "sb"
    assert all(len(i) == 24 for i in module.trained)
    assert len(module.trained) == sum(e.batches_yielded for e in loader.stats.epochs)
    assert t.global_step == len(module.trained)
    # Epoch 0 is the Random-Backprop warm-up: about half the examples, each at most once.
    first = [i for b in module.trained[: loader.stats.epochs[0].batches_yielded] for i in b]
    assert len(set(first)) == len(first) and 0.35 * N < len(first) < 0.65 * N
    assert all(torch.equal(w, torch.ones(24)) for w in module.weights)
    # Epoch 1 made selection passes over every example.
    assert loader.stats.epochs[1].selection_forwards > 0


def test_the_default_policy_anneals_in_the_last_eighth_of_max_epochs():
    """Without policy=, selective_loader passes the Trainer's max_epochs: the default recipe
    (Random-Backprop, then Stale-SB) trains on all the data in its last epoch of 8."""

    class DefaultPolicy(Classifier):
        def train_dataloader(self):
            source = DataLoader(data(), batch_size=64, shuffle=True)
            return selective_loader(self, source, batch_size=24, seed=0)

    t = trainer(epochs=8)
    t.fit(DefaultPolicy())
    loader = t.train_dataloader.loader
    assert loader.planned_epochs == 8 and loader.policy.anneal_from_epoch == 7
    assert loader.policy.policy.staleness == 3  # the store's Stale-SB: the source has indices
    e = loader.stats.epochs
    assert len(e) == 8 and e[-1].examples_selected == e[-1].examples_seen == N
    assert all(x.examples_selected < 0.75 * N for x in e[:-1])
    assert e[1].selection_forwards > 0 and e[0].selection_forwards == 0


def test_policy_none_passed_to_selective_loader_still_plans_the_default_recipe():
    """policy=None (a config's default) is the default policy, as without policy=: it got no
    planned_epochs from max_epochs, and never annealed, unsaid."""
    module = Classifier()
    source = DataLoader(data(), batch_size=64)
    for options in ({}, {"policy": None}, {"planned_epochs": None}):
        module.trainer = trainer(epochs=8)
        loader = selective_loader(module, source, batch_size=24, **options).loader
        assert loader.planned_epochs == 8 and loader.policy.anneal_from_epoch == 7


def test_a_metadata_key_passed_to_selective_loader_is_the_loaders():
    """metadata_key="sb" is only the default: another key carries the results under it, and
    None yields the source's two fields with the results as attributes only."""
    module = Classifier()
    source = DataLoader(data(), batch_size=64)
    for key, fields in (("meta", 3), (None, 2)):
        module.trainer = trainer(epochs=1)
        wrapped = selective_loader(
            module, source, policy=Traditional(), batch_size=16, metadata_key=key
        )
        batch = next(iter(wrapped))
        assert len(batch) == fields and batch.indices.tolist() == list(range(16))
        if key is not None:
            assert torch.equal(batch[2]["indices"], batch.indices)


def test_max_epochs_plans_the_default_recipe_from_two_epochs_on():
    """The Trainer's max_epochs becomes planned_epochs from 2 on (1 or unbounded: none)."""
    module = Classifier()
    source = DataLoader(data(), batch_size=64)
    for epochs, planned in [(1, None), (-1, None), (2, 2), (8, 8)]:
        module.trainer = trainer(epochs=epochs)
        assert selective_loader(module, source, batch_size=24).loader.planned_epochs == planned


class RecordingRates(Classifier):
    """The default policy as selective_loader plans it (``options`` passed on: e.g.
    ``planned_epochs``, ``batches_per_epoch``), recording each step's target rate (1.0 in the
    annealed passes)."""

    def __init__(self, **options):
        super().__init__()
        self.options, self.rates = options, []

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        source = DataLoader(data(), batch_size=64, shuffle=True, generator=g)
        return selective_loader(self, source, batch_size=8, seed=0, **self.options)

    def training_step(self, batch, batch_idx):
        self.rates.append(self.trainer.train_dataloader.loader.policy.target_rate)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("cut", [dict(limit_train_batches=0.5), dict(max_steps=150)])
def test_a_run_shorter_than_max_epochs_of_len_batches_warns_and_its_fix_anneals(cut):
    """With batches_per_epoch, planned_epochs=max_epochs plans the default recipe's anneal for
    max_epochs epochs of len(loader) batches; a Trainer that trains on fewer
    (limit_train_batches, max_steps) ended before the annealed pass, unsaid. It warns, naming
    the planned_epochs that fits, and with it the run ends on all the data."""

    with pytest.warns(UserWarning, match="planned_epochs=") as caught:
        module = RecordingRates(batches_per_epoch="expected")
        trainer(epochs=16, **cut).fit(module)  # 21 batches an epoch: 336 planned, 160 or 150 run
    assert module.rates and 1.0 not in module.rates  # the run never reached its anneal
    message = next(str(w.message) for w in caught if "Trainer trains" in str(w.message))
    fits = int(message.split("pass planned_epochs=")[1].split(" ")[0])
    assert fits == (160 if "limit_train_batches" in cut else 150) // 21
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "the Trainer trains", UserWarning)
        fixed = RecordingRates(batches_per_epoch="expected", planned_epochs=fits)
        trainer(epochs=16, **cut).fit(fixed)
    assert fixed.rates[-1] == 1.0  # annealed by the end


def test_max_steps_before_the_anneal_without_batches_per_epoch_warns_and_its_fix_anneals():
    """Without batches_per_epoch, planned_epochs=max_epochs plans the default recipe's anneal
    for max_epochs passes over the data; a max_steps that comes first ended the run before the
    annealed passes, unsaid (limit_train_batches alone still reaches them). It warns, naming
    the planned_epochs that fits, and with it the run ends on all the data."""

    # 512 examples in batches of 8: about 21.3 batches a pass at 1/3, 64 on all the data; 16
    # passes planned (2 annealed): about 427 batches, of which max_steps=150 trains on 150
    with pytest.warns(UserWarning, match="max_steps=150") as caught:
        module = RecordingRates()
        trainer(epochs=16, max_steps=150).fit(module)
    assert module.rates and 1.0 not in module.rates  # the run never reached its anneal
    message = next(str(w.message) for w in caught if "max_steps=150" in str(w.message))
    fits = int(message.split("pass planned_epochs=")[1].split(" ")[0])
    assert fits == 5  # 4 passes at 1/3 and one annealed: about 149 batches
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "the Trainer stops", UserWarning)
        fixed = RecordingRates(planned_epochs=fits)
        trainer(epochs=16, max_steps=150).fit(fixed)
        unbounded = RecordingRates()
        trainer(epochs=3, max_steps=1000).fit(unbounded)  # (max_steps past the plan: silent)
    assert fixed.rates[-1] == 1.0  # annealed by the end


def test_max_steps_the_epochs_do_not_reach_without_a_length_warns_and_its_fix_counts():
    """Without len() Lightning estimates a run as max_steps whatever max_epochs says (with a
    length it takes the smaller), so a schedule sized by estimated_stepping_batches was cut
    short where the epochs ended first, unsaid. It warns, saying how many steps the epochs are
    expected to make; with batches_per_epoch="expected" the estimate is the run's steps."""
    # 512 examples, SB keeping a half in batches of 24: about 10.7 batches a pass, 32 in 3
    with pytest.warns(UserWarning, match=r"max_steps=40 .* about 32 optimizer steps"):
        t = trainer(epochs=3, max_steps=40)
        module = Classifier()
        t.fit(module)
    assert t.estimated_stepping_batches == 40
    assert 24 <= t.global_step < 40  # the epochs did end the run first

    with warnings.catch_warnings():
        warnings.filterwarnings("error", "Trainer.estimated_stepping_batches", UserWarning)
        counted = trainer(epochs=3, max_steps=40)
        counted.fit(Classifier(batches_per_epoch="expected"))
        assert counted.estimated_stepping_batches == counted.global_step == 33
        reached = trainer(epochs=3, max_steps=20)  # (the epochs reach it: silent)
        reached.fit(Classifier())
        assert reached.global_step == 20


class Reporting(Classifier):
    """Reports each step's per-example losses, as the README's loop does."""

    def __init__(self) -> None:
        super().__init__(policy=lambda: SelectiveBackprop(0.5, staleness=2))
        self.reported: dict[int, float] = {}

    def training_step(self, batch, batch_idx):
        x, y, sb = batch
        losses = F.cross_entropy(self(x), y, reduction="none")
        self.trainer.train_dataloader.feedback(sb["indices"], losses)
        self.reported.update(zip(sb["indices"].tolist(), losses.tolist()))
        return losses.mean()


def test_training_step_reports_its_losses_through_the_train_dataloader():
    """``self.trainer.train_dataloader`` is the LightningLoader, which had no ``feedback``:
    training_step could not report its losses (AttributeError) but through ``.loader``."""
    module = Reporting()
    t = trainer(epochs=1)
    t.fit(module)
    loader = t.train_dataloader.loader
    stats = loader.stats.epochs[0]
    assert stats.feedback == stats.examples_yielded == len(module.reported) > 0
    next(iter(loader))  # the reports reach the store as the next epoch starts
    idx = sorted(module.reported)
    stored, _ = loader.policy.store.lookup(np.array(idx))
    np.testing.assert_allclose(stored, [module.reported[i] for i in idx], rtol=1e-6)


def test_without_the_callback_the_fix_is_named():
    with pytest.raises(ValueError, match=r"Trainer\(callbacks=\[SelectiveLoaderCallback\(\)\]\)"):
        trainer(epochs=1, naive=True).fit(Classifier())


def test_a_loader_built_before_fit_names_train_dataloader():
    """selective_loader called before fit (to pass as train_dataloaders=) met Lightning's own
    "not attached to a Trainer" error, which names no fix; it says where to build it."""
    with pytest.raises(
        RuntimeError,
        match=r"not attached to one yet; call it inside the "
        r"module's train_dataloader",
    ):
        selective_loader(Classifier(), DataLoader(data(), batch_size=64), batch_size=24)


def test_a_lightning_loader_around_no_selective_loader_is_refused():
    """LightningLoader(DataLoader) was taken and failed at the first batch on a missing
    attribute; like AcceleratedLoader, it names what to pass as it is built."""
    with pytest.raises(
        TypeError,
        match=r"LightningLoader wraps a sbloader.SelectiveLoader, .*"
        r"DataLoader; return selective_loader\(self, source",
    ):
        lightning_sb.LightningLoader(DataLoader(list(range(4))))


def test_the_callback_may_come_from_configure_callbacks():
    class SelfContained(Classifier):
        def configure_callbacks(self):
            return [SelectiveLoaderCallback()]

    module = SelfContained()
    t = trainer(epochs=1, naive=True)  # no callback in the Trainer's list
    t.fit(module)
    assert module.trained and t.train_dataloader.loader.epoch == 1


class FromDataModule(Classifier):
    """A module whose data comes from a LightningDataModule."""

    def train_dataloader(self):
        raise AssertionError("the DataModule's train_dataloader is used")


class Data(pl.LightningDataModule):
    def __init__(self, right: bool) -> None:
        super().__init__()
        self.right = right

    def train_dataloader(self):
        source = DataLoader(
            data(), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(1)
        )
        scored = self.trainer.lightning_module if self.right else self
        return selective_loader(scored, source, policy=warmup_then_sb(), batch_size=24, seed=0)


def test_a_datamodule_passes_the_trainers_module_and_is_told_so():
    """selective_loader(self, ...) from a LightningDataModule's train_dataloader failed with
    "'Data' object has no attribute 'training_step'"; it is refused naming the fix, and the fix
    (the Trainer's LightningModule) trains."""
    with pytest.raises(TypeError, match=r"module should be the LightningModule.*self\.trainer\."):
        trainer(epochs=1).fit(FromDataModule(), datamodule=Data(right=False))
    module = FromDataModule()
    trainer(epochs=2).fit(module, datamodule=Data(right=True))
    assert module.trained and all(len(b) == 24 for b in module.trained)


def test_training_step_with_dataloader_iter_is_refused():
    class Iterating(Classifier):
        def training_step(self, dataloader_iter):
            return super().training_step(next(dataloader_iter)[0], 0)

    with pytest.raises(ValueError, match=r"training_step\(self, batch, batch_idx\)"):
        trainer(epochs=1).fit(Iterating())


class SelectedEvaluation(Validated):
    """Returns the training loader's selective_loader from val_dataloader and
    predict_dataloader too, as a user copying train_dataloader might."""

    def val_dataloader(self):
        return self.train_dataloader()

    def predict_dataloader(self):
        return self.train_dataloader()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))


@pytest.mark.parametrize("stage", ["validate", "predict"])
def test_a_selective_loader_for_validation_or_prediction_is_refused_naming_train_dataloader(
    stage,
):
    """One from val_dataloader was taken: validation saw only the examples the policy selected,
    and the callback attached it in the training loader's place (it went on from that loader's
    state, and checkpoints saved its state instead), unsaid."""
    module, t = SelectedEvaluation(), trainer(epochs=1)
    with pytest.raises(
        ValueError,
        match=rf"the Trainer is in its '{stage}' stage .*return it from train_dataloader only, "
        r"and a plain DataLoader from the others",
    ):
        t.fit(module) if stage == "validate" else t.predict(module)
    assert not module.trained  # (refused as Lightning sets up its loaders, before training)


def checkpoints(tmp_path: Path, every: int):
    steps = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "steps", every_n_train_steps=every, save_top_k=-1, filename="{step}"
    )
    epochs = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "epochs", every_n_epochs=1, save_top_k=-1, filename="{epoch}-{step}"
    )
    return steps, epochs


def resumed(path: Path, naive: bool = False, policy=warmup_then_sb, **kwargs) -> list[list[int]]:
    """The batches a run resumed from ``path`` trains on."""
    module = Classifier(policy=policy, naive=naive)
    trainer(naive=naive, **kwargs).fit(module, ckpt_path=path)
    return module.trained


def step_of(path: Path) -> int:
    return int(torch.load(path, weights_only=False)["global_step"])


def reference_run(tmp: Path, naive: bool = False):
    """An uninterrupted 3-epoch run that saves a checkpoint every 7 steps and at each epoch end
    (saving does not change what is trained: the states are copies)."""
    module = Classifier(naive=naive)
    t = trainer(callbacks=checkpoints(tmp, every=7), naive=naive)
    t.fit(module)
    loader = t.train_dataloader if naive else t.train_dataloader.loader
    return tmp, module.trained, loader


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory.mktemp("reference"))


def end_of_epoch_checkpoint(tmp: Path, loader) -> Path:
    path = tmp / "epochs" / f"epoch=0-step={loader.stats.epochs[0].batches_yielded}.ckpt"
    assert path.exists(), sorted(p.name for p in (tmp / "epochs").iterdir())
    return path


def test_resume_from_an_end_of_epoch_checkpoint_equals_the_uninterrupted_run(reference):
    """Lightning restores a loader only mid-epoch: without the callback the loader restarted at
    epoch 0 (the warm-up again) and lost its carried examples."""
    tmp, trained, loader = reference
    assert loader.stats.epochs[0].examples_yielded % 24 == 0
    path = end_of_epoch_checkpoint(tmp, loader)
    step = step_of(path)
    after = resumed(path)
    assert trained[:step] + after == trained
    # The carried examples: epoch 0 selected more than it yielded, and they came back.
    assert loader.stats.epochs[0].examples_selected > loader.stats.epochs[0].examples_yielded


def mid_epoch_checkpoint(tmp: Path, loader) -> Path:
    """A checkpoint of the reference run inside epoch 1 (the first selective epoch)."""
    first = loader.stats.epochs[0].batches_yielded
    second = first + loader.stats.epochs[1].batches_yielded
    step = next(s for s in range(first + 2, second - 1) if s % 7 == 0)
    return tmp / "steps" / f"step={step}.ckpt"


def test_resume_mid_epoch_equals_the_uninterrupted_run(reference):
    """Lightning fetches one batch ahead, so the loader's own state at a mid-epoch checkpoint is
    one batch past what was trained: the callback saves the state that batch was handed out
    from, and the resumed run hands it out again."""
    tmp, trained, loader = reference
    path = mid_epoch_checkpoint(tmp, loader)
    step = step_of(path)
    after = resumed(path)
    assert trained[:step] + after == trained


@pytest.mark.parametrize("where", ["end of epoch", "mid-epoch"])
def test_the_naive_integration_fails_this_comparison(tmp_path, where):
    """The loader returned directly from train_dataloader, left to Lightning's own state
    handling: the comparison above catches both of its failures."""
    tmp, trained, loader = reference_run(tmp_path, naive=True)
    if where == "mid-epoch":
        path = mid_epoch_checkpoint(tmp, loader)
    else:
        path = end_of_epoch_checkpoint(tmp, loader)
    after = resumed(path, naive=True)
    assert trained[: step_of(path)] + after != trained


@pytest.mark.parametrize("where", ["end of epoch", "mid-epoch"])
def test_resume_when_lightning_stops_by_count(tmp_path, where):
    """A loader with a len() (here Traditional's) is not fetched ahead: Lightning stops after
    len() batches without the loader seeing its epoch end; the callback ends it."""
    module = Classifier(policy=Traditional)
    t = trainer(callbacks=checkpoints(tmp_path, every=5))
    t.fit(module)
    per_epoch = -(-N // 24)  # re-batched to batch_size=24: 21 full batches and one of 8
    assert len(t.train_dataloader) == per_epoch
    assert len(module.trained) == 3 * per_epoch and t.train_dataloader.loader.epoch == 3
    if where == "mid-epoch":
        path = tmp_path / "steps" / "step=10.ckpt"
    else:
        path = tmp_path / "epochs" / f"epoch=0-step={per_epoch}.ckpt"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        after = resumed(path, policy=Traditional)
    assert module.trained[: step_of(path)] + after == module.trained
    # Lightning sees a resumable loader (mid-epoch, it warns about a sized loader without
    # state_dict that it is not).
    assert not [w for w in caught if "not resumable" in str(w.message)]


def test_an_epoch_stopped_by_count_ends_as_a_plain_loop_ends_it():
    """Lightning stops after len() batches without asking for the end of the epoch; the
    callback ends it as a plain loop's next() would. Abandoning it instead left the source's
    sampler unexhausted (a torch RandomSampler draws from its generator again at its end), so
    every later epoch's order differed from the plain loop's."""

    def source():
        g = torch.Generator().manual_seed(1)
        return DataLoader(data(), batch_size=64, shuffle=True, generator=g)

    class WholeBatches(Classifier):  # the last batch is full: yielded before the source ends
        def train_dataloader(self):
            return selective_loader(self, source(), policy=Traditional(), batch_size=32, seed=0)

    module = WholeBatches()
    t = trainer(epochs=3)
    t.fit(module)
    assert len(t.train_dataloader) == N // 32
    loader = SelectiveLoader(source(), nn.Linear(8, 4), policy=Traditional(), batch_size=32)
    assert module.trained == [b.indices.tolist() for _ in range(3) for b in loader]


def test_resume_after_an_epoch_cut_short_by_limit_train_batches(tmp_path):
    """limit_train_batches ends Lightning's epoch early: the loader's epoch is abandoned, and a
    checkpoint saved then resumes at the next epoch, as the uninterrupted run goes on."""
    module = Classifier()
    t = trainer(callbacks=checkpoints(tmp_path, every=1000), limit_train_batches=5)
    t.fit(module)
    loader = t.train_dataloader.loader
    assert len(module.trained) == 15 and loader.epoch == 3  # each epoch ended after 5 batches
    assert not loader.state_dict()["active"]  # so a state saved now starts the next one
    path = tmp_path / "epochs" / "epoch=0-step=5.ckpt"
    after = resumed(path, limit_train_batches=5)
    assert module.trained[:5] + after == module.trained


class StatefulClassifier(Classifier):
    """The same over torchdata's StatefulDataLoader (a source with its own state)."""

    def train_dataloader(self):
        tdl = pytest.importorskip("torchdata.stateful_dataloader")
        sampler = pytest.importorskip("torchdata.stateful_dataloader.sampler")
        ds = data()
        source = tdl.StatefulDataLoader(
            ds,
            batch_size=64,
            sampler=sampler.RandomSampler(ds, generator=torch.Generator().manual_seed(1)),
        )
        return selective_loader(self, source, policy=self.policy(), batch_size=24, seed=0)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_a_stateful_source_resumes_after_an_epoch_cut_short_with_a_new_pass(tmp_path):
    """With a source that keeps its own state, a checkpoint after an epoch that
    limit_train_batches cut short resumes with the next epoch's new pass over the data, not
    the rest of the pass left part-way (which loses examples silently)."""
    module = StatefulClassifier(policy=Traditional)
    trainer(callbacks=checkpoints(tmp_path, every=1000), limit_train_batches=2).fit(module)
    assert len(module.trained) == 6
    again = StatefulClassifier(policy=Traditional)
    path = tmp_path / "epochs" / "epoch=0-step=2.ckpt"
    trainer(limit_train_batches=2).fit(again, ckpt_path=path)
    assert again.trained == module.trained[2:]


def test_estimated_stepping_batches_is_epochs_times_len():
    module = Classifier(batches_per_epoch="expected")
    t = trainer(epochs=3)
    t.fit(module)
    loader = t.train_dataloader
    assert t.estimated_stepping_batches == 3 * len(loader) > 0
    assert len(module.trained) == 3 * len(loader)


@pytest.mark.parametrize("where", ["end of epoch", "mid-epoch"])
def test_resume_with_batches_per_epoch_equals_the_uninterrupted_run(tmp_path, where):
    """Fixed-length training epochs (what estimated_stepping_batches needs): Lightning stops by
    count, and the batch it fetched ahead is taken back from the training-epoch clock too."""
    module = Classifier(batches_per_epoch="expected")
    t = trainer(callbacks=checkpoints(tmp_path, every=5))
    t.fit(module)
    per_epoch = len(t.train_dataloader)
    assert len(module.trained) == 3 * per_epoch
    if where == "mid-epoch":
        step = next(s for s in range(per_epoch + 1, 2 * per_epoch) if s % 5 == 0)
        path = tmp_path / "steps" / f"step={step}.ckpt"
    else:
        path = tmp_path / "epochs" / f"epoch=0-step={per_epoch}.ckpt"
    again = Classifier(batches_per_epoch="expected")
    trainer().fit(again, ckpt_path=path)
    assert module.trained[: step_of(path)] + again.trained == module.trained


def test_module_docstring_example_runs():
    result = doctest.testmod(lightning_sb, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def have_fashion_mnist() -> bool:
    from sbloader.datasets import load_fashion_mnist

    try:
        load_fashion_mnist("test")
    except FileNotFoundError:
        return False
    return True


needs_data = pytest.mark.skipif(not have_fashion_mnist(), reason="needs dataset-fashion-mnist")


def run_example(*args: str, timeout: int = 300) -> str:
    cmd = [sys.executable, str(ROOT / "examples" / "lightning_fashion_mnist.py"), *args]
    # This checkout's sbloader, also in the process Lightning starts for rank 1.
    env = checkout_env()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


@pytest.mark.realdata
@needs_data
def test_the_example_runs():
    out = run_example("--epochs", "2", "--examples", "512", "--test-examples", "200")
    assert "epoch 0: seen 512, selection forwards 0" in out  # the Random-Backprop warm-up
    assert "epoch 1: seen 512, selection forwards 512" in out
    assert "test error" in out


@pytest.mark.slow
@pytest.mark.realdata
@needs_data
def test_ddp_two_processes_step_together_split_the_data_and_resume_exactly(tmp_path):
    """Lightning's DDP on the CPU (gloo), two processes started by Lightning itself: both ranks
    make the same number of steps, no example is trained on twice in an epoch (each rank
    trains only its own shard; remainder="drop"), and a run resumed from the end-of-epoch
    checkpoint trains each rank on what the uninterrupted run did (every rank's loader state
    is in the checkpoint)."""
    common = ["--epochs", "2", "--examples", "2048", "--test-examples", "200", "--devices", "2"]
    common += ["--remainder", "drop"]
    full, again = tmp_path / "full", tmp_path / "resumed"
    full.mkdir(), again.mkdir()
    run_example(*common, "--record", str(full), "--ckpt-dir", str(tmp_path / "ckpt"), timeout=600)
    ranks = [json.loads((full / f"rank{r}.json").read_text()) for r in range(2)]
    assert len(ranks[0]["steps"]) == len(ranks[1]["steps"]) > 0
    for epoch in range(2):
        per_rank = [
            [i for s in r["steps"] if s["epoch"] == epoch for i in s["indices"]] for r in ranks
        ]
        assert len(per_rank[0]) == len(per_rank[1]) > 0
        both = per_rank[0] + per_rank[1]
        assert len(set(both)) == len(both)  # 2048 examples split evenly: no padding
        for r, trained in zip(ranks, per_rank):
            assert set(trained) <= set(r["shards"][epoch])
    (ckpt,) = (tmp_path / "ckpt").glob("epoch=0-*.ckpt")
    run_example(*common, "--record", str(again), "--resume", str(ckpt), timeout=600)
    for r in range(2):
        resumed = json.loads((again / f"rank{r}.json").read_text())["steps"]
        assert resumed == [s for s in ranks[r]["steps"] if s["epoch"] == 1]


@pytest.mark.parametrize(
    "kwargs",
    [dict(options=dict(batches_per_epoch="expected")), dict(limit_train_batches=10)],
    ids=["batches_per_epoch", "limit_train_batches"],
)
def test_resume_from_a_step_checkpoint_on_the_last_batch_of_an_epoch(tmp_path, kwargs):
    """An epoch that Lightning stops by count (len() or limit_train_batches) ends after its last
    batch's on_train_batch_end, where ModelCheckpoint(every_n_train_steps=...) saves: the state
    saved there must be the ended epoch's (Lightning resumes such a checkpoint at the next
    epoch), not one in which the loader's epoch still has to end (the resumed run then got an
    empty epoch and lost a training epoch's batches)."""
    kwargs = dict(kwargs)
    options = kwargs.pop("options", {})
    first = Classifier(**options)
    trainer(epochs=1, **kwargs).fit(first)
    per_epoch = len(first.trained)
    module = Classifier(**options)
    t = trainer(callbacks=checkpoints(tmp_path, every=per_epoch), **kwargs)
    t.fit(module)
    assert len(module.trained) > 2 * per_epoch
    for step in (per_epoch, 2 * per_epoch):
        path = tmp_path / "steps" / f"step={step}.ckpt"
        again = Classifier(**options)
        trainer(**kwargs).fit(again, ckpt_path=path)
        assert module.trained[:step] + again.trained == module.trained, step


@pytest.mark.parametrize("options", [{}, dict(batches_per_epoch="expected")])
def test_reload_dataloaders_every_epoch_trains_what_one_loader_does(tmp_path, options):
    """With reload_dataloaders_every_n_epochs Lightning iterates each rebuilt loader twice
    before training on it, and the first iteration fetches a batch ahead: that batch is handed
    out again (it used to start a pass over the data and abandon it, so every reload skipped
    a source batch and counted an extra pass: a different run, its policy's epochs shifted)."""
    once = Classifier(**options)
    t = trainer(epochs=4)
    t.fit(once)
    reloaded = Classifier(**options)
    r = trainer(
        epochs=4, callbacks=checkpoints(tmp_path, every=5), reload_dataloaders_every_n_epochs=1
    )
    r.fit(reloaded)
    assert reloaded.trained == once.trained
    assert r.train_dataloader.loader.epoch == t.train_dataloader.loader.epoch
    for path in sorted(tmp_path.glob("*/*.ckpt")):  # every 5 steps and at epoch ends
        again = Classifier(**options)
        trainer(epochs=4, reload_dataloaders_every_n_epochs=1).fit(again, ckpt_path=path)
        assert once.trained[: step_of(path)] + again.trained == once.trained, path.name


def test_batches_fetched_before_any_training_are_handed_out_again_in_order():
    """Iterated again before training_step saw a batch (as Lightning does with a rebuilt
    loader), the batches fetched ahead come again, in the order they came, then the rest."""
    wrapped = lightning_sb.LightningLoader(
        SelectiveLoader(DataLoader(data(), batch_size=64), nn.Linear(8, 4), policy=Traditional())
    )
    first = iter(wrapped)
    ahead = [next(first).indices.tolist() for _ in range(3)]
    again = iter(wrapped)
    assert [next(again).indices.tolist() for _ in range(4)] == [*ahead, list(range(192, 256))]


def test_iterated_again_after_training_began_the_loader_starts_a_new_epoch():
    """Only batches fetched before any was trained are handed out again: iterated again once
    training_step has had a batch of the epoch, the loader starts a new epoch, from its first
    batch, as a plain loop does."""
    wrapped = lightning_sb.LightningLoader(
        SelectiveLoader(DataLoader(data(), batch_size=64), nn.Linear(8, 4), policy=Traditional())
    )
    first = iter(wrapped)
    fetched = [next(first).indices.tolist() for _ in range(3)]
    assert fetched[2] == list(range(128, 192))
    wrapped.trained = 2  # as the callback counts training_step's batches
    again = iter(wrapped)
    assert next(again).indices.tolist() == list(range(64))
    assert (wrapped.fetched, wrapped.trained) == (1, 0)


def test_resume_from_a_validation_checkpoint_on_the_last_batch_of_an_epoch(tmp_path):
    """ModelCheckpoint(monitor=...) saves when validation ends; at an epoch's last batch
    (val_check_interval) the loader's epoch has ended already, and the resumed run calls
    on_train_epoch_end for it after fetching the next epoch's first batch: that batch is
    handed out again in the next epoch (it used to be abandoned with a new pass, so the resumed
    run skipped it)."""

    def run(ckpt_path=None, callbacks=()):
        module = Validated()
        trainer(callbacks=callbacks, val_check_interval=2, check_val_every_n_epoch=None).fit(
            module, ckpt_path=ckpt_path
        )
        return module.trained

    on_validation = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path,
        monitor="val_loss",
        save_top_k=-1,
        filename="{step}",
        save_on_train_epoch_end=False,
    )
    trained = run(callbacks=[on_validation])
    first = Validated()
    trainer(epochs=1).fit(first)
    step = len(first.trained)  # the first epoch's last batch
    assert step % 2 == 0, "the test needs validation at the first epoch's last batch"
    assert trained[:step] + run(ckpt_path=tmp_path / f"step={step}.ckpt") == trained


def test_stale_sb_with_a_memory_mapped_store_resumes_exactly_from_an_earlier_checkpoint(tmp_path):
    """Stale-SB with ``store_path`` under Lightning's checkpointing (a checkpoint every 7 steps
    and at each epoch's end, all kept): resumed from a mid-run checkpoint after the run had gone
    on to its end (crash recovery), the same store folder gives the uninterrupted run's batches,
    as long as ``store_snapshots`` keeps that checkpoint's snapshot; a checkpoint whose snapshot
    was pruned is refused, naming ``store_snapshots``."""

    def stale(keep: int, store: Path):
        def policy():
            sb = SelectiveBackprop(0.5, staleness=2, store_path=str(store), store_snapshots=keep)
            return Phased(sb, warmup_epochs=1, warmup_policy=RandomBackprop(0.5))

        return policy

    def fit(keep: int, folder: Path):
        module = Classifier(policy=stale(keep, folder / "store"))
        t = trainer(epochs=4, callbacks=checkpoints(folder, every=7))
        t.fit(module)
        return module.trained, t.train_dataloader.loader

    trained, loader = fit(100, tmp_path / "all")
    first = loader.stats.epochs[0].batches_yielded + loader.stats.epochs[1].batches_yielded
    step = next(s for s in range(first + 2, len(trained)) if s % 7 == 0)  # in epoch 2
    assert loader.stats.epochs[2].selection_forwards == 0  # a stale epoch: from the store
    assert loader.stats.epochs[3].selection_forwards > 0  # whose losses a pass then rewrote
    path = tmp_path / "all" / "steps" / f"step={step}.ckpt"
    after = resumed(path, policy=stale(100, tmp_path / "all" / "store"), epochs=4)
    assert trained[:step] + after == trained

    # With two kept, that checkpoint's snapshot is gone by the run's end: refused, not resumed
    # from the files as the run left them.
    fit(2, tmp_path / "two")
    with pytest.raises(ValueError, match="store_snapshots"):
        resumed(
            tmp_path / "two" / "steps" / f"step={step}.ckpt",
            policy=stale(2, tmp_path / "two" / "store"),
            epochs=4,
        )


@pytest.mark.parametrize("policy", [Traditional, warmup_then_sb], ids=["traditional", "phased"])
@pytest.mark.parametrize("stop", ["limit_train_batches", "max_steps"])
def test_batches_per_epoch_with_an_epoch_cut_short(tmp_path, policy, stop):
    """batches_per_epoch with Lightning stopping a training epoch early: the epoch is abandoned
    after the batches Lightning took (the pass's own count, beyond len(), is not the epoch's),
    and a checkpoint saved then resumes as the uninterrupted run goes on."""
    kwargs = {"limit_train_batches": 3} if stop == "limit_train_batches" else {"max_steps": 13}
    module = Classifier(policy=policy, batches_per_epoch=5)
    t = trainer(callbacks=checkpoints(tmp_path, every=1000), **kwargs)
    t.fit(module)
    assert len(module.trained) == (9 if stop == "limit_train_batches" else 13)
    assert len(t.train_dataloader) == 5 < len(t.train_dataloader.loader.source)
    if stop == "limit_train_batches":
        again = Classifier(policy=policy, batches_per_epoch=5)
        trainer(**kwargs).fit(again, ckpt_path=tmp_path / "epochs" / "epoch=0-step=3.ckpt")
        assert module.trained[:3] + again.trained == module.trained


def test_under_ddp_a_source_that_does_not_split_the_data_is_refused_and_others_accepted(
    monkeypatch,
):
    """With several processes a DataLoader whose sampler gives every rank all the data is
    refused, naming DistributedSampler; a DistributedSampler, a batch sampler that splits by
    itself or holds no sampler to inspect, and an iterable dataset (which shards itself: a
    DataLoader refuses a sampler there) are accepted."""
    from torch.utils.data import DistributedSampler, IterableDataset

    monkeypatch.setattr(pl.Trainer, "world_size", property(lambda self: 2))
    module = Classifier()
    module.trainer = trainer(epochs=1)

    def build(source):
        return selective_loader(module, source, policy=Traditional(), batch_size=8)

    with pytest.raises(ValueError, match=r"2 processes.*\(RandomSampler\).*DistributedSampler"):
        build(DataLoader(data(), batch_size=8, shuffle=True))
    build(DataLoader(data(), batch_size=8, sampler=DistributedSampler(data(), 2, 0, seed=0)))

    class SplittingBatches:
        num_replicas = 2

        def __iter__(self):
            return iter([list(range(0, 16, 2))])

        def __len__(self):
            return 1

    build(DataLoader(data(), batch_sampler=SplittingBatches()))

    class OwnBatches:  # a batch sampler of the user's own, with no sampler to inspect
        def __iter__(self):
            return iter([list(range(1, 16, 2))])

        def __len__(self):
            return 1

    build(DataLoader(data(), batch_sampler=OwnBatches()))

    class Stream(IterableDataset):
        def __iter__(self):
            d = data()
            return iter((d[i][0], d[i][1], i) for i in range(0, 64, 2))

    build(DataLoader(Stream(), batch_size=8))


def test_a_checkpoint_of_another_number_of_processes_is_refused_and_kept_until_then():
    """The callback's restored state is saved again as it was while no loader is built, and
    a state of 2 processes is refused by a run of 1, naming the fix."""
    module = Classifier()
    saved = trainer(epochs=1)
    module.trainer = saved
    selective_loader(module, DataLoader(data(), batch_size=64), batch_size=24)
    state = saved.callbacks[0].state_dict()
    two = {**state, "ranks": state["ranks"] * 2}
    callback = SelectiveLoaderCallback()
    callback.load_state_dict(two)
    assert callback.state_dict() == two
    module.trainer = trainer(epochs=1, naive=True, callbacks=[callback])
    with pytest.raises(ValueError, match=r"states of 2 processes, but this run has 1; resume"):
        selective_loader(module, DataLoader(data(), batch_size=64), batch_size=24)


def test_a_mid_epoch_checkpoint_saved_without_the_callback_is_refused_naming_it(tmp_path):
    """Lightning restores a loader's state mid-epoch; a checkpoint saved without the callback
    holds none for it (the loader's own state, one batch ahead), and is refused."""
    steps = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1, filename="{step}"
    )
    trainer(epochs=1, callbacks=[steps], naive=True).fit(Classifier(naive=True))
    with pytest.raises(RuntimeError, match="holds no SelectiveLoaderCallback state"):
        trainer(epochs=1).fit(Classifier(), ckpt_path=tmp_path / "step=5.ckpt")


class EarlyBuilt(Classifier):
    """Reads estimated_stepping_batches in configure_optimizers (for OneCycleLR), which builds
    the training loader before Lightning restores its loops."""

    def configure_optimizers(self):
        assert self.trainer.estimated_stepping_batches > 0
        return super().configure_optimizers()


def one_snapshot(folder, keep=1):
    """Stale-SB after a warm-up over a store_path store that keeps one snapshot (or ``keep``)."""

    def policy():
        sb = SelectiveBackprop(0.5, staleness=2, store_path=str(folder), store_snapshots=keep)
        return Phased(sb, warmup_epochs=1, warmup_policy=RandomBackprop(0.5))

    return policy


@pytest.mark.parametrize(
    "kind", ["traditional", "phased", "one_snapshot"], ids=["traditional", "phased", "one_snapshot"]
)
@pytest.mark.parametrize("module", [Classifier, EarlyBuilt], ids=["built", "built_early"])
def test_a_run_stopped_by_max_steps_goes_on_with_the_rest_of_its_epoch(tmp_path, kind, module):
    """max_steps stops Lightning part-way through an epoch, and Lightning resumes such an epoch
    where it stopped (from the checkpoint saved then, or fit again with a larger max_steps):
    the loader's epoch goes on too, as in the uninterrupted run (it was abandoned, so the
    resumed run started a new pass there and never trained the rest of the old one); also
    where the loader is built before Lightning restores its loops (estimated_stepping_batches),
    which read them as not resuming the epoch (found by review; with max_epochs given, which
    estimated_stepping_batches then counts by the loader's batches). A store_path store that
    keeps one snapshot holds the one both states of the stop share (the second's snapshot
    removed the first's, and the resume was refused).
    """
    policy = {"traditional": Traditional, "phased": warmup_then_sb}.get(kind)
    policy = policy or one_snapshot(tmp_path / "store")
    epochs = None if module is Classifier else 10
    full = module(policy=policy)
    trainer(epochs=epochs, max_steps=40).fit(full)
    last = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    first = module(policy=policy)
    trainer(epochs=epochs, callbacks=[last], max_steps=30).fit(first)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["loops"]["fit_loop"]
    assert not saved["epoch_loop.batch_progress"]["is_last_batch"]  # stopped mid-epoch
    again = module(policy=policy)
    trainer(epochs=epochs, max_steps=40).fit(again, ckpt_path=tmp_path / "last.ckpt")
    assert first.trained + again.trained == full.trained
    twice = module(policy=policy)
    t = trainer(epochs=epochs, max_steps=30)
    t.fit(twice)
    t.fit_loop.epoch_loop.max_steps = 40
    t.fit(twice)
    assert twice.trained == full.trained


@pytest.mark.parametrize("stop, keep, resume", [(30, 1, 30), (35, 1, 30), (30, 2, 20), (35, 2, 20)])
def test_a_stop_removes_no_snapshot_of_a_checkpoint_still_on_disk(tmp_path, stop, keep, resume):
    """Checkpoints every 10 steps, a store_path store keeping the snapshots of its newest
    ``keep`` states, and max_steps stopping the run at a checkpoint's step or between two: the
    stop's own state shares the checkpoint's snapshot just taken, or removes none (found by
    review: it removed the oldest kept, so that with keep=1 the run's only checkpoint left on
    disk by save_top_k=1, or with keep=2 the second newest, was refused). The resumed run
    trains what the uninterrupted one did."""
    policy = one_snapshot(tmp_path / "store", keep=keep)
    full = Classifier(policy=policy)
    trainer(epochs=None, max_steps=40).fit(full)
    steps = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1, filename="{step}"
    )
    first = Classifier(policy=policy)
    trainer(epochs=None, callbacks=[steps], max_steps=stop).fit(first)
    assert len(first.trained) == stop
    again = Classifier(policy=policy)
    trainer(epochs=None, max_steps=40).fit(again, ckpt_path=tmp_path / f"step={resume}.ckpt")
    assert first.trained[:resume] + again.trained == full.trained


def test_stops_and_fits_again_keep_each_checkpoints_snapshot_and_no_other(tmp_path):
    """One policy (its store) over several fits of one Trainer, each stopped by max_steps:
    the stop's snapshot, which no checkpoint saved, takes no place among store_snapshots and
    goes at the next snapshot (found by review: kept, it removed step 30's, a checkpoint kept
    on disk, and the stops' piled up); one saved by save_last is kept as a checkpoint's. Each
    checkpoint left resumes as the uninterrupted run went on."""
    policy = one_snapshot(tmp_path / "store", keep=2)
    full = Classifier(policy=policy)
    trainer(epochs=None, max_steps=50).fit(full)
    shared = policy()
    first = Classifier(policy=lambda: shared)
    steps = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1, filename="{step}"
    )
    t = trainer(epochs=None, callbacks=[steps], max_steps=35)
    t.fit(first)
    t.fit_loop.epoch_loop.max_steps = 45
    t.fit(first)
    snapshots = tmp_path / "store" / "snapshots"
    assert len(list(snapshots.iterdir())) == 3  # steps 30 and 40, and the stop at 45's
    for resume in (40, 30):
        again = Classifier(policy=policy)
        trainer(epochs=None, max_steps=50).fit(again, ckpt_path=tmp_path / f"step={resume}.ckpt")
        assert first.trained[:resume] + again.trained == full.trained

    last = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "last", save_last=True, save_top_k=0)
    one = one_snapshot(tmp_path / "alone", keep=1)()
    staged = Classifier(policy=lambda: one)
    t = trainer(epochs=None, callbacks=[last], max_steps=7)
    for k in range(1, 5):
        t.fit_loop.epoch_loop.max_steps = 7 * k
        t.fit(staged)
        # last.ckpt's (Lightning saves it at the first stop only) and the newest stop's
        assert len(list((tmp_path / "alone" / "snapshots").iterdir())) == min(k, 2)
    step = torch.load(tmp_path / "last" / "last.ckpt", weights_only=False)["global_step"]
    again = Classifier(policy=one_snapshot(tmp_path / "alone", keep=1))
    trainer(epochs=None, max_steps=50).fit(again, ckpt_path=tmp_path / "last" / "last.ckpt")
    assert staged.trained[:step] + again.trained == full.trained


def test_a_state_taken_by_hand_between_a_stop_and_fit_again_keeps_the_stops_snapshot(tmp_path):
    """loader.state_dict() called by hand after a max_steps stop writes a snapshot of its own,
    which removed the stop's (found by review: fit again was then refused, naming the missing
    snapshot); it goes once fit again has loaded it."""
    policy = one_snapshot(tmp_path / "store", keep=1)
    full = Classifier(policy=policy)
    trainer(epochs=None, max_steps=40).fit(full)
    twice = Classifier(policy=policy)
    t = trainer(epochs=None, max_steps=30)
    t.fit(twice)
    by_hand = t.callbacks[0].loader.loader.state_dict()
    t.fit_loop.epoch_loop.max_steps = 40
    t.fit(twice)
    assert twice.trained == full.trained
    folder = tmp_path / "store" / "snapshots"
    stops = [*sorted(p.name for p in folder.iterdir())]
    # (fit again built another loader, whose store prunes its predecessor's at its first kept
    # snapshot: the stop at 30's and the one by hand, its own spared stop at 40's kept)
    assert len(stops) == 3 and stops[1] == by_hand["policy"]["policy"]["store"]["snapshot"]
    latest = t.callbacks[0].loader.loader.state_dict()["policy"]["policy"]["store"]["snapshot"]
    assert sorted(p.name for p in folder.iterdir()) == [stops[2], latest]


class StopsPartWay(Classifier):
    """With ``stop``, sets ``trainer.should_stop`` in its third step of epoch 1 (as ``max_time``
    and ``EarlyStopping`` do); Lightning has fetched the fourth batch ahead."""

    def __init__(self, stop: bool = False, **options) -> None:
        super().__init__(**options)
        self.stop = stop

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.stop and self.current_epoch == 1 and batch_idx == 2:
            self.trainer.should_stop = True
        return loss


@pytest.mark.parametrize("kind", ["traditional", "phased", "store_path"])
@pytest.mark.parametrize("saved", ["last", "after_fit"])
def test_a_run_stopped_part_way_goes_on_at_the_next_epoch_where_lightning_does(
    tmp_path, kind, saved
):
    """trainer.should_stop part-way through an epoch: Lightning resumes a checkpoint saved then
    (ModelCheckpoint's last, or trainer.save_checkpoint after fit) at the next epoch when the
    resumed Trainer has max_epochs alone, and so does the loader: its epochs are Lightning's to
    the end (it went on with the rest of the stopped pass, a pass behind them, unsaid). With
    Traditional, the batches are those of a loader whose epoch was left for good after the
    batch fetched ahead. (Resumed with max_steps, Lightning goes on with the stopped epoch, and
    so does the loader: the test of a run stopped by max_steps.) Both states of the stop share
    a store_path store's snapshot."""

    def stale_with_files():
        sb = SelectiveBackprop(0.5, staleness=2, store_path=str(tmp_path / "store"))
        return Phased(sb, warmup_epochs=1, warmup_policy=RandomBackprop(0.5))

    policy = {"traditional": Traditional, "phased": warmup_then_sb}.get(kind, stale_with_files)
    first = StopsPartWay(stop=True, policy=policy)
    t = trainer(
        epochs=4, callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)]
    )
    t.fit(first)
    path = tmp_path / "last.ckpt"
    if saved == "after_fit":
        path = tmp_path / "after.ckpt"
        t.save_checkpoint(path)
    again = StopsPartWay(policy=policy)
    resumed = trainer(epochs=4)
    resumed.fit(again, ckpt_path=path)
    loader = resumed.train_dataloader.loader
    assert t.current_epoch == 2 and loader.epoch == 4 == resumed.current_epoch
    assert [e.epoch for e in loader.stats.epochs][-2:] == [2, 3]
    assert all(e.examples_seen == N for e in loader.stats.epochs[-2:])  # whole passes
    if policy is Traditional:
        reference = Classifier(policy=policy, naive=True).train_dataloader()
        expected = [b.indices.tolist() for b in reference]
        it = iter(reference)
        expected += [next(it).indices.tolist() for _ in range(4)][:3]  # (the 4th fetched ahead)
        it.close(resumable=False)  # (as Lightning's cut epochs end)
        expected += [b.indices.tolist() for _ in range(2) for b in reference]
        assert first.trained + again.trained == expected


def test_a_callback_state_of_version_1_resumes_its_stopped_epoch_as_it_did():
    """A checkpoint of version 1 holds no next epoch's state: the stopped epoch is resumed."""
    module = Classifier()
    module.trainer = trainer(epochs=1)
    selective_loader(module, DataLoader(data(), batch_size=64), batch_size=24)
    state = module.trainer.callbacks[0].state_dict()
    assert state["version"] == 2 and state["next"] is None
    old = {"version": 1, "ranks": state["ranks"]}
    callback = SelectiveLoaderCallback()
    callback.load_state_dict(old)
    assert callback.state_dict() == {**state, "ranks": state["ranks"]}


@pytest.mark.parametrize("val_every, batches, warns", [(3, 8, True), (4, 8, False), (5, 5, False)])
def test_a_checkpoint_between_accumulated_steps_warns(tmp_path, val_every, batches, warns):
    """With accumulate_grad_batches, a checkpoint saved where the optimizer has not stepped
    (validation every 3 batches, accumulating 2) holds no accumulated gradients, so a run
    resumed from it differs: the callback warns, as AcceleratedLoader does; saving at every
    step (every 4 batches) does not, nor at an epoch's last batch (the 5th of 5), where
    Lightning steps whatever the count."""

    on_validation = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path, monitor="val_loss", save_top_k=-1, save_on_train_epoch_end=False
    )
    t = trainer(
        epochs=1,
        callbacks=[on_validation],
        accumulate_grad_batches=2,
        val_check_interval=val_every,
        check_val_every_n_epoch=None,
        limit_train_batches=batches,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(Validated())
    ours = [w for w in caught if "saved between optimizer steps" in str(w.message)]
    assert bool(ours) == warns
    if warns:
        assert "accumulate_grad_batches=2, 1 batches accumulated" in str(ours[0].message)


def test_a_step_checkpoint_at_the_last_batch_of_an_epoch_without_len_under_accumulation_warns(
    tmp_path,
):
    """Lightning resumes a checkpoint saved on an epoch's last batch (every_n_train_steps) of a
    loader without len() with the next epoch's batch_idx counted on from this epoch's, so where
    that epoch's batches are no multiple of accumulate_grad_batches its optimizer steps fall on
    other batches and the resumed run diverges, unsaid: the callback warns there (and at no
    other step checkpoint), naming batches_per_epoch."""
    steps = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}"
    )
    policy = lambda: SelectiveBackprop(0.5)  # noqa: E731  (its first epoch: 9 batches)
    module = Classifier(policy=policy)
    t = trainer(epochs=2, callbacks=[steps], accumulate_grad_batches=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(module)
    first = t.train_dataloader.loader.stats.epochs[0].batches_yielded
    assert first % 2  # (the first epoch's batches are odd: this run shows the divergence)
    ours = [str(w.message) for w in caught if "as the last batch of an epoch" in str(w.message)]
    assert len(ours) == 1 and 'batches_per_epoch="expected"' in ours[0]
    assert f"(batch_idx {first}, not 0)" in ours[0]
    after = Classifier(policy=policy)
    at_its_end = tmp_path / f"step={(first + 1) // 2}.ckpt"  # (the first epoch's last step)
    trainer(epochs=2, accumulate_grad_batches=2).fit(after, ckpt_path=at_its_end)
    assert not all(torch.equal(a, b) for a, b in zip(after.parameters(), module.parameters()))


class Tunable(Classifier):
    """The README's way to tune: a plain DataLoader while Lightning's Tuner runs."""

    tuning = False

    def train_dataloader(self):
        if self.tuning:
            return DataLoader(data(), batch_size=64, shuffle=True)
        return super().train_dataloader()

    def training_step(self, batch, batch_idx):
        if self.tuning:
            x, y = batch
            return F.cross_entropy(self(x), y)
        return super().training_step(batch, batch_idx)


def test_lightnings_tuner_is_named_as_the_cause_and_tuning_on_a_plain_loader_then_fitting_works(
    tmp_path,
):
    """Lightning's Tuner swaps the Trainer's callbacks for its own while it tunes: the refusal
    names it (it told a user who had passed the callback to pass it), and the documented way,
    a plain DataLoader while tuning, then fit with selective_loader, works."""
    from lightning.pytorch.tuner import Tuner

    with pytest.raises(ValueError, match=r"found 0.*Lightning's Tuner \(lr_find, scale_batch_size"):
        Tuner(trainer(epochs=1, default_root_dir=tmp_path)).lr_find(
            Classifier(), num_training=4, update_attr=False
        )
    t = trainer(epochs=1, default_root_dir=tmp_path)
    module = Tunable()
    module.tuning = True
    found = Tuner(t).lr_find(module, num_training=4, update_attr=False, early_stop_threshold=None)
    assert found is not None and len(found.results["lr"]) == 4
    module.tuning = False
    t.fit(module)
    assert module.trained and all(len(b) == 24 for b in module.trained)


def test_a_batch_rebuilt_by_lightnings_transfer_names_metadata_key_instead_of_reading_none():
    """Lightning's move_data_to_device rebuilds a yielded batch as a new instance of its class,
    without the selection results: reading them names metadata_key= (a bare AttributeError
    before), and logits/features raise too instead of reading None ("no pass yet")."""
    from lightning.pytorch.utilities import move_data_to_device

    loader = SelectiveLoader(
        DataLoader(data(), batch_size=32),
        nn.Linear(8, 4),
        policy=SelectiveBackprop(0.5),
        batch_size=8,
        keep_logits=True,
    )
    batch = next(iter(loader))
    assert batch.logits.shape == (8, 4) and batch.features is None
    moved = move_data_to_device(batch, "cpu")
    assert type(moved) is type(batch) and torch.equal(moved[0], batch[0])
    for name in ("weights", "indices", "logits", "features"):
        with pytest.raises(AttributeError, match=rf"no attribute '{name}'.*pass metadata_key="):
            getattr(moved, name)
    # with metadata_key the results travel inside the batch, through the transfer
    keyed = SelectiveLoader(
        DataLoader(data(), batch_size=32),
        nn.Linear(8, 4),
        policy=SelectiveBackprop(0.5),
        batch_size=8,
        metadata_key="sb",
    )
    _, _, sb = move_data_to_device(next(iter(keyed)), "cpu")
    assert sb["weights"].shape == (8,)


class Interrupted(Classifier):
    """A Classifier whose training_step, or its selection pass, raises KeyboardInterrupt once
    (``at``: the global step of the step, or the count of the selection pass)."""

    def __init__(self, where: str = "", at: int = -1, **options) -> None:
        super().__init__(**options)
        self.where, self.at, self.passes = where, at, 0

    def forward(self, x):
        if self.where == "selection" and not torch.is_grad_enabled():
            self.passes += 1
            if self.passes == self.at:
                raise KeyboardInterrupt
        return super().forward(x)

    def training_step(self, batch, batch_idx):
        if self.where == "step" and self.global_step == self.at:
            raise KeyboardInterrupt
        return super().training_step(batch, batch_idx)


def interrupted_then_resumed(tmp_path: Path, where: str, at: int, **options):
    """An uninterrupted 2-epoch run, and one interrupted (see Interrupted) with an
    OnExceptionCheckpoint then resumed from it: (the batches of both, the warnings saving it).
    ``options``: the loader's (``batches_per_epoch=``)."""
    full = Classifier(**options)
    trainer(epochs=2).fit(full)
    first = Interrupted(where, at, **options)
    saving = pl.callbacks.OnExceptionCheckpoint(tmp_path)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit):
        warnings.simplefilter("always")
        trainer(epochs=2, callbacks=[saving]).fit(first)
    again = Classifier(**options)
    trainer(epochs=2).fit(again, ckpt_path=tmp_path / "on_exception.ckpt")
    ours = [str(w.message) for w in caught if "interrupted a training step" in str(w.message)]
    return full.trained, first.trained + again.trained, ours


@pytest.mark.parametrize("options", [{}, {"batches_per_epoch": "expected"}], ids=["pass", "fixed"])
def test_an_exception_in_a_selection_pass_resumes_exactly_from_the_checkpoint_saved_then(
    tmp_path, options
):
    """An exception in the selection pass of the batch fetched ahead (the 4th pass: epoch 1's
    second) closes the loader's epoch before the batch fetched before it is trained, and
    Lightning resumes at that batch: the state saved then (OnExceptionCheckpoint) took back
    none, and the resumed run skipped it, unsaid. With ``batches_per_epoch`` the training epoch
    counted as ended too: the resumed run lost that batch and began the next training epoch."""
    full, resumed, warned = interrupted_then_resumed(tmp_path, "selection", 4, **options)
    assert len(full) > 4 and resumed == full and not warned


@pytest.mark.parametrize("options", [{}, {"batches_per_epoch": "expected"}], ids=["pass", "fixed"])
@pytest.mark.parametrize("at", [12, 13])  # 13: the first step of the second epoch
def test_an_exception_in_a_training_step_resumes_exactly_from_the_checkpoint_saved_then(
    tmp_path, options, at
):
    """An exception in training_step leaves its batch untrained, and Lightning resumes a
    checkpoint saved then (OnExceptionCheckpoint) at that batch; the loader had handed out the
    next one too. The state takes both back, so the resumed run trains the interrupted batch
    and everything after it as the uninterrupted run does. Before, it took back only the one
    fetched ahead: the interrupted batch was never trained (and the callback warned)."""
    full, resumed, warned = interrupted_then_resumed(tmp_path, "step", at, **options)
    assert len(full) > at + 1 and resumed == full and not warned


class PassRecorded(Classifier):
    """A Classifier recording the loader's pass over the data (``loader.epoch``) at each step."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.passes: list[int] = []

    def training_step(self, batch, batch_idx):
        self.passes.append(self.trainer.train_dataloader.loader.epoch)
        return super().training_step(batch, batch_idx)


def test_an_interrupted_last_batch_of_an_epoch_seen_ended_resumes_exactly(tmp_path):
    """Without a len(), Lightning fetches ahead past an epoch's last batch, and the loader's
    epoch ends there, before the step on that batch. Interrupted there, that batch belonged to
    an epoch that had ended: the state counted it trained, and the resumed run never trained
    it (the callback warned). The loader keeps, as the epoch ends, the state that takes it
    back: the resumed run trains it, then ends the epoch and goes on as the uninterrupted run
    does, unwarned."""
    probe = PassRecorded()
    trainer(epochs=2).fit(probe)
    # (the pass recorded at a step is that of the batch fetched after it: the first step where
    # it changed is the first epoch's last)
    at = next(step for step, seen in enumerate(probe.passes) if seen != probe.passes[0])
    full, resumed, warned = interrupted_then_resumed(tmp_path, "step", at)
    assert full == probe.trained and len(full) > at + 1
    assert resumed == full and not warned


def test_the_ended_state_is_kept_only_for_a_loader_without_len():
    """The state kept as an epoch ends (a state's copy per epoch) is kept only where Lightning
    fetches past an epoch's last batch: a loader without len(); it is the state that hands
    that last batch out again, and goes when the next epoch begins."""
    selective = SelectiveLoader(
        DataLoader(data(), batch_size=32),
        nn.Linear(8, 4),
        policy=SelectiveBackprop(0.5),
        batch_size=8,
    )
    wrapped = lightning_sb.LightningLoader(selective)
    batches = list(wrapped)
    state = selective.ended_state
    assert state is not None and state["epoch"] == 0
    again = SelectiveLoader(
        DataLoader(data(), batch_size=32),
        nn.Linear(8, 4),
        policy=SelectiveBackprop(0.5),
        batch_size=8,
    )
    again.load_state_dict(state)
    assert [b.indices.tolist() for b in again] == [batches[-1].indices.tolist()]
    iter(wrapped)
    next(wrapped)
    assert selective.ended_state is None
    counted = SelectiveLoader(
        DataLoader(data(), batch_size=32), nn.Linear(8, 4), policy=Traditional()
    )
    list(lightning_sb.LightningLoader(counted))
    assert counted.ended_state is None
    with pytest.raises(TypeError, match="keep should be True or False, but got keep='yes'"):
        counted.keep_ended_state("yes")  # type: ignore[arg-type]


def test_no_ended_state_is_taken_where_a_state_writes_a_store_snapshot(tmp_path):
    """A memory-mapped store (store_path) writes a snapshot with every state and keeps only the
    store_snapshots newest: a state taken as each epoch ends, in case it was needed, would push
    the checkpoints' own snapshots out (their resume refused). None is taken there, and no
    snapshot is written; the interrupted last batch then warns as before."""

    def stale(path):
        return SelectiveBackprop(0.5, staleness=2, store_path=path)

    selective = SelectiveLoader(
        DataLoader(data(), batch_size=32),
        nn.Linear(8, 4),
        policy=stale(tmp_path / "s"),
        batch_size=8,
    )
    wrapped = lightning_sb.LightningLoader(selective)
    for _ in range(3):
        list(wrapped)
    assert selective.ended_state is None
    assert not list((tmp_path / "s").rglob("snapshots/*"))
    saved = selective.state_dict()  # (a checkpoint's state still writes its snapshot)
    assert "snapshot" in saved["policy"]["store"]
    assert len(list((tmp_path / "s").rglob("snapshots/*"))) == 1


@pytest.mark.parametrize("fraction", ["limit_train_batches", "val_check_interval"])
def test_a_fraction_of_an_epoch_without_len_names_batches_per_epoch(fraction):
    """A float limit_train_batches or val_check_interval needs len(loader): Lightning refused it
    saying "When using an IterableDataset", of a map-style source, and named no fix. It is
    refused naming the parameter and batches_per_epoch, which makes it work."""
    with pytest.raises(ValueError, match=rf"{fraction}=0.5\).*batches_per_epoch=\"expected\""):
        trainer(epochs=1, **{fraction: 0.5}).fit(Validated())
    module = Validated(batches_per_epoch="expected")
    trainer(epochs=1, **{fraction: 0.5}).fit(module)
    assert module.trained


class FirstStepLosses(Classifier):
    """Records the first training step's inputs' dtype, its selection losses and the module's
    own per-example losses on the same rows (under the Trainer's precision, before any step)."""

    def __init__(self) -> None:
        super().__init__(policy=lambda: SelectiveBackprop(0.5))
        self.first: tuple[torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def training_step(self, batch, batch_idx):
        x, y, sb = batch
        if self.first is None:
            own = F.cross_entropy(self(x), y, reduction="none").detach()
            self.first = (x.dtype, sb["losses"].clone(), own)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    "precision, dtype", [("bf16-true", torch.bfloat16), ("64-true", torch.float64)]
)
def test_a_true_precision_selects_with_the_inputs_converted_as_training_steps_are(precision, dtype):
    """Under a true precision Lightning converts the module's parameters, and the inputs of
    training_step alone: the loader's own selection pass over the source's float32 batches
    failed on its first forward ("mat1 and mat2 must have the same dtype"). It converts them as
    the Trainer's precision plugin does: its losses are the module's own on the same rows, and
    the batches it yields stay as the source made them (Lightning converts them)."""
    module = FirstStepLosses()
    t = trainer(epochs=1, precision=precision)
    t.fit(module)
    assert module.first is not None
    seen, selected, own = module.first
    assert seen == next(module.parameters()).dtype == dtype
    # (the loader's losses are float32: equal to the module's own, rounded to float32)
    torch.testing.assert_close(selected.float(), own.float(), rtol=0, atol=0)
    loader = t.train_dataloader.loader
    assert len(module.trained) == loader.stats.epochs[0].batches_yielded > 0
    x = next(iter(loader))[0]  # (what Lightning takes, before its own conversion)
    assert x.dtype == torch.float32


class CosineScheduled(Classifier):
    """Sizes a cosine schedule by the Trainer's estimated_stepping_batches, as Lightning's docs
    show, and records it."""

    def configure_optimizers(self):
        self.estimate = self.trainer.estimated_stepping_batches
        optimizer = super().configure_optimizers()
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.estimate)
        return [optimizer], [{"scheduler": cosine, "interval": "step"}]


def test_estimated_stepping_batches_of_no_steps_without_a_length_warns_naming_the_fix():
    """Without len() and max_steps Lightning's estimate is -1 (max_steps' default), returned
    silently: a CosineAnnealingLR(T_max=-1) trained at 0 and the full rate by turns. Read as the
    loader is built (configure_optimizers) it is warned of before any training, naming
    batches_per_epoch="expected", whose estimate is the run's steps; a run that never reads it
    is not warned."""
    module = CosineScheduled()
    t = trainer(epochs=2)
    with pytest.warns(
        UserWarning, match=r"reads -1 .*batches_per_epoch=\"expected\".*about \d+ expected"
    ):
        t.fit(module)
    assert module.estimate == -1 and t.global_step > 0

    with warnings.catch_warnings():
        warnings.filterwarnings("error", "Trainer.estimated_stepping_batches", UserWarning)
        trainer(epochs=2).fit(Classifier())  # (never read: silent)
        counted = CosineScheduled(batches_per_epoch="expected")
        t = trainer(epochs=2)
        t.fit(counted)
    assert counted.estimate == t.global_step == 2 * len(t.train_dataloader) > 0
