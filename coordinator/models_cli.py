"""`tessera-coordinator models ...`: import, list and remove models on a running coordinator.

The checkpoint is checked here first (config, architecture, every tensor, shapes, dtypes,
file integrity), so mistakes show up before a single byte is uploaded; the coordinator
checks everything again on arrival anyway.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
from tqdm import tqdm

from coordinator.admin_client import (
    CliError,
    add_connection_arguments,
    bearer_metadata,
    open_channel,
    resolve_address,
    resolve_admin_token,
)
from coordinator.model_store.checkpoint import Checkpoint, CheckpointTensor, open_checkpoint
from coordinator.model_store.errors import CheckpointError
from coordinator.model_store.importer import MODEL_NAME
from coordinator.secrets_store import ADMIN_TOKEN_FILE
from protos.dialing import tls_hint
from protos.tessera.v1 import admin_pb2, admin_pb2_grpc, client_api_pb2_grpc, common_pb2
from protos.units import human_bytes

UPLOAD_CHUNK_BYTES = 4 << 20
RPC_TIMEOUT_S = 30.0

EPILOG = """\
examples:
  tessera-coordinator models add ./TinyLlama-1.1B --name tinyllama --data-dir ~/.tessera
  tessera-coordinator models add ./qwen2-0.5b --name qwen2-0.5b --replace \\
      --coordinator 127.0.0.1:7000 --admin-token "$(cat ~/.tessera/admin.token)"
  tessera-coordinator models list --data-dir ~/.tessera --json
  tessera-coordinator models remove tinyllama --data-dir ~/.tessera

