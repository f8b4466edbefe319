"""torchrun entry: an emitted pdcompile program's ``train.py``, with the emulated slow link if asked.

    PD_BENCH_LINK_BPS=1e8 torchrun --nproc-per-node=2 -m benchmarks._slow_train PROGRAM_DIR [train.py flags]

Installs :mod:`benchmarks._slow_link`'s receive/all-reduce wrappers (only when PD_BENCH_LINK_BPS is
set), then runs the program's ``train.py`` unchanged.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from benchmarks import _slow_link


def main() -> None:
    folder = Path(sys.argv[1]).resolve()
    _slow_link.install()
    sys.argv = [str(folder / "train.py"), *sys.argv[2:]]
    runpy.run_path(str(folder / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
