"""Execute the notebooks headless, as the tests do, and keep the executed copies.

    python notebooks/run.py                 # every notebook, full settings
    python notebooks/run.py --small         # the tests' small settings (MESHPLAN_NB_SMALL=1), a minute or two
    python notebooks/run.py mesh_vs_ring_scaling.ipynb --out out/notebooks

Needs the ``test`` extra (nbclient, nbformat, ipykernel; ``pip install -e '.[test,exec]'``) — no Jupyter server.
Each notebook runs in a scratch working directory; the executed copy (outputs and plots inside) is written to
``--out`` (default ``out/notebooks``) and its ``RESULT`` line printed. To work in them interactively instead:
``pip install jupyterlab`` and ``jupyter lab notebooks/``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def notebooks() -> list[str]:
    """The notebooks shipped here, by name."""
    return sorted(p.name for p in HERE.glob("*.ipynb"))


def execute(name: str, out_dir: Path, small: bool) -> str:
    """Run notebook ``name``; write the executed copy under ``out_dir``; return its RESULT line ('' if none)."""
    import nbclient
    import nbformat

    os.environ["MESHPLAN_NB_SMALL"] = "1" if small else "0"    # the kernel inherits this process's environment
    nb = nbformat.read(HERE / name, as_version=4)
    with tempfile.TemporaryDirectory() as scratch:
        nbclient.NotebookClient(nb, timeout=3600, kernel_name="python3",
                                resources={"metadata": {"path": scratch}}).execute()
    out_dir.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out_dir / name)
    lines = [line for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "stream"
             for line in o.text.splitlines() if line.startswith("RESULT ")]
    return lines[-1] if lines else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="notebooks to run (default: all)")
    ap.add_argument("--small", action="store_true", help="the tests' small settings (MESHPLAN_NB_SMALL=1)")
    ap.add_argument("--out", default="out/notebooks", help="where the executed copies go")
    ap.add_argument("--list", action="store_true", help="list the notebooks and exit")
    args = ap.parse_args()
    if args.list:
        print("\n".join(notebooks()))
        return 0
    unknown = [n for n in args.names if n not in notebooks()]
    if unknown:
        print(f"error: no notebook {unknown[0]!r}; use one of {', '.join(notebooks())}", file=sys.stderr)
        return 2
    for name in args.names or notebooks():
        result = execute(name, Path(args.out), args.small)
        print(f"{name}: executed copy in {Path(args.out) / name}" + (f"; {result}" if result else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
