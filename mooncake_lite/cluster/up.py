"""``mooncake up``: a whole cluster on one machine, one process per role, stopped cleanly.

    mooncake up --prefill 1 --decode 1 --model tiny          # serve until Ctrl-C
    mooncake up --smoke                                      # serve one real request, then exit
    mooncake up --device cuda --gpus 0,1                     # prefill on GPU 0, decode on GPU 1

A child that dies while serving is restarted (bounded, doubling backoff) on the ports it had, and
rejoins; the rest keep serving (``--no-restart``: its death stops the cluster, as under ``--smoke``).

Start order and flags come from :mod:`mooncake_lite.cluster.plan`; process handling from
:mod:`mooncake_lite.cluster.supervisor`. Children's logs are relayed on stderr prefixed with
their name (``[prefill-0] ...``); stdout carries the banner (API URL, curl example) and the
smoke result. A second Ctrl-C/SIGTERM cuts the stopping children's drains short, a third kills
every child left. Exit code: 0 after a clean Ctrl-C/SIGTERM or a passing smoke test; 1 when a
child fails to start, or dies without ``--restart`` (its last log lines are printed); 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import sys
from collections.abc import Mapping, Sequence

import aiohttp

from mooncake_lite.cluster.machine import with_machine_share
from mooncake_lite.cluster.gpus import DEFAULT_GPU_MEMORY_FRACTION
from mooncake_lite.cluster.plan import (MAX_SLOT_BYTES, ROLES, SIZING_OPTIONS, UpOptions, conductor_spec,
                                        instance_specs, kv_layout, role_setting, slot_bytes_for, split_args,
                                        store_specs)
from mooncake_lite.cluster.registration import connectable, wait_registered, with_role_support
from mooncake_lite.cluster.shares import DEFAULT_MEMORY_FRACTION
from mooncake_lite.cluster.smoke import SMOKE_PROMPT, SmokeError, served_model, smoke_request
from mooncake_lite.cluster.supervisor import RestartPolicy, Supervisor
from mooncake_lite.common.auth import api_key_headers, cluster_headers
from mooncake_lite.common.launch import LAUNCHER, RoleFailed
from mooncake_lite.model.args import DTYPE_BYTES
from mooncake_lite.model.source import DEFAULT_MODEL

_COLORS = {"conductor": "35", "store": "36", "prefill": "33", "decode": "32", "up": "1"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mooncake up", description=__doc__.split("\n\n")[0],
                                formatter_class=_DefaultsHelp)
    p.add_argument("--prefill", type=int, default=1, help="number of prefill instances")
    p.add_argument("--decode", type=int, default=1, help="number of decode instances")
    p.add_argument("--stores", type=int, default=1, help="number of stores (instance i uses store i %% N)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="named real model (default: %(default)s), GGUF file, "
                   "Hugging Face checkpoint directory, or a dummy-weight preset such as tiny")
    p.add_argument("--host", default="127.0.0.1", help="address every role binds; loopback unless you mean it")
    p.add_argument("--port", type=int, default=8000, help="the conductor's public API port (0: pick a free one)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on the public API")
    p.add_argument("--cluster-token", default=None, help="shared secret for every internal connection")
    _add_role_options(p)
    _add_sizing_options(p)
    p.add_argument("--smoke", action="store_true", help="ask one chat question, print the answer, shut down")
    p.add_argument("--restart", action=argparse.BooleanOptionalAction, default=None,
                   help="restart a child that dies while serving, with backoff (default: on, off under --smoke)")
    p.add_argument("--smoke-prompt", default=SMOKE_PROMPT, help="--smoke's question")
    p.add_argument("--smoke-max-tokens", type=int, default=48, help="--smoke's max_tokens")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds for each start stage")
    p.add_argument("--stop-timeout", type=float, default=15.0, help="seconds of drain before SIGKILL")
    p.add_argument("--launcher", default=None,
                   help="command that runs a role (default: this Python with -m mooncake_lite)")
    p.add_argument("--no-color", action="store_true", help="plain log prefixes")
    return p


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """A default shown where it says something: not a None the help explains, nor a switch's False
    (each was a "(default: None)" after the help's own "(default: ...)")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def _add_role_options(p: argparse.ArgumentParser) -> None:
    """What ``up`` passes on to every role (or to every process of one role)."""
    p.add_argument("--config", default=None, metavar="FILE", help="TOML file passed to every role")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (passed to every role)")
    p.add_argument("--hash-seed", type=int, default=None, help="block hash seed (passed to every role)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPE_BYTES),
                   help="model and KV dtype of every prefill and decode (default: theirs, bfloat16 on CUDA and "
                        "float32 elsewhere); on a CPU "
                        "with AVX512-BF16, bfloat16 prefills ~1.4x faster than float32 on packed weights and "
                        "decodes slower (docs/model.md)")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel ranks of every prefill and decode instance (their --tensor-parallel)")
    p.add_argument("--log-level", default=None, choices=("debug", "info", "warning", "error"),
                   help="every role's log level (default: theirs, info)")
    p.add_argument("--log-json", action="store_true", help="roles log one JSON object per line")
    for role in ROLES:
        p.add_argument(f"--{role}-args", default=None, metavar="'FLAGS'",
                       help=f"extra flags for every {role} process, one quoted string")


def _add_sizing_options(p: argparse.ArgumentParser) -> None:
    """How the roles share this machine's memory and cores."""
    p.add_argument("--kv-memory-fraction", type=float, default=DEFAULT_MEMORY_FRACTION,
                   help="share of the memory available at start for the instances' KV caches and the stores' "
                        "DRAM, after every instance's weights (docs/operations.md)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of every prefill/decode instance, unpinned (default: each gets its own "
                        "slice of this machine's CPUs)")
    p.add_argument("--pin", action="store_true",
                   help="also bind each prefill/decode instance to its CPUs (affinity); off by default, since "
                        "on a box shared with other work a pinned process cannot move off a busy core")
    p.add_argument("--no-share", action="store_true",
                   help="size nothing from this machine: every role takes its own defaults and all cores")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the prefill and decode instances compute; cuda deals them over --gpus")
    p.add_argument("--gpus", default=None, metavar="0,1,...",
                   help="CUDA devices to deal the instances over, prefills then decodes, round-robin (implies "
                        "--device cuda; default there: every visible one)")
    p.add_argument("--gpu-memory-fraction", type=float, default=DEFAULT_GPU_MEMORY_FRACTION,
                   help="share of each GPU its instances hold together (weights, KV, activations), split 1:3 "
                        "between a prefill and a decode sharing it; each sizes its KV cache from its share")


def options_from(ns: argparse.Namespace) -> UpOptions:
    common: list[str] = []
    for flag, value in (("--block-size", ns.block_size), ("--hash-seed", ns.hash_seed),
                        ("--log-level", ns.log_level)):
        if value is not None:
            common += [flag, str(value)]
    if ns.log_json:
        common.append("--log-json")
    launcher = tuple(shlex.split(ns.launcher)) if ns.launcher else LAUNCHER
    return UpOptions(gpus=gpu_list(ns.device, ns.gpus), gpu_memory_fraction=ns.gpu_memory_fraction,
                     num_prefill=ns.prefill, num_decode=ns.decode, num_stores=ns.stores, model=ns.model,
                     host=ns.host, port=ns.port, api_key=ns.api_key or None,
                     cluster_token=ns.cluster_token or None, config=ns.config, common=tuple(common),
                     role_args=_with_instance_flags({r: split_args(getattr(ns, f"{r}_args")) for r in ROLES},
                                                      ns.dtype, ns.tp),
                     launcher=launcher)


def gpu_list(device: str, gpus: str | None) -> tuple[int, ...] | None:
    """``--gpus 0,1`` → (0, 1); ``--device cuda`` alone: every device CUDA sees here; None on the CPU."""
    if gpus is not None:
        try:
            return tuple(int(g) for g in gpus.split(",") if g.strip())
        except ValueError:
            raise ValueError(f"--gpus must be comma-separated device indices, got {gpus!r}") from None
    if device == "cpu":
        return None
    import torch
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError("--device cuda: no CUDA device here (torch.cuda.device_count() is 0)")
    return tuple(range(count))


def _with_instance_flags(role_args: dict[str, tuple[str, ...]], dtype: str | None,
                         tp: int | None = None) -> dict[str, tuple[str, ...]]:
    """``--dtype`` (the KV they exchange is in it) and ``--tp`` first in the prefill's and the
    decode's flags, so that one of the user's own in ``--prefill-args``/``--decode-args`` still wins."""
    first = (("--dtype", dtype) if dtype is not None else ()) + (("--tensor-parallel", str(tp)) if tp else ())
    return {r: (first + args if r in ("prefill", "decode") else args) for r, args in role_args.items()}


def with_store_sizing(opts: UpOptions, env: Mapping[str, str] | None = None) -> UpOptions:
    """``opts`` with the served model's KV block bytes (at the prefill's block size and dtype) and
    the sizing options the config file or environment set, so the stores get slots that hold a
    block (``plan.store_sizing``). A model or option we cannot read here is left to the roles,
    which say what is wrong with it."""
    import dataclasses

    from mooncake_lite.common.config import read_toml
    from mooncake_lite.model.checkpoint_config import model_args
    env = os.environ if env is None else env
    preset: dict[str, dict[str, object]] = {}
    for role in ("prefill", "decode", "store"):
        values = read_toml(opts.config, ["cluster", role]) if opts.config else {}
        values.update({n: env[f"MOONCAKE_{n.upper()}"] for n in SIZING_OPTIONS if f"MOONCAKE_{n.upper()}" in env})
        preset[role] = {n: v for n, v in values.items() if n in SIZING_OPTIONS}
    opts = dataclasses.replace(opts, preset=preset)
    try:
        block_size, dtype = kv_layout(opts)
        args = model_args(opts.model)
        block_bytes = args.kv_block_bytes(block_size, dtype)
    except (ValueError, OSError, KeyError):
        return opts
    if (compression := role_setting(opts, "prefill", "kv_compression")) not in (None, "none"):
        # encoded blocks: 1-byte codes and per-head scales per layer, whatever the dtype
        from mooncake_kernels.kv_codec import encoded_layer_bytes
        from mooncake_lite.model.kv_codec import model_codec
        try:
            rope_dim = model_codec(compression, args).rope_dim
        except ValueError:   # refused by the roles, naming it
            return opts
        block_bytes = args.num_layers * encoded_layer_bytes(block_size, args.num_kv_heads, args.head_dim, rope_dim)
    if slot_bytes_for(block_bytes) > MAX_SLOT_BYTES:
        raise ValueError(f"one {block_size}-token KV block of {opts.model} in {dtype} is {block_bytes} bytes, more "
                         f"than a store slot can hold ({MAX_SLOT_BYTES}): lower --block-size")
    return dataclasses.replace(opts, kv_block_bytes=block_bytes)


class Printer:
    """Relays child log lines to stderr with a (coloured on a terminal) ``[name]`` prefix."""

    def __init__(self, color: bool):
        self.color = color

    def __call__(self, name: str, line: str) -> None:
        prefix = f"[{name}]"
        if self.color:
            prefix = f"\033[{_COLORS.get(name.rsplit('-', 1)[0], '0')}m{prefix}\033[0m"
        sys.stderr.write(f"{prefix} {line}\n")
        sys.stderr.flush()


def banner(api_url: str, model: str, sup: Supervisor, api_key: str | None) -> str:
    auth = " -H 'Authorization: Bearer $MOONCAKE_API_KEY'" if api_key else ""
    lines = [f"mooncake-lite cluster is up: {len(sup.children)} processes", ""]
    for name, child in sup.children.items():
        addrs = " ".join(f"{k}={v}" for k, v in (child.addresses or {}).items())
        lines.append(f"  {name:<12} pid {child.pid:<8} {addrs}")
    lines += ["", f"OpenAI-compatible API: {api_url}/v1", "",
              f"  curl -s {api_url}/v1/chat/completions -H 'content-type: application/json'{auth} \\",
              f"       -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", "
              f"\"content\": \"What is the capital of France?\"}}]}}'", "",
              "Ctrl-C stops every process (a second Ctrl-C cuts the drain short)." + (" A child that dies is restarted." if sup.restart else "")]
    return "\n".join(lines)


async def start_cluster(opts: UpOptions, sup: Supervisor, timeout: float) -> str:
    """Start every stage in dependency order; returns the public API base URL."""
    (conductor,) = await sup.start_group([conductor_spec(opts)], timeout)
    conductor_url = f"http://{connectable(conductor.addresses['http'])}"
    stores = await sup.start_group(store_specs(opts, conductor_url), timeout)
    store_data = [connectable(s.addresses.get("data") or s.addresses["http"]) for s in stores]
    await sup.start_group(instance_specs(opts, conductor_url, store_data), timeout)
    await wait_registered(conductor_url, {"prefill": opts.num_prefill, "decode": opts.num_decode},
                          sup, timeout=timeout, headers=cluster_headers(opts.cluster_token))
    return conductor_url


async def model_name(api_url: str, opts: UpOptions) -> str:
    """The name clients must send (a checkpoint directory is served under its own id)."""
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout, headers=api_key_headers(opts.api_key)) as session:
        return await served_model(session, api_url, opts.model)


