"""Request fields read the way pydantic reads them in lax mode, which is how vLLM 0.33 validates bodies.

``"9"`` and ``9.0`` are integers, ``1`` and ``"yes"`` are booleans, numbers are not strings; a value
that does not convert is a :func:`~load.sim.errors.validation_error` naming ``body.<loc>``. No IO.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from load.sim.errors import validation_error

T = TypeVar("T")

_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}


def lax_int(value: object, loc: str) -> int:
    """``value`` as pydantic's lax ``int``: bools, integral floats and integer strings convert."""
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        msg = "Input should be a valid integer, got a number with a fractional part"
        raise validation_error(loc, "int_from_float", msg, value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            msg = "Input should be a valid integer, unable to parse string as an integer"
            raise validation_error(loc, "int_parsing", msg, value) from None
    raise validation_error(loc, "int_type", "Input should be a valid integer", value)


def lax_bool(value: object, loc: str) -> bool:
    """``value`` as pydantic's lax ``bool``: 0/1 and strings such as ``"true"``/``"no"`` convert."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, int | float | str):
        msg = "Input should be a valid boolean, unable to interpret input"
        raise validation_error(loc, "bool_parsing", msg, value)
    raise validation_error(loc, "bool_type", "Input should be a valid boolean", value)


def lax_float(value: object, loc: str) -> float:
    """``value`` as pydantic's lax ``float``: numbers, bools and numeric strings convert."""
    if isinstance(value, bool | int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            msg = "Input should be a valid number, unable to parse string as a number"
            raise validation_error(loc, "float_parsing", msg, value) from None
    raise validation_error(loc, "float_type", "Input should be a valid number", value)


def strict_str(value: object, loc: str) -> str:
    """A string (pydantic converts nothing else to ``str``)."""
    if not isinstance(value, str):
        raise validation_error(loc, "string_type", "Input should be a valid string", value)
    return value


def strict_dict(value: object, loc: str) -> dict[str, Any]:
    """A JSON object."""
    if not isinstance(value, dict):
        raise validation_error(loc, "dict_type", "Input should be a valid dictionary", value)
    return value


def strict_list(value: object, loc: str) -> list[Any]:
    """A JSON array."""
    if not isinstance(value, list):
        raise validation_error(loc, "list_type", "Input should be a valid list", value)
    return value


def opt(body: dict[str, Any], key: str, read: Callable[[object, str], T], default: T) -> T:
    """``body[key]`` read with ``read``; ``default`` when absent or null."""
    value = body.get(key)
    return default if value is None else read(value, key)
