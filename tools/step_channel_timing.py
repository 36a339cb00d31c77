"""Rank 0's time in `StepChannel.send` per decode step: two gloo processes on this host, rank 0
sending N decode steps of C sequences (with a spin of --gap-us between sends, standing in for
the step's own work), rank 1 receiving them. Prints the mean and median send time.

    python tools/step_channel_timing.py [--steps 2000] [--concurrency 1,8] [--gap-us 300]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ninfer.engine.runner import StepInputs
from ninfer.parallel.channel import StepChannel


def decode_step(seqs: int) -> StepInputs:
    return StepInputs(
        input_ids=[5] * seqs,
        positions=[100] * seqs,
        context_lens=[100] * seqs,
        query_lens=[1] * seqs,
        page_lists=[[1, 2]] * seqs,
        state_slots=list(range(seqs)),
        logit_rows=list(range(seqs)),
    )


def rank_main(rank: int, port: int, seqs: int, steps: int, gap_s: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    channel = StepChannel(dist.new_group([0, 1], backend="gloo"))
    if rank == 0:
        step, times = decode_step(seqs), []
        for _ in range(steps):
            start = time.perf_counter()
            channel.send(step, [])
            times.append(time.perf_counter() - start)
            spin = time.perf_counter()
            while time.perf_counter() - spin < gap_s:
                pass
        channel.send_stop()
        print(
            f"C={seqs}: send mean {1e6 * statistics.fmean(times):.1f} us, "
            f"median {1e6 * statistics.median(times):.1f} us over {steps} steps"
        )
    else:
        while channel.receive() is not None:
            pass
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--gap-us", type=float, default=300.0)
    args = parser.parse_args()
    for seqs in (int(c) for c in args.concurrency.split(",")):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(
            rank_main,
            args=(port, seqs, args.steps, args.gap_us * 1e-6),
            nprocs=2,
            start_method="spawn",
        )


if __name__ == "__main__":
    main()
