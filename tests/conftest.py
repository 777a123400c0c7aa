import os
import re
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# A printed value checked against a tolerance may differ in its last bits between CPUs and matmul
# code paths (MKL_CBWR, ATEN_CPU_CAPABILITY): quoted output is compared with a run's up to such
# values, which must still pass.
TOLERANCE_LINE = re.compile(r"= (\d\.\d\de[+-]\d\d)  OK  \(tolerance (\S+)\)$")


def comparable(text):
    """The lines of text, each value held to a tolerance replaced by <value> once it is checked to
    be within it."""
    lines = []
    for line in text.splitlines():
        m = TOLERANCE_LINE.search(line)
        if m:
            assert float(m.group(1)) <= float(m.group(2)), line
            line = line[:m.start(1)] + "<value>" + line[m.end(1):]
        lines.append(line)
    return lines


def run_script(script, *args, cwd=None):
    """python script args, as a user runs it, headless as in CI: the CompletedProcess, text out and
    err."""
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "MPLBACKEND")}
    return subprocess.run([sys.executable, script, *args], check=False, capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def run_main(main, argv, capsys):
    """main(argv) in this process: (exit code, stdout, stderr). Cheaper than a subprocess."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def gqa_module(d, h, kv, dtype=torch.float32, seed=0):
    """A CausalMHA with PyTorch's weight init and random (non-zero) biases: a bias copied to the
    wrong rows would show."""
    import mha
    torch.manual_seed(seed)
    return mha.random_biases(mha.CausalMHA(d, h, kv).to(dtype))

