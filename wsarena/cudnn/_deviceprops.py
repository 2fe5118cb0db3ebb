"""Device properties (``CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR``, cuDNN 9.8+): a GPU's, or one described in JSON.

cuDNN reads the JSON's members by name and type (docs/deviceless.md), and refuses a member missing or of another
type, without naming it: wsarena then names it (:func:`device_properties`). Values it then accepts that no GPU has
(no SMs, a grid of no blocks, compute capability 0.0) end far from the file: in no engine for any convolution ("no
algorithm"), or in plans sized for no device; and it reads the grid's and the block's dimensions whatever their type
(a 65535.0 as some other number), and copies the device's name into 256 bytes whatever its length (a longer one
overruns them: the process aborts). wsarena refuses those first (:func:`check_members`), naming the file and the
member; a member it does not check is left to cuDNN.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import BackendUnavailableError
from ._enums import BackendAttributeName as A
from ._enums import BackendAttributeType as T
from ._enums import BackendDescriptorType as D
from ._enums import Status
from ._library import load_library
from ._status_errors import CudnnBadParamError, CudnnError, CudnnNotSupportedArchMismatchError
from .backend import BackendDescriptor, has_attribute

__all__ = ["DevicePropertiesError", "check_members", "device_properties", "device_properties_json", "members"]

# Counts and sizes every GPU has at least one of: zero or less describes no device.
_POSITIVE = (
    "multiProcessorCount", "warpSize", "maxThreadsPerBlock", "maxThreadsPerSM", "regsPerBlock", "maxRegistersPerSM",
    "maxCtasPerSM", "maxSharedMemoryPerBlock", "maxSharedMemoryPerBlockOptin", "totalGlobalMem",
)
# Sizes, rates, versions, ids and flags that are never negative (a virtual GPU may report some as 0).
_NON_NEGATIVE = (
    "reservedSharedMemoryPerBlock", "oversizedSharedMemoryPerBlock", "l2CacheSize", "smClockRateKHz",
    "memClockRateKHz", "memoryBusWidth", "driverVer", "pciDeviceId", "cudaDeviceId", "isTccDriver",
    "supportCoopLaunch", "smCountOrigin",
)
_TRIPLES = ("maxGridSize", "maxBlockSize")  # x, y, z: each at least 1
# deviceVer is the compute capability times 100 (900 for 9.0): from 1.0 to below 100.0.
_DEVICE_VER = (100, 10_000)
# The members cuDNN 9.28 reads, in its order (docs/deviceless.md), and the integers it reads them as
# (cudaDeviceProp's: int, totalGlobalMem a size_t). deviceName is a string, the triples are 3 ints each.
_KNOWN = (
    "maxGridSize", "maxBlockSize", "regsPerBlock", "multiProcessorCount", "smCountOrigin", "warpSize",
    "maxSharedMemoryPerBlock", "maxSharedMemoryPerBlockOptin", "oversizedSharedMemoryPerBlock",
    "reservedSharedMemoryPerBlock", "maxRegistersPerSM", "maxCtasPerSM", "maxThreadsPerBlock", "maxThreadsPerSM",
    "pciDeviceId", "isTccDriver", "supportCoopLaunch", "smClockRateKHz", "memClockRateKHz", "memoryBusWidth",
    "l2CacheSize", "deviceName", "deviceVer", "driverVer", "totalGlobalMem", "cudaDeviceId",
)
_INT32 = (-(2**31), 2**31 - 1)
_RANGES = {name: (0, 2**64 - 1) if name == "totalGlobalMem" else _INT32 for name in _KNOWN
           if name not in (*_TRIPLES, "deviceName")}
_NAME_BYTES = 255  # cudaDeviceProp.name is char[256], its NUL included
# What stands in for a member missing or misread while the members cuDNN refused are looked for; else 1
_PLACEHOLDERS = {"maxGridSize": [1, 1, 1], "maxBlockSize": [1, 1, 1], "deviceName": "GPU", "deviceVer": 900,
                 "smCountOrigin": 0}


class DevicePropertiesError(CudnnBadParamError, ValueError):
    """Device properties given as JSON that describe no GPU this cuDNN can plan for: not JSON, not the members
    (names and types) this cuDNN version reads, values no GPU has, or a GPU it does not support. Bad input, hence
    also a ``ValueError``.

    Attributes
    ----------
    source : str or None
        The file the JSON came from, when known (the message starts with it).
    member : str or None
        The member at fault, when known (cuDNN's own refusals name it, if at all, only in its text).
    """

    source: str | None = None
    member: str | None = None

    def __reduce__(self):  # keeps source and member through pickling
        return (*super().__reduce__(), self.__dict__)


def _error(message: str, source: str | None, member: str | None, status: int = Status.BAD_PARAM,
           func_name: str | None = None, context: str = "") -> DevicePropertiesError:
    exc = DevicePropertiesError(int(status), f"{source}: {message}" if source else message, func_name, context)
    exc.source, exc.member = source, member
    return exc


def without_bom(text: str) -> str:
    """Device properties' JSON ``text`` without the byte order mark it may start with (as Windows editors save UTF-8,
    and as the utf-8 codec reads it), which neither ``json.loads`` nor cuDNN takes: what :func:`device_properties` and
    :func:`wsarena.plan` read of it."""
    return text.removeprefix("\ufeff")


def members(text: str) -> dict[str, Any] | None:
    """The JSON object ``text`` as cuDNN reads it (of a member given twice, the first: ``json.loads`` would keep the
    last); ``None`` if it is no JSON object."""
    try:
        value = json.loads(text, object_pairs_hook=lambda pairs: dict(reversed(pairs)))
    except (ValueError, RecursionError):  # RecursionError: nested too deep for json's decoder
        return None
    return value if isinstance(value, dict) else None


def _shown(value: Any) -> str:
    """``value`` as the JSON it was read from (control characters escaped), its middle cut past 60 characters."""
    text = json.dumps(value)
    return text if len(text) <= 60 else f"{text[:28]}...{text[-28:]}"


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_members(text: str, source: str | None = None) -> None:
    """Refuse device properties whose values no GPU has, naming ``source`` (the file) and the member.

    Checked: integer values of the members named in this module, the grid's and the block's dimensions (which
    cuDNN reads whatever their type), and the length of the device's name. What is no JSON object, a member
    missing or of another type, is cuDNN's to refuse (:func:`device_properties` then names the member).

    Raises
    ------
    DevicePropertiesError
        A member's value describes no GPU.
    """
    found = members(text)
    if found is None:
        return

    def refuse(member: str, why: str) -> DevicePropertiesError:
        return _error(f"device properties member {member} is {_shown(found[member])}: {why}; these properties "
                      "describe no GPU (capture them on the GPU: bench/gpu_check.py)", source, member)

    for member in _POSITIVE:
        if _integer(found.get(member)) and found[member] < 1:
            raise refuse(member, "a GPU has at least 1")
    for member in _NON_NEGATIVE:
        if _integer(found.get(member)) and found[member] < 0:
            raise refuse(member, "it is never negative")
    for member in _TRIPLES:
        value = found.get(member)
        if isinstance(value, list) and not (len(value) == 3 and all(_integer(v) and 1 <= v <= _INT32[1]
                                                                    for v in value)):
            raise refuse(member, f"a GPU has 3 dimensions (x, y, z), each an integer from 1 to {_INT32[1]}")
    name: Any = found.get("deviceName")
    if isinstance(name, str) and len(name.encode("utf-8", "surrogatepass")) > _NAME_BYTES:
        raise refuse("deviceName", f"cuDNN holds a name of at most {_NAME_BYTES} bytes (UTF-8)")
    ver: Any = found.get("deviceVer")
    if _integer(ver) and not _DEVICE_VER[0] <= ver < _DEVICE_VER[1]:
        raise refuse("deviceVer", "it is the compute capability times 100, 900 for 9.0")


def device_properties(
    text: str | None = None, *, handle: Any = None, device: int | None = None, source: str | None = None
) -> BackendDescriptor:
    """A finalized ``DEVICEPROP`` descriptor: from JSON ``text`` (no device needed; a byte order mark first is
    dropped, :func:`without_bom`), or from a GPU (``handle`` or ``device``), whose JSON :func:`device_properties_json`
    then gives. ``source``: the file ``text`` came from, for the errors.

    Raises
    ------
    DevicePropertiesError
        ``text`` describes no GPU this cuDNN plans for: a value no GPU has (:func:`check_members`, naming the
        member), or cuDNN refused it (its reason in the message, and the members missing or of another type that
        made it refuse, the first as ``member``), or cuDNN does not support the GPU it describes
        (``NOT_SUPPORTED_ARCH_MISMATCH``).
    BackendUnavailableError
        The loaded cuDNN is older than 9.8, which has no device properties.
    """
    if not has_attribute(A.DEVICEPROP_JSON_REPRESENTATION):
        raise BackendUnavailableError(
            f"cuDNN {load_library().version_string} has no device properties (CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR): "
            "planning for a GPU from its properties needs cuDNN 9.8 or later"
        )
    if text is not None:
        text = without_bom(text)
        check_members(text, source)
    props = BackendDescriptor(D.DEVICEPROP_DESCRIPTOR)
    if text is not None:
        props.set(A.DEVICEPROP_JSON_REPRESENTATION, T.CHAR, text)
    if handle is not None:
        props.set(A.DEVICEPROP_HANDLE, T.HANDLE, handle)
    if device is not None:
        props.set(A.DEVICEPROP_DEVICE_ID, T.INT32, device)
    try:
        return props.finalize()
    except (CudnnBadParamError, CudnnNotSupportedArchMismatchError) as exc:
        if text is None:
            raise
        version = load_library().version_string
        if isinstance(exc, CudnnNotSupportedArchMismatchError):
            ver = (members(text) or {}).get("deviceVer")
            message = (f"cuDNN {version} does not support the GPU these device properties describe (deviceVer "
                       f"{_shown(ver)}, its compute capability times 100): {exc}")
            raise _error(message, source, "deviceVer", exc.status, exc.func_name, exc.context) from None
        culprits = _refused_members(members(text))
        named = f" ({'; '.join(why for _, why in culprits)})" if culprits else ""
        message = (f"cuDNN {version} refuses these device properties{named}: {exc}. They must be JSON with the "
                   "members this cuDNN version reads, as it serialises them on the GPU (bench/gpu_check.py captures "
                   "them; docs/deviceless.md)")
        member = culprits[0][0] if culprits else None
        raise _error(message, source, member, exc.status, exc.func_name, exc.context) from None


def _misread(member: str, value: Any) -> str | None:
    """Why cuDNN cannot read ``value`` as ``member`` (a type or range this module knows it reads); ``None``."""
    if member == "deviceName":
        return None if isinstance(value, str) else "a string"
    if member in _TRIPLES:
        return None if isinstance(value, list) and len(value) == 3 and all(map(_integer, value)) else "3 integers"
    low, high = _RANGES[member]
    return None if _integer(value) and low <= value <= high else f"an integer from {low} to {high}"


def _accepted(found: dict[str, Any]) -> bool:
    props = BackendDescriptor(D.DEVICEPROP_DESCRIPTOR)
    with props:
        try:
            props.set(A.DEVICEPROP_JSON_REPRESENTATION, T.CHAR, json.dumps(found)).finalize()
        except CudnnError:
            return False
    return True


def _refused_members(found: dict[str, Any] | None) -> list[tuple[str, str]]:
    """``(member, why)`` of the members that made cuDNN refuse ``found``: those of :data:`_KNOWN` missing, or of
    another type or range than it reads. cuDNN's reason names none (``!json_object.HasMember(key)``,
    ``!json_object.Is<T>()``), so each is put right with a placeholder, and a member is named if cuDNN still refuses
    the properties put right but for it. Empty when that finds none (or ``found`` is no JSON object)."""
    if found is None:
        return []
    suspects = {name: "no member " + name for name in _KNOWN if name not in found}
    for name in _KNOWN:
        why = _misread(name, found[name]) if name in found else None
        if why is not None:
            suspects[name] = f"member {name} is {_shown(found[name])}, where cuDNN reads {why}"
    if not suspects:
        return []
    fixed = {**found, **{name: _PLACEHOLDERS.get(name, 1) for name in suspects}}
    if not _accepted(fixed):
        return []
    culprits = []
    for name in (name for name in _KNOWN if name in suspects):
        undone = {k: v for k, v in fixed.items() if k != name}
        if name in found:
            undone[name] = found[name]
        if not _accepted(undone):
            culprits.append((name, suspects[name]))
    return culprits


def device_properties_json(props: BackendDescriptor) -> str:
    """The JSON cuDNN serialises finalized device properties to (to plan for that GPU elsewhere)."""
    return props.get_text(A.DEVICEPROP_JSON_REPRESENTATION)
