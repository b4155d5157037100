"""`serve --replicas N [--ray-address ADDR]`: the options and their checks, free of Ray (imported by the CLI for
every `serve`; Ray itself is imported only when replicas are asked for, by replicas.py)."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass

from nextoken.errors import NextokenError


@dataclass(frozen=True)
class ReplicaOptions:
    """How many replicas, on which Ray (None: a local instance on 127.0.0.1), with how many threads each."""

    num_replicas: int = 1
    ray_address: str | None = None
    threads: int | None = None  # per replica; None: this machine's cores shared equally

    def threads_per_replica(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // self.num_replicas)

    def check(self) -> None:
        if self.num_replicas < 1:
            raise NextokenError(f"invalid --replicas {self.num_replicas}: must be at least 1")
        cores = os.cpu_count() or 1
        needed = self.num_replicas * self.threads_per_replica()
        if self.ray_address is None and needed > cores:
            raise NextokenError(f"--replicas {self.num_replicas} x --threads {self.threads_per_replica()} needs "
                                f"{needed} cores; this machine has {cores}")
        if self.ray_address is not None:
            check_reachable(self.ray_address)


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """A cluster address of the form [ray://]HOST:PORT must have something listening there: Ray itself retries a
    dead address for minutes before it gives up. ('auto' and other forms are left to Ray.)"""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise NextokenError(f"could not join the Ray cluster at --ray-address {address!r}: nothing answers there "
                            f"({reason}); is the cluster's head node running?") from None


def add_replicas(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="run N engine replicas on Ray Serve behind this server, each with its share of the cores "
                        "(--threads: per replica); needs `pip install nextoken[ray]`")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --replicas: join this Ray cluster (e.g. 10.0.0.5:6379, or 'auto') instead of starting "
                        "a local Ray instance on 127.0.0.1")


def replica_options(args: argparse.Namespace) -> ReplicaOptions | None:
    """None (one engine in this process) unless --replicas or --ray-address is given."""
    if args.replicas is None and args.ray_address is None:
        return None
    options = ReplicaOptions(args.replicas if args.replicas is not None else 1, args.ray_address, args.threads)
    options.check()
    return options
