"""A reward function that fails its first calls in given ways (raise, or hang past the time
limit), then scores normally: the runner's retries are tested with it. Shipped to the scoring
processes by value."""

import os
import time

from workbench.data import arithmetic


class FailFirst:
    """arithmetic.score, except that the k-th call to fail (counted across scoring processes
    by O_EXCL marker files in `directory`) does `failures[k]`: "raise" or "hang"."""

    def __init__(self, directory: str, failures: tuple[str, ...]):
        self.directory, self.failures = directory, failures
        self.__qualname__ = f"fail_first[{','.join(failures)}]"

    def __call__(self, response: str, truth: str) -> float:
        for k, how in enumerate(self.failures):
            try:
                os.close(os.open(os.path.join(self.directory, f"failed-{k}"), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                continue
            if how == "hang":
                time.sleep(600)
            raise RuntimeError(f"cannot judge {response!r}")
        return arithmetic.score(response, truth)