def is_preset(model: str) -> bool:
    from mooncake_lite.model.source import resolve
    try:
        return resolve(model).kind == "preset"
    except FileNotFoundError:
        return False


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def report_failure(exc: RoleFailed) -> None:
    sys.stderr.write(f"\nmooncake up: {exc}\n")
    if exc.tail:
        sys.stderr.write(f"last lines from {exc.name}:\n" + "".join(f"  | {ln}\n" for ln in exc.tail[-20:]))
    sys.stderr.flush()


def restart_policy(ns: argparse.Namespace) -> RestartPolicy | None:
    """Restarts are on unless ``--no-restart``, or ``--smoke`` (a one-shot check should fail loudly)."""
    return RestartPolicy() if (ns.restart if ns.restart is not None else not ns.smoke) else None


async def serve(opts: UpOptions, ns: argparse.Namespace) -> int:
    printer = Printer(sys.stderr.isatty() and not ns.no_color)
    sup = Supervisor(printer, stop_timeout=ns.stop_timeout, restart=restart_policy(ns),
                     on_event=lambda text: printer("up", text))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _on_stop_signal, stop, sup)
    rc = 0
    try:
        rc = await _run(opts, ns, sup, stop)
    except RoleFailed as exc:
        report_failure(exc)
        rc = 1
    except SmokeError as exc:
        sys.stderr.write(f"\nmooncake up --smoke: FAILED: {exc}\n")
        rc = 1
    finally:
        sys.stderr.write("mooncake up: stopping every process\n")
        codes = await sup.stop_all()
        sys.stderr.write("mooncake up: stopped (" + ", ".join(f"{n}={c}" for n, c in codes.items()) + "); "
                         f"restarts: {sup.restart_summary()}\n")
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return rc


