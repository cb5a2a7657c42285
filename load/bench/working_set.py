"""Working set micro-benchmark (issue 27): what ``cache-spread``'s working set costs one request.

At each fleet size (``--fleets``, 4, 16 and 64 endpoints) a :class:`WorkingSet` (the router's, window
``working_set_s`` 20 s) and an :class:`ApproximateIndex` are filled as ``load.bench.decision`` fills the
gateway's index: ``OTHER_CHAINS_PER_ENDPOINT`` chains of ``OTHER_CHAIN_BLOCKS`` random digests per endpoint
and ``SHARED_CHAINS`` chains on 2-8 endpoints each, all routed within the window. Then, per call, in µs
(each figure the best of ``--repeats`` timings of ``--number`` calls, the operations' rounds interleaved):

* ``sizes``: :meth:`WorkingSet.sizes` (before every decision, on the request path);
* ``pop``: a record of an empty chain, i.e. the pop every record does, with nothing due;
* ``record``: :meth:`WorkingSet.record` of a ``--chain``-block chain (270: a ~4,300-token prompt in
  16-token blocks), its pop included, recorded again on the same endpoint 1 ms later each call (the router
  does this after the answer is out);
* ``index_record``: :meth:`ApproximateIndex.record` of the same chain, beside it, for scale.

``--tree PATH`` measures another source tree's ``extproc`` and ``contracts`` (a worktree of a baseline
commit) with this driver, so a change and its baseline run the same timing code; the JSON names the tree's
commit under ``revision``.

    python -m load.bench.working_set --out results/working_set.json [--tree /path/to/baseline/worktree]
"""

from __future__ import annotations

import argparse
import random
import sys
import timeit
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from load.bench import machine, revision, write_json

FLEETS = (4, 16, 64)
CHAIN_BLOCKS = 270
WINDOW_S = 20.0
SEED = 27


def run_fleet(n_endpoints: int, chain_blocks: int, number: int, repeats: int) -> dict[str, Any]:
    """The four figures (µs per call) at ``n_endpoints``; see the module docstring."""
    # Imported here, after ``--tree`` may have put a baseline tree first on the path.
    from contracts.digest import Digest
    from contracts.events import EndpointId
    from extproc.index.approximate import ApproximateIndex
    from extproc.index.working_set import WorkingSet
    from load.bench.decision import OTHER_CHAIN_BLOCKS, OTHER_CHAINS_PER_ENDPOINT, SHARED_CHAINS

    rng = random.Random(SEED + n_endpoints)
    working_set = WorkingSet(WINDOW_S)
    index = ApproximateIndex()
    ids = [EndpointId(f"e{i}") for i in range(n_endpoints)]
    clock = [1_000.0]

    def chain(blocks: int) -> list[Digest]:
        return [Digest(rng.randbytes(16)) for _ in range(blocks)]

    def fill(endpoint: EndpointId, digests: Sequence[Digest]) -> None:
        clock[0] += 0.0001  # the fill spans well under the window: nothing leaves it while timing
        working_set.record(endpoint, digests, clock[0])
        index.record(endpoint, digests, clock[0])

    for endpoint in ids:
        for _ in range(OTHER_CHAINS_PER_ENDPOINT):
            fill(endpoint, chain(OTHER_CHAIN_BLOCKS))
    for _ in range(SHARED_CHAINS):
        digests = chain(OTHER_CHAIN_BLOCKS)
        for endpoint in rng.sample(ids, min(len(ids), rng.randint(2, 8))):
            fill(endpoint, digests)
    target = ids[n_endpoints // 2]
    prompt = chain(chain_blocks)
    fill(target, prompt)

    def tick() -> float:
        clock[0] += 0.001
        return clock[0]

    operations: dict[str, Callable[[], object]] = {
        "sizes": lambda: working_set.sizes(clock[0]),
        "pop": lambda: working_set.record(target, (), tick()),
        "record": lambda: working_set.record(target, prompt, tick()),
        "index_record": lambda: index.record(target, prompt, tick()),
    }
    before = sum(working_set.sizes(clock[0]).values())
    best = {name: float("inf") for name in operations}
    for _ in range(repeats):
        for name, operation in operations.items():
            seconds = timeit.timeit(operation, number=number)
            best[name] = min(best[name], seconds / number * 1e6)
    return {
        "endpoints": n_endpoints,
        "chain_blocks": chain_blocks,
        "clock_moved_s": round(clock[0] - 1_000.0, 3),
        # Equal: the timed records re-routed blocks already counted, and nothing left the window.
        "blocks_in_window": {"before": before, "after": sum(working_set.sizes(clock[0]).values())},
        "us_per_call": {name: round(us, 3) for name, us in best.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m load.bench.working_set", description=__doc__.split("\n")[0] if __doc__ else None
    )
    parser.add_argument("--out", type=Path, required=True, help="where the JSON result goes")
    parser.add_argument("--fleets", default=",".join(map(str, FLEETS)), help="endpoint counts, comma-joined")
    parser.add_argument("--chain", type=int, default=CHAIN_BLOCKS, help="blocks in the recorded chain")
    parser.add_argument("--number", type=int, default=500, help="calls per timing")
    parser.add_argument("--repeats", type=int, default=5, help="timings per figure (the best is kept)")
    parser.add_argument("--tree", type=Path, help="measure this source tree's extproc (a baseline worktree)")
    args = parser.parse_args(argv)
    fleets = [int(n) for n in args.fleets.split(",")]
    if args.tree is not None:
        tree = args.tree.resolve()
        if not (tree / "extproc" / "index" / "working_set.py").is_file():
            parser.error(f"--tree {tree}: no extproc/index/working_set.py there")
        sys.path.insert(0, str(tree))
    # The clock moves 1 ms a timed call: keep a whole run inside the window, so nothing is ever due.
    calls = 3 * args.number * args.repeats
    if calls * 0.001 >= WINDOW_S / 2:
        parser.error(f"--number x --repeats too large: the run would move the clock {calls * 0.001:.0f} s")
    import extproc

    measured = revision(args.tree.resolve()) if args.tree is not None else revision()
    result: dict[str, Any] = {
        "benchmark": "working_set",
        "command": " ".join(["python -m load.bench.working_set", *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine(),
        "revision": measured,
        "extproc_from": str(Path(extproc.__file__).resolve().parent),
        "driver_revision": revision(),
        "window_s": WINDOW_S,
        "number": args.number,
        "repeats": args.repeats,
        "fleets": [run_fleet(n, args.chain, args.number, args.repeats) for n in fleets],
    }
    write_json(args.out, result)
    for cell in result["fleets"]:
        figures = ", ".join(f"{k} {v:.2f}" for k, v in cell["us_per_call"].items())
        print(f"{cell['endpoints']:>3} endpoints, µs per call: {figures}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
