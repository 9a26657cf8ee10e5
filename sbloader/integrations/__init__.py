"""Integrations with training frameworks, one module each, imported only when used.

``import sbloader`` imports none of them (nor their frameworks): import the one you need, e.g.
``from sbloader.integrations.lightning import SelectiveLoaderCallback, selective_loader`` or
``from sbloader.integrations.accelerate import AcceleratedLoader``.
"""

__all__: list[str] = []