def _on_stop_signal(stop: asyncio.Event, sup: Supervisor) -> None:
    """The first SIGINT/SIGTERM stops the cluster in order; later ones are passed on to the
    children (their own sessions keep a terminal's Ctrl-C from them): ``Supervisor.escalate``."""
    if not stop.is_set():
        stop.set()
    else:
        sup.escalate()


async def _until_stopped(coro, stop: asyncio.Event):
    """Run ``coro`` unless a stop signal comes first (then return None)."""
    task, stopper = asyncio.ensure_future(coro), asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        stopper.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


async def _run(opts: UpOptions, ns: argparse.Namespace, sup: Supervisor, stop: asyncio.Event) -> int:
    api_url = await _until_stopped(start_cluster(opts, sup, ns.ready_timeout), stop)
    if api_url is None:
        sys.stderr.write("mooncake up: interrupted during start-up\n")
        return 130
    _say(banner(api_url, await model_name(api_url, opts), sup, opts.api_key))
    if ns.smoke:
        res = await _until_stopped(smoke_request(api_url, opts.model, api_key=opts.api_key,
                                                 prompt=ns.smoke_prompt, max_tokens=ns.smoke_max_tokens,
                                                 timeout_s=ns.ready_timeout), stop)
        if res is None:
            return 130
        _say(f"\nsmoke test: model {res.model!r}\n  question: {res.prompt!r}\n  answer: {res.text!r}\n"
             f"  {res.num_chunks} chunks, finish_reason={res.finish_reason}, "
             f"TTFT {res.ttft_s * 1000:.0f} ms, total {res.total_s * 1000:.0f} ms")
        if is_preset(opts.model):
            _say(f"  (preset {opts.model!r} has seeded dummy weights, as in the paper: the text is noise; "
                 "leave --model at its default, smollm2-135m, for a real answer)")
        _say("smoke test: OK")
        return 0
    await _until_stopped(sup.watch(ns.ready_timeout), stop)  # RoleFailed: a child died, no restarts
    return 0


def main(argv: Sequence[str]) -> int:
    ns = build_parser().parse_args(list(argv))
    try:
        opts = with_store_sizing(with_role_support(options_from(ns)))
        if not ns.no_share:   # each role's share of this machine's cores and memory (plan.py)
            opts = with_machine_share(opts, memory_fraction=ns.kv_memory_fraction, threads=ns.threads, pin=ns.pin)
    except ValueError as exc:
        sys.stderr.write(f"mooncake up: error: {exc}\n")
        return 2
    try:
        import uvloop
    except ImportError:
        return asyncio.run(serve(opts, ns))
    return uvloop.run(serve(opts, ns))
