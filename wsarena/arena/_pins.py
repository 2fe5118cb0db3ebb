"""Pins: what tells the arena that a CUDA graph which captured a workspace buffer still exists.

A kernel captured into a graph keeps the workspace address it was given, and every replay writes there. So a
buffer lent to a lease during capture is *pinned* to that graph: the arena never frees it while the graph exists.
CUDA says when the graph is gone through a user object (``cudaUserObjectCreate``) that the graph holds a reference
to: its destructor runs once the graph and every executable graph instantiated from it are destroyed, and their
launches are over. That destructor runs on a CUDA thread, may not call CUDA and must not block; it must not run
Python either (it may run while the interpreter shuts down). So it is libc's ``sem_post`` on a semaphore of the
pin's own, and the arena asks ``sem_trywait`` whether it ran whenever it is about to free the buffer.

``sem_post`` returns an int and CUDA calls it as ``void (*)(void *)``: on the ABIs CUDA runs on (x86-64 System V,
AArch64) a return value the caller ignores stays in a register, so the call is sound.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

__all__ = ["SEM_POST", "GraphPin"]

_libc = ctypes.CDLL(None, use_errno=True)  # the process's own C library: sem_* live there (or in libpthread)
_sem_init = _libc.sem_init
_sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
_sem_trywait = _libc.sem_trywait
_sem_trywait.argtypes = [ctypes.c_void_p]

SEM_POST: int = ctypes.cast(_libc.sem_post, ctypes.c_void_p).value or 0  # the destructor CUDA runs
_SEM_BYTES = 64  # sizeof(sem_t) is 32 on 64-bit glibc and musl; room to spare

# Semaphores of pins dropped while a graph still held them: CUDA will post them later, so their memory stays.
_posted_later: list[Any] = []


class GraphPin:
    """A graph's hold on the buffers it captured: live until CUDA runs the destructor :attr:`destroy` with
    :attr:`address` (``sem_post`` on a semaphore of its own)."""

    __slots__ = ("_sem", "released")

    destroy = SEM_POST

    def __init__(self) -> None:
        self._sem = ctypes.create_string_buffer(_SEM_BYTES)
        if _sem_init(self._sem, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"sem_init: {os.strerror(errno)}")
        self.released = False

    @property
    def address(self) -> int:
        """What CUDA passes to the destructor: the semaphore's address."""
        return ctypes.addressof(self._sem)

    def live(self) -> bool:
        """Whether a graph still holds this pin (a C call that never blocks)."""
        if self.released:
            return False
        if _sem_trywait(self._sem) == 0:
            self.released = True
            return False
        return True

    def __del__(self) -> None:
        if not self.released and _sem_trywait(self._sem) != 0:
            _posted_later.append(self._sem)

    def __repr__(self) -> str:
        return f"GraphPin({'released' if self.released else 'live'})"
