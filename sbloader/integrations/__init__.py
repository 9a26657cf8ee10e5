"""Integrations with training frameworks, each imported only when used."""

__all__: list[str] = []
