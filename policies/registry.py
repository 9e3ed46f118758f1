"""Registry of named policy factories with typed, validated parameters.

Each policy registers a factory and a frozen dataclass of parameters.  ``build`` converts raw
values (from YAML, the CLI or env strings) to the declared field types and rejects unknown names,
unknown parameters and values that fail the dataclass's ``validate`` -- all at start-up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, get_type_hints

from .errors import PolicyConfigError

Factory = Callable[[Any, Any], Any]  # (params, deps) -> Policy


@dataclass(frozen=True)
class _Entry:
    factory: Factory
    params_type: type
    summary: str


class PolicyRegistry:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def register(self, name: str, params_type: type, factory: Factory, summary: str = "") -> None:
        if name in self._entries:
            raise PolicyConfigError(f"policy {name!r} registered twice")
        if not dataclasses.is_dataclass(params_type):
            raise TypeError("params_type must be a dataclass")
        self._entries[name] = _Entry(factory, params_type, summary)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def describe(self) -> dict[str, str]:
        return {n: e.summary for n, e in sorted(self._entries.items())}

    def parse_params(self, name: str, raw: Mapping[str, Any] | None) -> Any:
        entry = self._entry(name)
        return coerce_params(entry.params_type, raw or {}, context=f"policy {name!r}")

    def build(self, name: str, raw_params: Mapping[str, Any] | None = None, deps: Any = None) -> Any:
        params = self.parse_params(name, raw_params)
        return self._entry(name).factory(params, deps)

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(self.names())
            raise PolicyConfigError(f"unknown policy {name!r}; known: {known}") from None


def _convert(value: Any, typ: Any, where: str) -> Any:
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise PolicyConfigError(f"{where}: expected a boolean, got {value!r}")
    if typ in (int, float):
        if isinstance(value, bool):
            raise PolicyConfigError(f"{where}: expected a number, got {value!r}")
        try:
            converted = typ(value)
        except (TypeError, ValueError):
            raise PolicyConfigError(f"{where}: expected {typ.__name__}, got {value!r}") from None
        if typ is int and isinstance(value, float) and not value.is_integer():
            raise PolicyConfigError(f"{where}: expected an integer, got {value!r}")
        return converted
    if typ is str:
        if isinstance(value, bool):  # YAML's unquoted true/false/on/off for a word-valued param
            return "true" if value else "false"
        if not isinstance(value, str):
            raise PolicyConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def coerce_params(params_type: type, raw: Mapping[str, Any], context: str = "params") -> Any:
    """Build ``params_type`` from ``raw``, converting types and rejecting unknown keys."""
    hints = get_type_hints(params_type)
    fields = {f.name for f in dataclasses.fields(params_type)}
    unknown = set(raw) - fields
    if unknown:
        raise PolicyConfigError(
            f"{context}: unknown parameter(s) {sorted(unknown)}; allowed: {sorted(fields)}"
        )
    values = {k: _convert(v, hints[k], f"{context}.{k}") for k, v in raw.items()}
    params = params_type(**values)
    validate = getattr(params, "validate", None)
    if validate is not None:
        try:
            validate()
        except ValueError as exc:
            raise PolicyConfigError(f"{context}: {exc}") from exc
    return params
