"""Regenerate (or check) the committed Python code for ``protos/geoloco.proto``.

Usage::

    python protos/regenerate.py            # write geoloco_pb2.py, .pyi and _pb2_grpc.py
    python protos/regenerate.py --check    # regenerate into a temp dir, diff, exit 1 on change

Why a pinned, old generator. The code protoc writes decides which protobuf runtimes can import
it. grpcio-tools >= 1.63 (protoc >= 26) emits a ``ValidateProtobufRuntimeVersion`` call that
refuses any runtime older than the generator (grpcio-tools 1.85 -> protobuf >= 7.35, which
excludes stacks pinned to protobuf < 7 such as Flower), and its ``_pb2_grpc.py`` raises unless
``grpcio >= `` the generator's version. grpcio-tools 1.62.3 (protoc 25.1) emits neither check
and its builder-based code imports under every runtime from protobuf 3.20.3 to 7.36 (upb and
pure-Python backends alike), and its stubs run under grpcio 1.60 .. 1.85; ``.ci/check_protos.sh``
tests both ends in clean virtual environments.

Deterministic import paths. protoc names imports after the proto's path relative to ``-I``.
The proto is therefore staged as ``geoloco/protos/geoloco.proto`` in a temp include root, so
the grpc stub says ``from geoloco.protos import geoloco_pb2`` with no text post-processing, and
the descriptor is registered as ``geoloco/protos/geoloco.proto`` (unique in the default pool).

The pinned grpcio-tools only ships wheels up to CPython 3.12. When this interpreter lacks it, the
script makes (once) a cached venv under ``~/.cache/geoloco/`` with ``pip install
grpcio-tools==GRPCIO_TOOLS_VERSION`` and re-runs itself there; set ``GEOLOCO_PROTOC_PYTHON`` to
choose the interpreter for that venv (default: this one if <= 3.12, else ``python3.12`` /
``python3.11`` from PATH).
"""

from __future__ import annotations

import argparse
import difflib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

GRPCIO_TOOLS_VERSION = "1.62.3"
"""The generator pin. Changing it changes the protobuf/grpcio range users can install beside."""

PROTO_DIR = Path(__file__).resolve().parent
PROTO_NAME = "geoloco.proto"
PACKAGE_PATH = Path("geoloco") / "protos"
GENERATED = ("geoloco_pb2.py", "geoloco_pb2.pyi", "geoloco_pb2_grpc.py")
_REEXEC_MARK = "GEOLOCO_PROTOC_REEXEC"


def _tools_version() -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - Python < 3.8
        return None
    try:
        return version("grpcio-tools")
    except PackageNotFoundError:
        return None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "geoloco"


def _pick_interpreter() -> str:
    chosen = os.environ.get("GEOLOCO_PROTOC_PYTHON")
    if chosen:
        return chosen
    if sys.version_info < (3, 13):
        return sys.executable
    for name in ("python3.12", "python3.11", "python3.10"):
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit(
        f"grpcio-tools=={GRPCIO_TOOLS_VERSION} has no wheels for Python "
        f"{sys.version_info.major}.{sys.version_info.minor}; set GEOLOCO_PROTOC_PYTHON to a "
        "Python 3.9-3.12 interpreter"
    )


def _reexec_in_pinned_venv(argv: list[str]) -> int:
    interpreter = _pick_interpreter()
    tag = subprocess.run(
        [interpreter, "-c", "import sys; print(f'{sys.version_info[0]}{sys.version_info[1]}')"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    venv = _cache_dir() / f"grpcio-tools-{GRPCIO_TOOLS_VERSION}-py{tag}"
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"creating {venv} with grpcio-tools=={GRPCIO_TOOLS_VERSION}", file=sys.stderr)
        subprocess.run([interpreter, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                f"grpcio-tools=={GRPCIO_TOOLS_VERSION}",
            ],
            check=True,
        )
    env = dict(os.environ, **{_REEXEC_MARK: "1"})
    return subprocess.run([str(python), str(Path(__file__).resolve()), *argv], env=env).returncode


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on the staged proto; return the generated files (written under out_dir)."""
    from grpc_tools import protoc  # imported here: only the pinned venv has it

    with tempfile.TemporaryDirectory(prefix="geoloco-protoc-") as staging:
        include_root = Path(staging) / "include"
        (include_root / PACKAGE_PATH).mkdir(parents=True)
        shutil.copyfile(PROTO_DIR / PROTO_NAME, include_root / PACKAGE_PATH / PROTO_NAME)
        raw_out = Path(staging) / "out"
        raw_out.mkdir()
        well_known = Path(protoc.__file__).resolve().parent / "_proto"
        args = [
            "grpc_tools.protoc",
            f"-I{include_root}",
            f"-I{well_known}",
            f"--python_out={raw_out}",
            f"--pyi_out={raw_out}",
            f"--grpc_python_out={raw_out}",
            str(include_root / PACKAGE_PATH / PROTO_NAME),
        ]
        status = protoc.main(args)
        if status != 0:
            raise SystemExit(f"protoc failed with status {status}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED:
            target = out_dir / name
            shutil.copyfile(raw_out / PACKAGE_PATH / name, target)
            written.append(target)
        return written


def check(committed_dir: Path) -> int:
    """Regenerate into a temp dir; print a unified diff and return 1 if anything differs."""
    with tempfile.TemporaryDirectory(prefix="geoloco-protos-check-") as tmp:
        generate(Path(tmp))
        status = 0
        for name in GENERATED:
            fresh = (Path(tmp) / name).read_text().splitlines(keepends=True)
            path = committed_dir / name
            old = path.read_text().splitlines(keepends=True) if path.exists() else []
            if fresh != old:
                status = 1
                sys.stdout.writelines(
                    difflib.unified_diff(old, fresh, f"committed/{name}", f"regenerated/{name}")
                )
        if status:
            print(
                "\nprotos/: generated code is out of date; run `python protos/regenerate.py` "
                "and commit the result",
                file=sys.stderr,
            )
        else:
            print(f"protos/: generated code matches grpcio-tools=={GRPCIO_TOOLS_VERSION}")
        return status


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="diff against the committed files")
    parser.add_argument(
        "--out", type=Path, default=PROTO_DIR, help="where to write (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    if _tools_version() != GRPCIO_TOOLS_VERSION:
        if os.environ.get(_REEXEC_MARK):
            raise SystemExit(
                f"grpcio-tools {_tools_version()} found, {GRPCIO_TOOLS_VERSION} required"
            )
        return _reexec_in_pinned_venv(argv)
    if args.check:
        return check(PROTO_DIR)
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
