"""Import each named module as if in a fresh interpreter, for ``test_import_graph.py``.

Run as a script: it imports the third-party libraries the packages build on (TensorFlow,
Keras, numpy: none of ours), then reads one JSON list of module names per line on stdin
and answers one JSON object per line, ``{name: [problem or None, the modules it loaded]}``.
Each name is imported in a child forked from this process, which has loaded none of the
repository's modules, so the order of the repository's own imports is tested as in a new
interpreter; what is shared is only the libraries' start-up, the bulk of a new
interpreter's seconds (TensorFlow's import alone takes several).
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
import traceback

TIMEOUT_S = 120.0


def _child(name: str, write_fd: int) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # stdout is the server's answer channel: a module's print must not reach it
    try:
        __import__(name)
        result = [None, sorted(sys.modules)]
    except BaseException as error:  # noqa: BLE001 - every failure is the answer
        result = [traceback.format_exception_only(type(error), error)[-1].strip(), []]
    with os.fdopen(write_fd, "w") as out:
        json.dump(result, out)
    os._exit(0)


def import_each(names: list[str], at_once: int = 4) -> dict[str, list]:
    """Fork a child per name, ``at_once`` at a time, and collect their answers; a child
    still importing after TIMEOUT_S is killed and named."""
    waiting = list(names)
    children: dict[int, tuple[str, int, float, list[bytes]]] = {}
    answers: dict[str, list] = {}
    while waiting or children:
        while waiting and len(children) < at_once:
            name = waiting.pop(0)
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read_fd)
                _child(name, write_fd)
            os.close(write_fd)
            children[read_fd] = (name, pid, time.monotonic() + TIMEOUT_S, [])
        first_deadline = min(deadline for _, _, deadline, _ in children.values())
        ready, _, _ = select.select(list(children), [], [], max(0.0, first_deadline - time.monotonic()))
        for fd in ready:
            name, pid, _, chunks = children[fd]
            chunk = os.read(fd, 1 << 16)
            if chunk:
                chunks.append(chunk)
                continue
            os.close(fd)
            del children[fd]
            _, status = os.waitpid(pid, 0)
            text = b"".join(chunks).decode()
            answers[name] = json.loads(text) if text else [
                f"the import ended the process (wait status {status})", []]
        for fd, (name, pid, deadline, _) in list(children.items()):
            if time.monotonic() >= deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                os.close(fd)
                del children[fd]
                answers[name] = [f"import did not finish within {TIMEOUT_S:.0f} s", []]
    return answers


def main() -> None:
    for library in ("numpy", "tensorflow", "keras"):
        try:
            __import__(library)
        except ImportError:
            pass
    for line in sys.stdin:
        print(json.dumps(import_each(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
