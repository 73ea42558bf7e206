"""Point-to-point between two ranks: the native graph ops against the numpy paths.

    python benchmarks/p2p.py [--rounds 200] [--max-bytes 33554432]

Two ranks (``tnt run``, the gloo backend) bounce a float32 tensor back and forth (rank 0
sends, rank 1 sends back what it received), for sizes from 4 bytes to 32 MB, three ways,
alternating round by round so that the machine's load falls on all alike:

- ``native graph``: ``tarantella.comm.native.point_to_point`` ops, 8 round trips chained in
  one ``tf.function`` (one function call per 8 round trips);
- ``numpy eager``: what ``tarantella.pipeline.stage.StageStep`` does today: the tensor to numpy,
  ``send_async``/``recv_async`` on numpy arrays and ``wait``, the array back to a tensor;
- ``numpy_function``: the same calls in a ``tf.numpy_function`` inside a ``tf.function``
  (8 round trips per call), the graph path of a backend without the native table.

Printed per size and way (rank 0): the median time of one round trip, its half (one-way
latency) and the bandwidth of one direction (bytes / half a round trip); and, as the
physical reference, one thread's memcpy bandwidth of the same buffer (``np.copyto``) on the
same rank in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from launch import rank_reports

#: float32 elements per message: 4 B, 4 KB, 256 KB, 4 MB, 32 MB
SIZES = (1, 1024, 65536, 1 << 20, 1 << 23)
WAYS = ("native graph", "numpy eager", "numpy_function")
#: round trips per call of the graph ways
CHAIN = 8


def rank_main(args: argparse.Namespace) -> None:
    import numpy as np
    import tensorflow as tf

    import tarantella  # noqa: F401 - starts the runtime
    import tnt_core
    from tarantella.comm import native as native_ops

    runtime = tnt_core.init()
    backend = runtime.backend
    rank, peer = runtime.rank, 1 - runtime.rank
    pp = native_ops.point_to_point(runtime)
    if pp is None:
        raise SystemExit(f"no native point-to-point: {native_ops.p2p_unavailable_reason(runtime)}")

    def numpy_send(t: np.ndarray) -> np.int64:
        backend.send_async(np.ascontiguousarray(t), peer, 1).wait()
        return np.int64(0)

    def numpy_recv(n: int):
        def recv(_after: np.int64) -> np.ndarray:
            buf = np.empty(n, np.float32)
            backend.recv_async(buf, peer, 1).wait()
            return buf
        return recv

    def graph(way: str, n: int):
        spec = tf.TensorSpec([n], tf.float32)

        def send(t):
            if way == "native graph":
                return pp.send(t, peer, 2)
            return tf.numpy_function(numpy_send, [t], tf.int64, stateful=True)

        def recv(after):
            if way == "native graph":
                with tf.control_dependencies([after]):
                    return pp.recv([n], tf.float32, peer, 2)
            out = tf.numpy_function(numpy_recv(n), [after], tf.float32, stateful=True)
            out.set_shape([n])
            return out

        @tf.function(input_signature=[spec])
        def bounce(t):
            tokens = []
            for _ in range(CHAIN):
                if rank == 0:
                    tokens.append(send(t))
                    t = recv(tokens[-1])
                else:
                    t = recv(tokens[-1] if tokens else tf.constant(0, tf.int64))
                    tokens.append(send(t))
            if way == "native graph":
                with tf.control_dependencies([pp.wait(tokens)]):
                    t = tf.identity(t)
            return t
        return bounce

    def eager(x: tf.Tensor) -> tf.Tensor:
        for _ in range(CHAIN):
            if rank == 0:
                backend.send_async(np.ascontiguousarray(x.numpy()), peer, 3).wait()
                buf = np.empty(x.shape, np.float32)
                backend.recv_async(buf, peer, 3).wait()
                x = tf.convert_to_tensor(buf)
            else:
                buf = np.empty(x.shape, np.float32)
                backend.recv_async(buf, peer, 3).wait()
                x = tf.convert_to_tensor(buf)
                backend.send_async(np.ascontiguousarray(x.numpy()), peer, 3).wait()
        return x

    report: dict[str, dict[str, float]] = {}
    for n in (n for n in SIZES if 4 * n <= args.max_bytes):
        x = tf.random.stateless_normal([n], seed=(1, n))
        calls = {"native graph": graph("native graph", n), "numpy eager": eager,
                 "numpy_function": graph("numpy_function", n)}
        rounds = max(5, args.rounds if n <= 65536 else args.rounds // 8)
        wall: dict[str, list[float]] = {w: [] for w in WAYS}
        for i in range(rounds + 2):
            for way in WAYS:
                t0 = time.perf_counter()
                out = calls[way](x)
                out.numpy()
                if i >= 2:  # warm-up: traces, first connections
                    wall[way].append((time.perf_counter() - t0) / CHAIN)
                if not np.array_equal(out.numpy(), x.numpy()):
                    raise SystemExit(f"{way}, {4 * n} bytes: the tensor came back changed")
        src = np.asarray(x)
        dst = np.empty_like(src)
        copies = []
        for _ in range(max(20, rounds)):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            copies.append(time.perf_counter() - t0)
        report[str(4 * n)] = {**{w: float(np.median(wall[w])) for w in WAYS},
                              "memcpy": float(np.median(copies))}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report))


def _bytes(n: int) -> str:
    for unit, size in (("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n // size} {unit}"
    return f"{n} B"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200,
                        help="round trips (x8) per way up to 256 KB; an eighth above")
    parser.add_argument("--max-bytes", type=int, default=4 * SIZES[-1],
                        help="the largest message measured (default: 32 MB)")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args)
        return 0
    report = rank_reports(__file__, 2, ["--rounds", str(args.rounds), "--max-bytes",
                                        str(args.max_bytes)],
                          options=["--backend", "gloo"], timeout=3600)[0]
    print(f"2 ranks, gloo over loopback; medians per round trip ({CHAIN} per call), rank 0")
    print(f"{'bytes':>7} {'way':>15} {'round trip us':>14} {'one-way us':>11} {'GB/s':>7}")
    for nbytes, ways in report.items():
        size = int(nbytes)
        for way in (*WAYS, "memcpy"):
            seconds = ways[way]
            if way == "memcpy":
                print(f"{_bytes(size):>7} {way:>15} {'':>14} {seconds * 1e6:11.1f} "
                      f"{size / seconds / 1e9:7.2f}")
            else:
                half = seconds / 2
                print(f"{_bytes(size):>7} {way:>15} {seconds * 1e6:14.1f} {half * 1e6:11.1f} "
                      f"{size / half / 1e9:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
