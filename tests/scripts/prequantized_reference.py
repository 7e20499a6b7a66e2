"""``prequantized_reference.py FOLDER OUT``: bitsandbytes' own dequantization of the weights it stored in ``FOLDER``
(``prequantized_fit.bitsandbytes_reference``), saved to ``OUT``. In a process of its own: for a weight whose size is
no multiple of 64, bitsandbytes' CPU path runs ``torch.compile``, after which the process's ``nn.Module.__init__`` is
torch dynamo's wrapper."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.append(str(Path(sys.prefix) / "tests-only"))  # where scripts/bootstrap.sh puts bitsandbytes

import torch  # noqa: E402

from tests.scripts.prequantized_fit import bitsandbytes_reference  # noqa: E402

if __name__ == "__main__":
    torch.save(bitsandbytes_reference(Path(sys.argv[1])), sys.argv[2])
