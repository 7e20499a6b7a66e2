"""Soak: 2 CPU ranks train 1000 steps with a checkpoint every 10; is resident memory flat? (~2 min)

    python benchmarks/soak/run.py [--steps N] [--every N] [--devices N] [--out FILE]

The run and its summary are ``tests/scripts/soak.py``'s, which the tests run cut short; here the samples and the
summary go to ``benchmarks/soak/results/soak.json`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.scripts.soak import main  # noqa: E402

if __name__ == "__main__":
    main(default_out=Path(__file__).parent / "results" / "soak.json")