The checkpoint directory is a Hugging Face style folder: config.json, model.safetensors
(or model.safetensors.index.json and its shards) and optionally tokenizer.json.
Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM in F32, F16 or BF16.
Pickle weights (*.bin, *.pt) are refused; convert them with save_pretrained(...,
safe_serialization=True). The coordinator address and admin token come from the flags or
from DATA_DIR/coordinator.addr and DATA_DIR/admin.token, which `serve` writes.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `models` command group to the coordinator's CLI."""
    models = subparsers.add_parser(
        "models",
        help="import, list and remove models on a running coordinator",
        description="Import, list and remove models on a running coordinator.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = models.add_subparsers(dest="models_command", metavar="COMMAND", required=True)

    add = commands.add_parser(
        "add",
        help="check a local checkpoint and upload it to the coordinator",
        description="Check a local safetensors checkpoint, then upload it to the coordinator's "
        "model store. Identical tensors already in the store take no new disk space.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add.add_argument("directory", metavar="DIR", type=Path, help="the checkpoint directory")
    add.add_argument(
        "--name",
        help="name the model is served under (default: the directory's name); "
        "letters, digits, '.', '_' and '-'",
    )
    add.add_argument(
        "--replace", action="store_true", help="overwrite a model that has the same name"
    )
    add.add_argument(
        "--check-only",
        action="store_true",
        help="only check the checkpoint and print what would be uploaded",
    )
    add_connection_arguments(add)
    add.set_defaults(func=run_add)

    listing = commands.add_parser(
        "list",
        help="list the models the coordinator holds and whether nodes serve them",
        description="List the models in the coordinator's store: architecture, layers, size, "
        "whether a tokenizer came with them, and whether every layer has a ready node now.",
        epilog="example: tessera-coordinator models list --data-dir /var/lib/tessera --json",
    )
    listing.add_argument("--json", action="store_true", help="print JSON for scripts")
    add_connection_arguments(listing)
    listing.set_defaults(func=run_list)

    remove = commands.add_parser(
        "remove",
        help="delete a model from the coordinator's store",
        description="Delete a model from the coordinator's store. Needs the admin token.",
        epilog="example: tessera-coordinator models remove tinyllama --data-dir /var/lib/tessera",
    )
    remove.add_argument("name", metavar="NAME", help="as `models list` shows it")
    add_connection_arguments(remove)
    remove.set_defaults(func=run_remove)
    return models


# The sync gRPC API on purpose: when the coordinator refuses an upload mid-stream, the
# asyncio client can report INTERNAL "Internal error from Core" instead of the coordinator's
# status and message (grpc/grpc#36066); the sync client reports what the coordinator said.


def run_add(args: argparse.Namespace) -> int:
    return _run(_add, args)


def run_list(args: argparse.Namespace) -> int:
    return _run(_list, args)


def run_remove(args: argparse.Namespace) -> int:
    return _run(_remove, args)


def _run(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return command(args)
    except CliError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; the coordinator keeps nothing of a partial upload", file=sys.stderr)
        return 130


def _add(args: argparse.Namespace) -> int:
    name = args.name or args.directory.resolve().name
    if not MODEL_NAME.match(name):
        raise CliError(
            f"model name {name!r} is not allowed: use letters, digits, '.', '_' or '-' "
            "(pass --name)"
        )
    try:
        checkpoint = open_checkpoint(args.directory)
    except CheckpointError as err:
        raise CliError(str(err)) from None
    _describe(checkpoint, name)
    if args.check_only:
        return 0
    address = resolve_address(args)
    token = resolve_admin_token(args)
    digests = _hash_all(checkpoint)
    started = time.monotonic()
    with open_channel(address) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        with _byte_bar(checkpoint.total_bytes, "uploading") as bar:
            try:
                info = stub.AddModel(
                    _upload(checkpoint, name, args.replace, digests, bar),
                    metadata=bearer_metadata(token),
                )
            except grpc.RpcError as err:
                raise CliError(_rpc_problem(err, address, f"adding model {name}")) from None
    elapsed = time.monotonic() - started
    print(
        f"added model {info.name}: {info.architecture}, {info.num_layers} layers, "
        f"{human_bytes(info.total_bytes)} in {elapsed:.1f}s (weights sha256 {info.sha256[:16]}...)"
    )
    return 0


def _list(args: argparse.Namespace) -> int:
    address = resolve_address(args)
    with open_channel(address) as channel:
        try:
            reply = client_api_pb2_grpc.ClientApiStub(channel).ListModels(
                common_pb2.Empty(), timeout=RPC_TIMEOUT_S
            )
        except grpc.RpcError as err:
            raise CliError(_rpc_problem(err, address, "listing models")) from None
    if args.json:
        rows = [_info_dict(m) for m in reply.models]
        print(json.dumps(rows, indent=2))
        return 0
    if not reply.models:
        print("no models yet; add one with: tessera-coordinator models add DIR --name NAME")
        return 0
    header = ("NAME", "ARCHITECTURE", "LAYERS", "SIZE", "TOKENIZER", "SERVED", "ADDED")
    rows = [
        (
            m.name,
            m.architecture,
            str(m.num_layers),
            human_bytes(m.total_bytes),
            "yes" if m.has_tokenizer else "no",
            "yes" if m.available else f"no: {m.unavailable_reason}",
            time.strftime("%Y-%m-%d %H:%M", time.localtime(m.added_unix_ms / 1000)),
        )
        for m in reply.models
    ]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    return 0


def _remove(args: argparse.Namespace) -> int:
    address = resolve_address(args)
    token = resolve_admin_token(args)
    with open_channel(address) as channel:
        try:
            admin_pb2_grpc.AdminStub(channel).RemoveModel(
                common_pb2.ModelRef(name=args.name),
                metadata=bearer_metadata(token),
                timeout=RPC_TIMEOUT_S,
            )
        except grpc.RpcError as err:
            raise CliError(_rpc_problem(err, address, f"removing model {args.name}")) from None
    print(f"removed model {args.name}")
    return 0


def _describe(checkpoint: Checkpoint, name: str) -> None:
    layout = checkpoint.layout
    dtypes = sorted({t.dtype for t in checkpoint.tensors})
    print(
        f"checkpoint {checkpoint.directory}: {layout.architecture}, {layout.num_layers} layers, "
        f"hidden {layout.hidden_size}, vocab {layout.vocab_size}, {len(checkpoint.tensors)} "
        f"tensors ({'/'.join(dtypes)}), {human_bytes(checkpoint.total_bytes)}, "
        f"tokenizer: {'yes' if checkpoint.tokenizer_json else 'no'} -> model {name!r}",
        file=sys.stderr,
    )
    if checkpoint.ignored:
        shown = ", ".join(checkpoint.ignored[:5])
        more = f" (+{len(checkpoint.ignored) - 5} more)" if len(checkpoint.ignored) > 5 else ""
        print(f"skipping tensors the architecture does not use: {shown}{more}", file=sys.stderr)


def _hash_all(checkpoint: Checkpoint) -> dict[str, str]:
    # The header carries every digest, so hashing is a full read before the upload starts.
    digests: dict[str, str] = {}
    with _byte_bar(checkpoint.total_bytes, "hashing") as bar:
        for tensor in checkpoint.tensors:
            try:
                digests[tensor.name] = tensor.sha256(bar.update)
            except (OSError, CheckpointError) as err:
                raise CliError(f"cannot read tensor {tensor.name}: {err}") from None
    return digests


def _upload(
    checkpoint: Checkpoint, name: str, replace: bool, digests: dict[str, str], bar: tqdm
) -> Iterator[admin_pb2.AddModelChunk]:
    yield admin_pb2.AddModelChunk(
        header=admin_pb2.AddModelHeader(
            name=name,
            config_json=checkpoint.config_json,
            tokenizer_json=checkpoint.tokenizer_json,
            replace=replace,
            tensors=[_tensor_header(t, digests[t.name]) for t in checkpoint.tensors],
        )
    )
    for tensor in checkpoint.tensors:
        offset = 0
        for chunk in tensor.iter_bytes(UPLOAD_CHUNK_BYTES):
            yield admin_pb2.AddModelChunk(
                data=admin_pb2.TensorData(name=tensor.name, offset=offset, data=chunk)
            )
            offset += len(chunk)
            bar.update(len(chunk))


def _tensor_header(tensor: CheckpointTensor, digest: str) -> admin_pb2.TensorHeader:
    return admin_pb2.TensorHeader(
        name=tensor.name,
        dtype=tensor.dtype,
        shape=list(tensor.shape),
        nbytes=tensor.nbytes,
        sha256=digest,
    )


def _rpc_problem(err: grpc.RpcError, address: str, action: str) -> str:
    code = err.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return (
            f"cannot reach the coordinator at {address} ({err.details()}); is "
            f"`tessera-coordinator serve` running there?{tls_hint(address, err.details() or '')}"
        )
    if code == grpc.StatusCode.UNAUTHENTICATED:
        # The coordinator's own message may already say where the token is.
        hint = f"; use the token from the coordinator's DATA_DIR/{ADMIN_TOKEN_FILE}"
        if ADMIN_TOKEN_FILE in (err.details() or ""):
            hint = ""
        return f"the coordinator refused the admin token: {err.details()}{hint}"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        # A node's data-plane port, or another server: "Method not found!" names no cause.
        return (
            f"the server at {address} does not answer as a Tessera coordinator "
            f"({err.details()}); check --coordinator: it must be the address `serve` logs as "
            "'serving on HOST:PORT', not a node's"
        )
    return f"{action} failed: {err.details()} ({code.name})"


def _info_dict(info: object) -> dict[str, object]:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(
        info, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def _byte_bar(total: int, desc: str) -> tqdm:
    """A progress bar in bytes on stderr (stdout stays for results)."""
    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        mininterval=0.5,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `models` commands on their own: python -m coordinator.models_cli add DIR ..."""
    parser = argparse.ArgumentParser(prog="tessera-coordinator")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
