"""Peak heap memory of `ninfer convert`: runs the converter in this process while a thread samples
RssAnon from /proc/self/status every 5 ms. Mapped checkpoint and output pages are not heap, so
the figure is what the conversion itself holds (Linux only).

    python tools/convert_memory.py --model DIR --recipe qwen3_5 --weights groupwise-int --out F
"""

from __future__ import annotations

import sys
import threading
import time

from ninfer.cli.main import main


def rss_anon_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return 0


def run(argv: list[str]) -> int:
    peak = [rss_anon_kib()]

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], rss_anon_kib())
            time.sleep(0.005)

    threading.Thread(target=sample, daemon=True).start()
    before = rss_anon_kib()
    rc = main(["convert", *argv])
    print(
        f"heap peak {peak[0] / 1024:.0f} MiB (before converting {before / 1024:.0f} MiB)",
        file=sys.stderr,
    )
    return rc


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
