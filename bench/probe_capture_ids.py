"""GPU probe: which stream questions CUDA answers while a stream is being captured into a graph, per capture mode.

The arena tells a new stream from a dead one that left it its handle by the stream's id (``cudaStreamGetId``), and
must not ask a question that a capture refuses: a refused call invalidates the capture (seen on an H200 for the
capturing stream's own id, in every mode). This probe asks, in each capture mode, while stream A is captured:

- ``id A``          ``cudaStreamGetId`` of A, from the capturing thread;
- ``id B``          ``cudaStreamGetId`` of B, another stream, not captured, from the capturing thread;
- ``id B thread``   the same from another thread;
- ``capturing A``   ``cudaStreamIsCapturing`` of A (what the arena asks on every lease there).

For each: CUDA's answer (``cudaSuccess`` or the error's name) and whether A's capture is still active after it.
Prints a table; ``--json FILE`` writes it. Run: python bench/probe_capture_ids.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Callable
from typing import Any

from cuda.bindings import runtime as rt

MODES = {
    "global": rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal,
    "thread_local": rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal,
    "relaxed": rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed,
}


def _name(err: Any) -> str:
    return err.name if hasattr(err, "name") else str(err)


def _stream() -> Any:
    err, stream = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    if int(err):
        raise RuntimeError(f"cudaStreamCreateWithFlags: {_name(err)}")
    return stream


def _in_thread(call: Callable[[], Any]) -> Any:
    """``call()`` run in a new thread; its result."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call()))
    thread.start()
    thread.join()
    return out[0]


def ask(mode: Any, question: Callable[[Any, Any], Any]) -> dict[str, str]:
    """Capture a fresh stream A in ``mode``, ask ``question(A, B)`` (B: another stream), then end the capture; what
    CUDA answered, A's capture status after it, and how ending the capture went."""
    a, b = _stream(), _stream()
    try:
        (err,) = rt.cudaStreamBeginCapture(a, mode)
        if int(err):
            return {"answer": f"(cudaStreamBeginCapture: {_name(err)})", "capture_after": "-", "end": "-"}
        answer = question(a, b)
        status = rt.cudaStreamGetCaptureInfo(a)
        after = _name(status[1]) if not int(status[0]) else f"(cudaStreamGetCaptureInfo: {_name(status[0])})"
        err, graph = rt.cudaStreamEndCapture(a)
        if not int(err) and graph is not None:
            rt.cudaGraphDestroy(graph)
        rt.cudaGetLastError()  # a refused call leaves its error for the next call to read: cleared here
        return {"answer": _name(answer[0]), "capture_after": after, "end": _name(err)}
    finally:
        rt.cudaStreamDestroy(a)
        rt.cudaStreamDestroy(b)


QUESTIONS: dict[str, Callable[[Any, Any], Any]] = {
    "id A": lambda a, b: rt.cudaStreamGetId(a),
    "id B": lambda a, b: rt.cudaStreamGetId(b),
    "id B thread": lambda a, b: _in_thread(lambda: rt.cudaStreamGetId(b)),
    "capturing A": lambda a, b: rt.cudaStreamIsCapturing(a),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the answers as JSON into this file")
    args = parser.parse_args()
    (err,) = rt.cudaFree(0)  # the primary context, made current before anything is captured
    if int(err):
        raise SystemExit(f"no usable CUDA device: {_name(err)}")
    answers = {mode: {q: ask(value, question) for q, question in QUESTIONS.items()} for mode, value in MODES.items()}
    err, device = rt.cudaGetDevice()
    err, props = rt.cudaGetDeviceProperties(device)
    name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
    print(f"{name}: while stream A is captured, CUDA's answer / A's capture status after it / ending the capture")
    for mode, row in answers.items():
        for question, a in row.items():
            print(f"{mode:<13} {question:<13} {a['answer']:<32} {a['capture_after']:<36} {a['end']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": name.rstrip("\x00"), "answers": answers}, f, indent=2)


if __name__ == "__main__":
    main()
