"""CI: the README's way of keeping one's torch while installing an extra does keep it.

A scratch environment holds a torch 2.13.0+cpu (its metadata only: pip resolves from metadata, so no 200 MB
wheel is installed), the README's two commands run in it as a dry run with a report of what pip would install,
and torch must not be in that set. The same install without the constraint must replace torch, so the check
cannot pass for want of a torch to replace. Run with the project's venv: ``.venv/bin/python .ci/keep_torch.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
USERS_TORCH = "2.13.0+cpu"  # another build than the one the extras' newest releases ask for
# the README's two commands, word for word
PIN = ('.venv/bin/python -c "from importlib.metadata import version; '
       'print(\'torch==\' + version(\'torch\'))" > keep-torch.txt')
INSTALL = '.venv/bin/pip install -c keep-torch.txt -e ".[vision]"'


def scratch_env(folder: Path) -> Path:
    """A venv without pip whose only package is torch USERS_TORCH, as pip sees an installed distribution."""
    venv.create(folder, with_pip=False)
    python = folder / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    info = Path(purelib) / f"torch-{USERS_TORCH}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {USERS_TORCH}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")
    return python


def would_install(python: Path, work: Path, *constraint: str) -> dict[str, str]:
    """name -> version of what the README's install of ``[vision]`` would install into ``python``'s env."""
    report = work / "report.json"
    command = [sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run", "--quiet",
               "--disable-pip-version-check", "--report", str(report), *constraint, "-e", f"{ROOT}[vision]"]
    done = subprocess.run(command, cwd=work, capture_output=True, text=True)
    if done.returncode:  # pip's own words: the install the README describes failed outright
        sys.exit(f"keep_torch: {' '.join(command)}: exit {done.returncode}\n{done.stdout}{done.stderr}")
    return {item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]}


def main() -> int:
    readme = (ROOT / "README.md").read_text()
    missing = [command for command in (PIN, INSTALL) if command not in readme]
    if missing:
        print(f"keep_torch: the README no longer says {missing}: update this check with it", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        python = scratch_env(work / "venv")
        pin = PIN.replace(".venv/bin/python", str(python))
        subprocess.run(pin, shell=True, check=True, cwd=work)
        if (work / "keep-torch.txt").read_text().strip() != f"torch=={USERS_TORCH}":
            print(f"keep_torch: the pin reads {(work / 'keep-torch.txt').read_text()!r}", file=sys.stderr)
            return 1
        kept = would_install(python, work, "-c", "keep-torch.txt")
        replaced = would_install(python, work)
    if "torch" in kept:
        print(f"keep_torch: with the constraint, pip would still replace torch {USERS_TORCH} by {kept['torch']}",
              file=sys.stderr)
        return 1
    if "torch" not in replaced:
        print("keep_torch: without the constraint pip keeps torch as well: this check tests nothing", file=sys.stderr)
        return 1
    print(f"keep_torch: torch {USERS_TORCH} kept with the constraint (torchvision {kept.get('torchvision')}); "
          f"without it pip would install torch {replaced['torch']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
