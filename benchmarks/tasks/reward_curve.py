"""Mean score over the first and last fifth of a run, from its torchtune DiskLogger file.

    python benchmarks/tasks/reward_curve.py /tmp/torchtune-ppo/tiny_sentiment/logs
"""

import sys

from torchtune_ppo.run.logs import read_disk_log


def main(log_dir: str) -> None:
    rows = read_disk_log(log_dir)
    scores = [r["scores"] for r in rows]
    k = max(1, len(scores) // 5)
    steps = sorted(r["time/step"] for r in rows[1:]) or [rows[0]["time/step"]]
    print(f"steps: {len(scores)}")
    print(f"mean score, first fifth (steps 1-{k}): {sum(scores[:k]) / k:.3f}")
    print(f"mean score, last fifth (steps {len(scores) - k + 1}-{len(scores)}): {sum(scores[-k:]) / k:.3f}")
    print(f"median step time after the first: {steps[len(steps) // 2]:.3f} s")
    print(f"recompiles after the first step: {int(rows[-1]['recompiles'])}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/torchtune-ppo/tiny_sentiment/logs")
