"""The timing rule of the benchmark files: one warm-up call, then the best of ``reps`` calls
(``time.perf_counter``). Imported by name: pytest and ``python benchmarks/X.py`` both put this
folder on the path."""
import time


def best(fn, reps: int = 3) -> float:
    fn()
    out = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out
