"""What stops vLLM's ECMooncakeConnector on this host (docs/benchmarks.md, issue 34): installs Mooncake's
transfer engine (`mooncake-transfer-engine` from the package index) into a temporary folder, never into
the project's environment, and starts it as the connector would (P2P handshake, TCP). Prints each missing
piece in turn; `--with-deps` also puts the CUDA runtime from the index beside it.

    python bench/probe_ec_mooncake.py [--with-deps]
"""

import os
import subprocess
import sys
import tempfile

START = """
from mooncake.engine import TransferEngine
engine = TransferEngine()
print("initialize:", engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""))
"""


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="mooncake-probe-") as tmp:
        pkgs = ["mooncake-transfer-engine"] + (["nvidia-cuda-runtime-cu12"] if "--with-deps" in sys.argv else [])
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", tmp, *pkgs],
                       check=True, env=dict(os.environ))
        libs = [os.path.join(tmp, "nvidia", "cuda_runtime", "lib")]
        env = dict(os.environ, PYTHONPATH=tmp, LD_LIBRARY_PATH=os.pathsep.join(
            [*libs, os.environ.get("LD_LIBRARY_PATH", "")]))
        proc = subprocess.run([sys.executable, "-c", START], capture_output=True, text=True, env=env)
        out = (proc.stdout + proc.stderr).strip().splitlines()
        print(out[-1] if out else f"exit {proc.returncode}")
        return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
