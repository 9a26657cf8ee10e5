"""The benchmarks' shared core, one job per module.

- ``config``: the one configuration object (:class:`~benchmarks.core.config.Config`) and presets;
- ``machine``: the machine, versions, commit and dirty-tree flag recorded with every result;
- ``data``: datasets as tensors, label noise, augmentation, DataLoader sources;
- ``sources``: the same examples as a DataLoader and as an FFCV source (breakdown, throughput);
- ``models``: model construction with a per-run seed, optimizer, SelectiveLoader construction;
- ``timing``: device synchronisation, autocast and step timers;
- ``train``: the one training step, and one run trained an epoch at a time (``Trainer``);
- ``strategies``: the strategy registry (named entries built by functions) and families;
- ``records``: what a run records (``Run``), saving and loading it;
- ``analysis``: pure accounting over runs (time to target, Table 1, Pareto frontier);
- ``frontier``: the frontier measure (pure: family frontiers and the ratio table);
- ``report``: run.py's summary markdown, curves and plots;
- ``throughput``: SelectiveLoader's throughput against the raw source's.
"""
