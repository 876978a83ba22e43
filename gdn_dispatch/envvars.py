"""Reading environment variables on the call path.

The library reads a few variables at every call (``GDN_BACKEND``, ``GDN_SELFTEST``,
``GDN_DEBUG_CHECKS``, ``GDN_DISPATCH_JIT_LAUNCH``, ``TRITON_INTERPRET``), so that setting one
takes effect at the next call. ``os.environ.get`` of an unset variable costs about 1 µs
(``os.environ`` raises and catches a KeyError inside), several times the dictionary lookup
it wraps; :func:`getenv` reads the same mapping without that detour. :func:`flag` reads an
on/off switch and refuses any other value, so that a misspelt "true" is not silently off.
"""

from __future__ import annotations

import os

_ENVIRON = os.environ
# CPython's os._Environ keeps the encoded variables in ``_data`` and encodes keys and values
# with ``encodekey`` / ``decodevalue``; anything else is read through ``.get``.
_DATA = getattr(_ENVIRON, "_data", None)
_ENCODE_KEY = getattr(_ENVIRON, "encodekey", None)
_DECODE_VALUE = getattr(_ENVIRON, "decodevalue", None)
_FAST = isinstance(_DATA, dict) and callable(_ENCODE_KEY) and callable(_DECODE_VALUE)
_KEYS: dict[str, object] = {}


def getenv(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``, read now (no value is cached)."""
    if not _FAST or os.environ is not _ENVIRON:
        return os.environ.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = _ENCODE_KEY(name)
    value = _DATA.get(key)
    return default if value is None else _DECODE_VALUE(value)


def flag(name: str) -> bool:
    """An on/off switch read now: "1" on; unset, "" or "0" off; ValueError naming the
    variable for any other value."""
    value = getenv(name)
    if value is None or value == "" or value == "0":
        return False
    if value == "1":
        return True
    raise ValueError(f"{name}={value!r}: expected 1 (on), 0 or unset (off)")
