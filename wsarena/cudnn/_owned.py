"""What every cuDNN object wsarena owns (the handle, the descriptors) shares."""

from __future__ import annotations

import ctypes
import weakref

__all__ = ["Owned"]


class Owned:
    """An owned cuDNN pointer: readable while alive, passed as itself to a declared ctypes function.

    Subclasses set ``_handle`` (the raw pointer) and ``_finalizer`` (which destroys it; dead once closed).
    """

    __slots__ = ()
    _handle: int
    _finalizer: weakref.finalize

    @property
    def handle(self) -> int:
        """The raw cuDNN pointer as an int.

        Raises
        ------
        ValueError
            The object is closed.
        """
        if not self._finalizer.alive:
            raise ValueError(f"this cuDNN {type(self).__name__} is closed")
        return self._handle

    @property
    def _as_parameter_(self) -> ctypes.c_void_p:
        # Lets the object be passed straight to a declared ctypes function. A closed one then fails there as
        # ctypes.ArgumentError, whose message is the ValueError's.
        return ctypes.c_void_p(self.handle)

    @property
    def closed(self) -> bool:
        """``True`` once the cuDNN object has been destroyed."""
        return not self._finalizer.alive
