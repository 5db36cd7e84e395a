"""``resilient ckpt ...``: the command line of the checkpoint tools.

``main(argv) -> int`` is what ``resilient ckpt`` calls (and
``python -m resilient_tools.cli``). Exit codes: 0 success (sound, matching),
1 a verdict against (verify found problems, diff found differences),
2 an error (bad URL, missing version, corrupt manifest, impossible layout,
bad arguments); errors are printed as one line saying what to do.
"""

from __future__ import annotations

import argparse
import json
import sys

from resilient.errors import ResilientError

URL_HELP = "checkpoint URL (folder, file://, s3://, any fsspec URL), optionally @STEP (default: newest complete)"


_FORCE_VERSION = ("replace a version of this step already in OUT (complete or left by an interrupted run); "
                  "the old one stays until the new one commits")

def _at_least(low: int):
    """An argparse type: an int >= ``low`` (0 MB blocks, 0 threads or 0 MB in flight would hang or divide by 0)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be at least {low} (got {v})")
        return v
    parse.__name__ = f"integer >= {low}"
    return parse


POSITIVE, NON_NEGATIVE = _at_least(1), _at_least(0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="resilient ckpt", description="Inspect, verify, reshard, convert, diff and "
                                "garbage-collect resilient checkpoints. Everything streams: memory stays a few "
                                "row blocks, whatever the checkpoint's size.")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--progress", action="store_true", help="progress bar on stderr even when it is not a terminal")
    p.add_argument("--threads", type=POSITIVE, default=4, help="parallel chunk reads")
    p.add_argument("--storage-options", metavar="JSON", default="",
                   help='fsspec options for every URL, e.g. \'{"client_kwargs": {"endpoint_url": "http://host:9000"}}\'')
    p.add_argument("--secret-file", metavar="FILE", default=None,
                   help="the job secret (a 0600 file; default: $RESILIENT_JOB_SECRET_FILE or $RESILIENT_JOB_SECRET): "
                        "versions read must authenticate under it, versions written are signed with it. Without "
                        "one, only CRCs are checked (integrity, not authenticity) and output is unsigned")
    p.add_argument("--inflight-mb", type=POSITIVE, default=32,
                   help="chunk reads in flight, in MB (at least one chunk); with --block-mb it bounds memory")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("ls", help="versions with step, time, layout, size, completeness")
    s.add_argument("url", help="checkpoint URL")
    s.add_argument("--json", action="store_true")

    s = sub.add_parser("inspect", help="layout, config digest, extra and the tensor tree of a version")
    s.add_argument("url", help=URL_HELP)
    s.add_argument("--json", action="store_true", help="machine-readable output")

    s = sub.add_parser("verify", help="every checksum and completeness; exit 1 naming bad/missing objects")
    s.add_argument("url", help=URL_HELP)
    s.add_argument("--fast", action="store_true", help="structure only: manifest sanity, sizes, objects exist")
    s.add_argument("--json", action="store_true")

    s = sub.add_parser("sign", help="adopt a version without MACs (older, or written without a secret) for the "
                       "job secret given (--secret-file): every chunk is CRC-checked, then signed")
    s.add_argument("url", help=URL_HELP)
    s.add_argument("--all", action="store_true", help="every complete version under URL, not one")
    s.add_argument("--force", action="store_true", help="also re-sign versions signed with another secret")

    s = sub.add_parser("reshard", help="write the version again, chunked for another pp/dp/tp layout")
    s.add_argument("url", help=URL_HELP)
    s.add_argument("--to", required=True, help="target layout, e.g. pp=2,dp=4,tp=2 (missing = 1; spr=N stages per rank)")
    s.add_argument("out", help="output checkpoint URL (the version keeps its step)")
    s.add_argument("--n-heads", type=POSITIVE, help="attention heads, when the manifest does not record the model config")
    s.add_argument("--block-mb", type=POSITIVE, default=32, help="row block size: bounds memory (default 32)")
    s.add_argument("--chunk-mb", type=POSITIVE, default=16, help="max chunk size written (default 16)")
    s.add_argument("--compress", choices=("auto", "none", "zstd"), default="auto")
    s.add_argument("--force", action="store_true", help=_FORCE_VERSION)

    s = sub.add_parser("convert", help="consolidated weights as safetensors, a torch DCP folder, or a torch.save file",
                       description="safetensors: streamed (memory: one block). torch-dcp: streamed through a "
                       "memory-mapped staging file next to OUT (disk: +model size while converting; local OUT "
                       "only). torch: torch.save of a dict: NEEDS RAM FOR THE WHOLE SELECTION.")
    s.add_argument("url", help=URL_HELP)
    s.add_argument("out", help="output file (safetensors, torch) or folder (torch-dcp)")
    s.add_argument("--format", required=True, choices=("safetensors", "torch-dcp", "torch"))
    s.add_argument("--optimizer", action="store_true", help="also export the optimizer state")
    s.add_argument("--block-mb", type=POSITIVE, default=32)
    s.add_argument("--force", action="store_true", help="overwrite an existing OUT (a file is replaced atomically)")

    s = sub.add_parser("import", help="a safetensors file, torch checkpoint or DCP folder into our format",
                       description="torch: torch.load(weights_only=True) only (no arbitrary unpickling). "
                       "torch-dcp: metadata read with an unpickler restricted to DCP's own classes.")
    s.add_argument("src", help="local file (safetensors, torch) or folder (torch-dcp)")
    s.add_argument("out", help="output checkpoint URL")
    s.add_argument("--from", dest="fmt", required=True, choices=("safetensors", "torch-dcp", "torch"))
    s.add_argument("--step", type=NON_NEGATIVE, default=0, help="step of the version written (default 0)")
    s.add_argument("--block-mb", type=POSITIVE, default=32)
    s.add_argument("--compress", choices=("auto", "none", "zstd"), default="auto")
    s.add_argument("--force", action="store_true", help=_FORCE_VERSION)

    s = sub.add_parser("diff", help="tensor by tensor: equal, or max abs/rel difference; exit 1 if they differ")
    s.add_argument("a", help=URL_HELP)
    s.add_argument("b", help=URL_HELP)
    s.add_argument("--atol", type=float, help="absolute tolerance (default: bitwise)")
    s.add_argument("--rtol", type=float, help="relative tolerance (default: bitwise)")
    s.add_argument("--all", action="store_true", help="also list equal tensors")
    s.add_argument("--block-mb", type=POSITIVE, default=16)
    s.add_argument("--json", action="store_true")

    s = sub.add_parser("gc", help="retention: keep the last K (and every M-th), remove debris")
    s.add_argument("url", help="checkpoint URL")
    s.add_argument("--keep-last", type=POSITIVE, required=True)
    s.add_argument("--keep-every", type=NON_NEGATIVE, default=0)
    s.add_argument("--dry-run", action="store_true")
    return p


def _run(a: argparse.Namespace) -> int:
    from resilient_tools import fetch
    from resilient_tools.source import open_source
    progress = not a.quiet and (a.progress or sys.stderr.isatty())
    fetch.DEFAULT_INFLIGHT = max(1, a.inflight_mb) << 20
    from resilient_tools import source
    source.STORAGE_OPTIONS = {}
    if a.storage_options:
        from resilient_tools.errors import BadUrl
        try:
            source.STORAGE_OPTIONS = json.loads(a.storage_options)
        except json.JSONDecodeError as e:
            raise BadUrl(f"--storage-options is not JSON ({e}); write e.g. '{{\"anon\": true}}'") from None
    from resilient.secret import resolve_secret
    source.SECRET = resolve_secret(a.secret_file)
    if a.cmd == "sign":
        return _sign(a, progress)
    if a.cmd == "ls":
        from resilient_tools.listing import format_ls, list_versions
        rows = list_versions(a.url)
        print(json.dumps(rows) if a.json else format_ls(rows))
        return 0
    if a.cmd == "inspect":
        from resilient_tools.listing import describe, format_tree
        d = describe(open_source(a.url, a.threads))
        print(json.dumps(d, indent=1) if a.json else format_tree(d))
        return 0
    if a.cmd == "verify":
        from resilient_tools.verify import format_report, verify
        r = verify(a.url, a.fast, a.threads, progress)
        if a.json:
            print(json.dumps({"url": r.url, "step": r.step, "ok": r.ok, "fast": r.fast, "chunks": r.chunks,
                              "checked": r.checked,
                              "bad_objects": r.bad_objects, "problems": [p.to_json() for p in r.problems]}))
        else:
            print(format_report(r))
        return 0 if r.ok else 1
    if a.cmd == "reshard":
        from resilient_tools.layouts import parse_target
        from resilient_tools.reshard import reshard
        target = parse_target(a.to)
        r = reshard(open_source(a.url, a.threads), target, a.out, n_heads=a.n_heads, block_bytes=a.block_mb << 20,
                    chunk_bytes=a.chunk_mb << 20, compress=a.compress, progress=progress, force=a.force)
        print(f"wrote {r.url} for {target.as_dict()}: {r.tensors} tensors, {r.bytes_read / 1e6:,.1f} MB in "
              f"{r.seconds:.2f}s ({r.bytes_read / 1e6 / max(r.seconds, 1e-9):,.0f} MB/s)")
        return 0
    if a.cmd == "convert":
        from resilient_tools import convert
        src = open_source(a.url, a.threads)
        if a.format == "safetensors":
            n = convert.to_safetensors(src, a.out, a.optimizer, a.block_mb << 20, progress, force=a.force)
        elif a.format == "torch-dcp":
            n = convert.to_dcp(src, a.out, a.optimizer, a.block_mb << 20, progress, force=a.force)
        else:
            n = convert.to_torch(src, a.out, a.optimizer, progress, force=a.force)
        print(f"wrote {a.out} ({a.format}, step {src.step}, {n / 1e6:,.1f} MB)")
        return 0
    if a.cmd == "import":
        from resilient_tools.importer import import_checkpoint
        url, n = import_checkpoint(a.src, a.out, a.fmt, step=a.step, block_bytes=a.block_mb << 20,
                                   compress=a.compress, progress=progress, force=a.force)
        print(f"wrote {url}: {n} tensors from {a.fmt}")
        return 0
    if a.cmd == "diff":
        from resilient_tools.diff import diff, format_diff, to_json
        r = diff(open_source(a.a, a.threads), open_source(a.b, a.threads), atol=a.atol, rtol=a.rtol,
                 block_bytes=a.block_mb << 20, progress=progress)
        print(json.dumps(to_json(r)) if a.json else format_diff(r, a.all))
        return 0 if r.match else 1
    if a.cmd == "gc":
        from resilient_tools.gc import format_gc, gc
        print(format_gc(gc(a.url, a.keep_last, a.keep_every, a.dry_run)))
        return 0
    raise AssertionError(a.cmd)


def _sign(a: argparse.Namespace, progress: bool) -> int:
    from resilient.snapshot.auth import VersionAuth
    from resilient_tools import source
    from resilient_tools.errors import CkptToolError
    from resilient_tools.sign import sign

    if source.SECRET is None:
        raise CkptToolError("ckpt sign needs the job secret to sign with: --secret-file FILE (or "
                            "$RESILIENT_JOB_SECRET_FILE / $RESILIENT_JOB_SECRET)")
    auth, secret = VersionAuth(source.SECRET), source.SECRET
    source.SECRET = None  # the versions are read for their CRCs: they carry no MAC (yet)
    src = source.open_source(a.url, a.threads)
    steps = src.reader.complete_steps() if a.all else [src.step]
    for step in steps:
        r = sign(src.reader, step, auth, force=a.force, progress=progress)
        what = "re-signed" if r.resigned else ("signed" if r.bytes_read else "already signed")
        print(f"{what} {r.url} step {r.step} for secret {secret.fingerprint}: {r.chunks} chunks, "
              f"{r.bytes_read / 1e6:,.1f} MB checked")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``resilient ckpt`` with ``argv`` (without the ``ckpt``); returns the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    try:
        return _run(args)
    except ResilientError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into head & co.
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"interrupted; {_INTERRUPTED.get(args.cmd, 'nothing was written')}", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 -- only storage credential errors are turned into an answer
        typed = _credentials_error(e)
        if typed is None:
            raise
        print(f"error: {type(typed).__name__}: {typed}", file=sys.stderr)
        return 2


# What an interrupted command leaves (the writers clean up after themselves; gc would keep an
# incomplete version newer than every complete one forever, so "gc removes it" was not true).
_VERSION_LEFT = ("nothing was committed and the partial output was removed; if a step-* folder without "
                 "manifest.json is left in OUT (storage failed during the cleanup), rerun with --force")
_INTERRUPTED = {
    "sign": "manifest.json is replaced atomically: each version is signed or as it was; rerun to finish",
    "reshard": _VERSION_LEFT,
    "import": _VERSION_LEFT,
    "convert": "OUT was not written (a local file appears only when complete; a torch-dcp folder may hold "
               "partial files: rerun with --force)",
    "gc": "versions are removed manifest first, so each left is complete or debris; rerun gc to finish",
}


def _credentials_error(e: BaseException) -> Exception | None:
    """A BadUrl for botocore's missing/partial-credentials errors (not OSErrors, so nothing else maps them)."""
    boto = sys.modules.get("botocore.exceptions")
    if boto is None or not isinstance(e, (boto.NoCredentialsError, boto.PartialCredentialsError)):
        return None
    from resilient_tools.errors import BadUrl
    return BadUrl(f"no usable storage credentials ({type(e).__name__}: {e}); set AWS_ACCESS_KEY_ID and "
                  "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass them with --storage-options "
                  "'{\"key\": \"...\", \"secret\": \"...\"}' ('{\"anon\": true}' for a public bucket)")


if __name__ == "__main__":
    sys.exit(main())
