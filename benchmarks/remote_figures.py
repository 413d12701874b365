"""Shared-cache figure: a cold local cache served from a remote vs a stock lowering.

    python benchmarks/remote_figures.py redis://127.0.0.1:6379/0 [model] [target]

Lowers the model once into local cache A (filling the remote), then, in the
same process and alternating with stock lowerings, into fresh local caches
served from the remote. Prints seconds, the ratio and the bytes moved.
"""

import contextlib
import io
import statistics
import sys
import tempfile
import time

import lowercache
from lowercache.lowering import flow
from lowercache.bench import models
from lowercache.config import Settings
from lowercache.targets import resolve


def main(url: str, model: str = "mobilenet_v2", target: str = "ethos-u55-128", repeat: int = 3) -> None:
    module, example = models.MODELS[model]()
    quiet = lambda *a: None  # noqa: E731
    with tempfile.TemporaryDirectory() as root:
        lowercache.lower(module, example, target=target, settings=Settings(cache_dir=f"{root}/fill", remote=url, remote_require_signed=False), listener=quiet)
        stock, remote, moved = [], [], []
        for i in range(repeat):
            start = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                reference = flow.run_stock(flow.export(module, example), resolve(target), example, [example])
            stock.append(time.perf_counter() - start)
            start = time.perf_counter()
            got = lowercache.lower(module, example, target=target, settings=Settings(cache_dir=f"{root}/cold{i}", remote=url, remote_require_signed=False), listener=quiet)
            remote.append(time.perf_counter() - start)
            assert got.pte == reference, "remote hit differs from stock"
            moved.append(got.manifest["remote"]["bytes_read"])
    s, r = statistics.median(stock), statistics.median(remote)
    print(f"{model} {target}: stock {s:.2f}s, cold local served from remote {r:.3f}s, ratio {s / r:.1f}x, "
          f"bytes read from remote {moved[0]} (median of {repeat}), byte-identical: yes")


if __name__ == "__main__":
    main(*sys.argv[1:])
