"""Old names that stay accepted for one release, each with a DeprecationWarning that gives
the new name (the glossary in engine.py says why each concept has one name)."""

from __future__ import annotations

import functools
import warnings


def renamed_keywords(**new_names: str):
    """A decorator: keyword old=value is taken as new_names[old]=value, with a warning."""
    def wrap(function):
        name = function.__qualname__.removesuffix(".__init__")

        @functools.wraps(function)
        def accepting_old_names(*args, **kwargs):
            for old, new in new_names.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{name}() got both {new!r} and its old name {old!r}")
                    warnings.warn(f"{name}(): the keyword {old!r} is now {new!r}",
                                  DeprecationWarning, stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)
        return accepting_old_names
    return wrap


def renamed_attribute(old: str, new: str) -> property:
    """A read-only attribute under its old name that warns and reads the new one."""
    def read(self):
        warnings.warn(f"{type(self).__name__}.{old} is now {type(self).__name__}.{new}", DeprecationWarning,
                      stacklevel=2)
        return getattr(self, new)
    return property(read, doc=f"The old name of `{new}`.")
