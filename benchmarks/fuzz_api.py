"""A long schemathesis campaign against a real server: rounds over every route (valid and invalid bodies) and
link-driven sequences, each round with a new seed, until `--examples` cases or `--minutes` have passed.

Prints the cases tried, the status codes seen, every distinct failure (route, check, the request that caused it)
and the time taken; exits 1 when anything failed. The same checks as tests/server/test_schemathesis.py.

    NEXTOKEN_NATIVE=0 python benchmarks/fuzz_api.py --examples 5000 --minutes 20
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.server.apifuzz import (  # noqa: E402
    CHECKS, ROUTES, aim_at_model, cases, load_schema, start_server, state_machine)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=5000, help="stop after this many cases (all routes)")
    parser.add_argument("--minutes", type=float, default=30.0, help="stop after this long")
    parser.add_argument("--per-round", type=int, default=100, help="cases per route in one round")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(Path(tmp), Path(tmp))
        try:
            return campaign(server, args.examples, args.minutes * 60, args.per_round)
        finally:
            server.stop()
            log = Path(tmp).glob("server-*.log")
            errors = [line for path in log for line in path.read_text().splitlines() if "unhandled" in line]
            for line in errors[:20]:
                print("server log:", line)


def campaign(server: Any, max_cases: int, budget_s: float, per_round: int) -> int:
    schema = load_schema(server)
    start = time.monotonic()
    statuses: collections.Counter[tuple[str, int]] = collections.Counter()
    failures: dict[str, str] = {}
    num_cases, round_idx = 0, 0
    machine = state_machine(schema, server.model)

    def record(route: str, run: Any) -> None:
        try:
            run()
        except Exception as exc:  # a failing case, shrunk by hypothesis: record it, go on with the next route
            key = f"{route}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if key not in failures:
                failures[key] = str(exc)[:3000]
                print(f"FAILURE after {num_cases} cases: {key}", flush=True)

    while num_cases < max_cases and time.monotonic() - start < budget_s:
        for route in ROUTES:
            if num_cases >= max_cases or time.monotonic() - start > budget_s:
                break

            @given(case=cases(schema, route))
            @settings(max_examples=per_round, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            def check(case: Any) -> None:
                nonlocal num_cases
                num_cases += 1
                aim_at_model(case, server.model)
                response = case.call()
                statuses[(route, response.status_code)] += 1
                case.validate_response(response, checks=CHECKS)

            record(route, check)

        class Counted(machine):  # type: ignore[misc, valid-type]
            def before_call(self, case: Any) -> None:
                nonlocal num_cases
                num_cases += 1
                super().before_call(case)

        record("links", lambda: Counted.run(settings=settings(
            max_examples=max(1, per_round // 5), stateful_step_count=8, deadline=None, database=None,
            suppress_health_check=list(HealthCheck))))
        round_idx += 1
        print(f"round {round_idx}: {num_cases} cases, {time.monotonic() - start:.0f} s, "
              f"{len(failures)} distinct failures", flush=True)
    elapsed = time.monotonic() - start
    print(f"\n{num_cases} cases in {elapsed / 60:.1f} min ({num_cases / elapsed:.1f}/s), {len(failures)} failures")
    for (route, status), count in sorted(statuses.items()):
        print(f"  {route:28s} {status}: {count}")
    for key, detail in failures.items():
        print(f"\n--- {key}\n{detail}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
