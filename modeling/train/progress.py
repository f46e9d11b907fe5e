"""The training progress on stderr: a tqdm bar, or plain lines without tqdm."""

import sys
import time


def _progress_bar(total: int, initial: int, enabled: bool):
    """A tqdm bar on stderr (steps, elapsed, and a postfix with loss, tokens/s and ETA), or, without
    tqdm, ``_PlainProgress``."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress(total, initial, enabled)
    return tqdm(total=total, initial=initial, disable=not enabled, dynamic_ncols=True, mininterval=1.0,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]", file=sys.stderr)


class _PlainProgress:
    """What the loop uses of tqdm, printing one line every 30 s."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.total, self.n, self.enabled, self.postfix, self.last = total, initial, enabled, "", time.perf_counter()

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        self.postfix = s

    def update(self, k: int) -> None:
        self.n += k
        if self.enabled and time.perf_counter() - self.last >= 30.0:
            self.last = time.perf_counter()
            print(f"step {self.n}/{self.total}: {self.postfix}", file=sys.stderr, flush=True)

    def write(self, msg: str, file=None) -> None:
        print(msg, file=file or sys.stderr, flush=True)

    def close(self) -> None:
        pass
