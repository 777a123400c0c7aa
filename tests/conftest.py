import os
import re
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@pytest.fixture(autouse=True)
def _restore_threads():
    """Tests that pin the thread count must not leak it into the next test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# A printed value checked against a tolerance may differ in its last bits between CPUs and matmul code paths
# (MKL_CBWR, ATEN_CPU_CAPABILITY): a script's output is compared with the README's quote up to such values,
# which must still pass their check. Used by the tests of mha.py and mla.py.
TOLERANCE_LINE = re.compile(r"= (\d\.\d\de[+-]\d\d)  OK  \(tolerance (\S+)\)$")


def comparable(text):
    lines = []
    for line in text.splitlines():
        m = TOLERANCE_LINE.search(line)
        if m:
            assert float(m.group(1)) <= float(m.group(2)), line
            line = line[:m.start(1)] + "<value>" + line[m.end(1):]
        lines.append(line)
    return lines
