"""``python -m ficco selftest``: ficco checks itself on the machine it runs on.

The first thing to run on a new machine. Under your launcher (``torchrun --nproc-per-node N
-m ficco selftest``: one GPU per rank) or alone: ``--share-gpu W`` starts W processes on one
GPU, ``--world W`` W processes on the backend ficco picks (the CPU one where there is no GPU).
It checks, each part bounded and each check one line (:mod:`.checks`):

- every schedule the selector can pick, of every op, on both transports, at two shapes (tiny,
  medium), fp32, bf16 and fp8 where the device multiplies it, against float64;
- a peer late inside FICCO_TIMEOUT (exact data), and late past it (an error on every rank,
  never data);
- one CUDA-graph capture and replay (GPUs);
- serial against the selector's pick at ``--shape M,N,K``;
- the environment: versions, driver, bindings, devices, topology, peer access, copy engines,
  signal pads, settings.

It prints one line per check, streams each check as one JSON line to ``--jsonl PATH`` as it is
recorded (the environment's facts first: a run cut short keeps every line before the cut),
writes everything to ``--json PATH`` at the end (a bundle to attach to a bug report), and exits
0 when every check passed, 1 on a failed check, 4 when a call returned wrong numbers (data
where an error or the product was due), 3 when a check hung past its bound or a rank ended
without a result (the run ends at the first such rank rather than wait)::

    python -m ficco selftest --world 2 --quick --json selftest.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from .checks import Options, Row, Runner

#: exit codes
OK, FAILED, USAGE, HUNG, WRONG = 0, 1, 2, 3, 4


def run_rank(rank: int, world: int, options: Options, group=None, emit=print,
             stream: str | None = None) -> dict:
    """Every check on this rank of a live group (``group``: None for the default group);
    returns ``{"environment": ..., "rows": [...]}`` (rank 0's lines go to ``emit``; rank 0
    appends the environment, then each check as it is recorded, as JSON lines to ``stream``)."""
    from . import environment

    def line(obj: dict) -> None:
        with open(stream, "a") as fh:     # type: ignore[arg-type]
            fh.write(json.dumps(obj, default=str) + "\n")

    on_row = (lambda row: line({"row": row})) if stream and rank == 0 else None
    runner = Runner(rank, world, group, options, emit, on_row=on_row)
    started = time.monotonic()
    env = {"rank": environment.local_facts(rank)}
    if rank == 0:
        env.update(environment.global_facts())
        if stream:
            line({"environment": env, "world": world})
        runner.emit(f"ficco {env['ficco']} selftest: {world} rank(s), backend {env['backend']} "
                    f"({env['target']}), torch {env['torch']}, triton {env['triton']}")
    runner.run_schedules()
    env["pads"] = environment.pads_facts(runner.group)
    if options.fault and world > 1:
        runner.run_faults()
    elif options.fault:
        runner.record(Row("fault", "late peers", "skip", detail="one rank: no peer to be late"))
    if options.graph:
        runner.run_graph()
    if options.timing_shape is not None:
        runner.run_timing()
    rows = [row.as_json() for row in runner.rows]
    failed = sum(row["status"] == "FAIL" for row in rows)
    skipped = sum(row["status"] == "skip" for row in rows)
    runner.emit(f"selftest: {len(rows)} checks, {failed} failed, {skipped} skipped in "
                f"{time.monotonic() - started:.1f}s")
    return {"environment": env, "rows": rows}


def bundle(results: list[dict], argv: list[str]) -> dict:
    """The JSON a user attaches to a report: rank 0's checks, every rank's facts."""
    first = results[0]
    return {"command": "python -m ficco selftest " + " ".join(argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "environment": {**first["environment"],
                            "ranks": [r["environment"]["rank"] for r in results]},
            "checks": first["rows"],
            "failed": [row["name"] for row in first["rows"] if row["status"] == "FAIL"]}


def exit_code(results: list[dict]) -> int:
    """WRONG when a call returned wrong numbers on any rank, FAILED on any other failed check,
    else OK."""
    failed = [row for r in results for row in r["rows"] if row["status"] == "FAIL"]
    if any(row.get("wrong") for row in failed):
        return WRONG
    return FAILED if failed else OK


# -- processes --------------------------------------------------------------------------------------
def _launched() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _rank_process(rank, world, init_file, options, share_gpu, out_dir, stream=None):
    """One spawned rank: join the group, run, leave its result in ``out_dir``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if torch.cuda.is_available():
        torch.cuda.set_device(0 if share_gpu else rank % torch.cuda.device_count())
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    result = run_rank(rank, world, options, emit=lambda line: print(line, flush=True),
                      stream=stream)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, default=str))
    _leave()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written and released: leave now (interpreter teardown of the backend's
    # threads and the process group took 10 s more for nothing).
    os._exit(OK)


def _leave() -> None:
    try:
        import torch.distributed as dist

        import ficco

        ficco.shutdown()
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - the result is written already
        print(f"selftest teardown: {type(exc).__name__}: {exc}", file=sys.stderr)


def spawn(world: int, options: Options, share_gpu: bool, bound_s: float,
          stream: str | None = None) -> tuple[list, int]:
    """Run ``world`` rank processes; (their results, exit code). The run ends at the first
    rank that exits without its result (a hang its watch cut short, a crash): the others are
    ended then, and the code is HUNG; so it is when the whole run outlasts ``bound_s``."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ficco-selftest-") as tmp:
        init_file = os.path.join(tmp, "pg")
        procs = [ctx.Process(target=_rank_process, daemon=True,
                             args=(r, world, init_file, options, share_gpu, tmp, stream))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + bound_s
        ended: list[int] = []      # ranks that exited without a result
        while time.monotonic() < deadline and any(p.is_alive() for p in procs):
            ended = [r for r, p in enumerate(procs) if not p.is_alive()
                     and not Path(tmp, f"rank{r}.json").exists()]
            if ended:
                break
            time.sleep(0.1)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        ended = ended or [r for r in range(world) if not Path(tmp, f"rank{r}.json").exists()
                          and r not in hung]
        results = [json.loads(Path(tmp, f"rank{r}.json").read_text())
                   for r in range(world) if Path(tmp, f"rank{r}.json").exists()]
        codes = [p.exitcode for p in procs]
    if ended:
        print(f"HANG selftest: rank(s) {ended} exited without a result (exit codes {codes}); "
              f"the others were ended", flush=True)
        return results, HUNG
    if hung:
        print(f"HANG selftest: rank(s) {hung} did not finish (bound {bound_s:.0f}s)",
              flush=True)
        return results, HUNG
    return results, exit_code(results)


# -- command line -----------------------------------------------------------------------------------
def _shape(text: str) -> tuple[int, int, int]:
    parts = tuple(int(v) for v in text.split(","))
    if len(parts) != 3 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"--shape takes M,N,K (three positive ints); got {text}")
    return parts  # type: ignore[return-value]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ficco selftest",
                                description=__doc__.split("\n\n")[0])
    how = p.add_mutually_exclusive_group()
    how.add_argument("--share-gpu", type=int, metavar="W",
                     help="start W rank processes on one GPU")
    how.add_argument("--world", type=int, metavar="W",
                     help="start W rank processes (one GPU each where there are enough)")
    p.add_argument("--shape", type=_shape, help="M,N,K of the serial-vs-pick timing "
                   "(default 4096,4096,4096 on GPUs, 256,256,256 on CPU)")
    p.add_argument("--json", metavar="PATH", help="write the bundle (every check, environment)")
    p.add_argument("--jsonl", metavar="PATH",
                   help="append the environment, then each check as it is recorded, one JSON "
                        "object a line")
    p.add_argument("--quick", action="store_true",
                   help="tiny shape only, no timing (what CI runs)")
    p.add_argument("--smoke", action="store_true",
                   help="only the default path (the selector's pick) of each op, tiny shape, "
                        "no faults, graph or timing: the first minute of a GPU lease")
    p.add_argument("--optional", action="store_true",
                   help="also the optional schedules that run here (gated-*: not offered to "
                        "selectors until a GPU verified them)")
    p.add_argument("--ops", help="comma-separated ops (default: every op)")
    p.add_argument("--dtypes", default="float32,bfloat16,float8",
                   help="comma-separated dtypes (default %(default)s; float8 where the device "
                        "multiplies it)")
    p.add_argument("--timeout", type=float, default=20.0,
                   help="FICCO_TIMEOUT of the correctness calls (default %(default)s s)")
    p.add_argument("--bound", type=float, default=600.0,
                   help="seconds the whole run may take before its ranks are ended; one check "
                        "may take 3 x --timeout + 60 s, and never more than --bound - 5 s")
    return p


def options_of(args, gpu: bool) -> Options:
    timing = args.shape or (None if args.quick or args.smoke else
                            ((4096, 4096, 4096) if gpu else (256, 256, 256)))
    return Options(shapes=("tiny",) if args.quick or args.smoke else ("tiny", "medium"),
                   ops=tuple(args.ops.split(",")) if args.ops else (),
                   dtypes=tuple(args.dtypes.split(",")),
                   optional=args.optional, timing_shape=timing, timeout_s=args.timeout,
                   fault_timeout_s=1.0 if args.quick else 2.0, smoke=args.smoke,
                   fault=not args.smoke, graph=not args.smoke,
                   bound_s=max(1.0, min(3 * args.timeout + 60, args.bound - 5)))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    options = options_of(args, gpu)
    if _launched() and not (args.world or args.share_gpu):
        import torch.distributed as dist

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        if gpu:
            torch.cuda.set_device(local % torch.cuda.device_count())
        if not dist.is_initialized():
            own_gpu = gpu and int(os.environ.get("LOCAL_WORLD_SIZE", world)) <= \
                torch.cuda.device_count()
            dist.init_process_group("nccl" if own_gpu else "gloo")
        results = [run_rank(rank, world, options, stream=args.jsonl)]
        code = exit_code(results)
        if rank == 0 and args.json:
            Path(args.json).write_text(json.dumps(bundle(results, argv), indent=1, default=str))
        _leave()
        return code
    world = args.share_gpu or args.world or 2
    if world < 1:
        print("selftest: the world size must be at least 1", file=sys.stderr)
        return USAGE
    results, code = spawn(world, options, share_gpu=bool(args.share_gpu) or
                          (gpu and torch.cuda.device_count() < world), bound_s=args.bound,
                          stream=args.jsonl)
    if args.json and results:
        Path(args.json).write_text(json.dumps(bundle(results, argv), indent=1, default=str))
    return code


__all__ = ["FAILED", "HUNG", "OK", "WRONG", "Options", "main", "run_rank"]
