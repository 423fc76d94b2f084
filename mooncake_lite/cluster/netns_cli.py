"""``mooncake netns``: nodes on one box (network namespaces joined by shaped links). Needs root.

    sudo mooncake netns up --nodes 3 --link 1gbit,0.5ms   # hold 3 nodes until Ctrl-C
    sudo mooncake netns list                              # namespaces this tool made, and owners
    sudo mooncake netns down                              # remove those a crashed run left behind

``up`` prints each node's namespace and address and how to run a role inside it, then waits;
Ctrl-C or SIGTERM stops what runs inside and deletes the namespaces and links. Exit code 2 when
namespaces cannot be made here (not root, no iproute2), 1 when setting them up fails.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from mooncake_lite.cluster.netns import (Link, NetnsError, NetnsUnavailable, Nodes, list_namespaces,
                                         remove_stale, unavailable_reason)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mooncake netns", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="create nodes and hold them until Ctrl-C / SIGTERM")
    up.add_argument("--nodes", type=int, default=3, help="number of nodes [default: 3]")
    up.add_argument("--link", default="1gbit", type=_link,
                    help="each node's link, each direction: RATE,DELAY, e.g. 1gbit,0.5ms (a delay needs "
                         "the kernel's sch_netem) [default: 1gbit]")
    up.add_argument("--subnet", default=None, help="a private /24 for the nodes [default: a free 10.213.X.0/24]")
    down = sub.add_parser("down", help="remove namespaces whose owner process is gone")
    down.add_argument("--all", action="store_true", help="also those of live owners (another `netns up`)")
    sub.add_parser("list", help="namespaces this tool made, their owner pid and whether it lives")
    return p


def _link(text: str) -> Link:
    try:
        return Link.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def describe(nodes: Nodes) -> str:
    """The banner of ``up``: nodes, addresses, and how to use them."""
    first = nodes[0]
    lines = [f"{len(nodes)} nodes, each link {nodes.link} per direction; this host is "
             f"{nodes.host_address} on the same network ({nodes.host_device}):"]
    lines += [f"  {n.name}  {n.address:<15} ip netns exec {n.netns} COMMAND" for n in nodes]
    lines += ["", "e.g. a conductor on node1, reachable from this host:",
              f"  ip netns exec {first.netns} mooncake --role conductor --host {first.address} --port 8000",
              f"  curl http://{first.address}:8000/health",
              f"cut a node's link: ip -n {first.netns} link set {first.device} down  (up to restore)",
              "Ctrl-C stops everything inside the nodes and deletes them."]
    return "\n".join(lines)


def _up(ns: argparse.Namespace) -> int:
    try:
        with Nodes.create(ns.nodes, ns.link, subnet=ns.subnet) as nodes:
            print(describe(nodes), flush=True)
            try:
                signal.pause()
            except (KeyboardInterrupt, SystemExit):   # Ctrl-C; SIGTERM raises SystemExit while nodes live
                pass
    except NetnsUnavailable as exc:
        sys.stderr.write(f"mooncake netns: {exc}\n")
        return 2
    except (NetnsError, ValueError) as exc:
        sys.stderr.write(f"mooncake netns: error: {exc}\n")
        return 1
    print("nodes removed", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.command == "up":
        return _up(ns)
    reason = unavailable_reason()
    if reason:
        sys.stderr.write(f"mooncake netns: {reason}\n")
        return 2
    if ns.command == "list":
        for name, pid, alive in list_namespaces():
            print(f"{name}  owner {pid} {'running' if alive else 'gone (stale: mooncake netns down)'}")
        return 0
    for name in remove_stale(everything=ns.all):
        print(f"removed {name}")
    return 0
