"""How often a speculative rollout can pick another token than plain decoding: near ties of the
exponential race on SmolLM2-135M-Instruct.

With position-keyed noise, the token at a response position is the race's winner
``argmax(softmax(logits / temperature) / E)`` over that position's logits, whichever forward
computed them. Plain decoding computes them one token at a time against the KV cache; a
verification computes them in a chunk, and the trainer in one forward over the whole sequence.
These forwards sum in other orders, so their logits differ in the last bits, and where a
position's two best race values lie closer than that difference the forwards can pick different
tokens. Measured here, per position of the responses plain decoding samples (eager, so that no
compiler reorders anything):

- ``delta``: the largest difference between the decode's logits (``/ temperature``) and a
  teacher-forced forward's over the same tokens;
- the race's gap at each position: ``log`` of the winner's race value over the runner-up's. A
  change of the scaled logits by at most ``delta`` moves this gap by at most ``2 * delta``, so a
  position with a gap below that is a **near tie** (its token could depend on which forward ran);
- **flips**: positions whose winner under the teacher-forced forward's logits is another token.

    python benchmarks/generation/near_ties.py                          # long answers, 128 tokens, 4 rounds
    python benchmarks/generation/near_ties.py --workload arithmetic -T 12 --rounds 16

Prints one JSON object (and writes it to ``--out``). Prepare the model first
(``python tools/prepare_smollm2.py``).
"""

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # bench_common
from bench_common.machine import machine_info  # noqa: E402
from bench_speculative import load  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=["long", "arithmetic"], default="long")
    p.add_argument("-T", "--max-generated-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4, help="noise rounds (the batch's prompts sampled once each)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--scratch", default="/tmp/near_ties", help="the checkpointer's output_dir (unused)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]

    from torchtune_ppo.rlhf import masks_and_positions
    from torchtune_ppo.rollout.generation import Generator
    from torchtune_ppo.rollout.speculative import keyed_noise, row_keys

    model, prompts, lens, stops, tokenizer = load(args)
    P, T, B = prompts.shape[1], args.max_generated_tokens, args.batch
    gen = Generator(model, batch_size=B, max_prompt_len=P, max_generated_tokens=T, pad_id=tokenizer.pad_id,
                    stop_token_ids=stops, temperature=args.temperature)
    scratch = torch.Generator()
    positions = gaps_below = flips = 0
    delta_max, gaps = 0.0, []
    for rnd in range(args.rounds):
        keys, _ = row_keys(prompts, lens, seed=0, round=rnd)
        with torch.no_grad():
            out = gen.generate(prompts, lens, noise_keys=keys, return_logits=True)
            decode = out.logits.float() / args.temperature  # [B, T, V]
            qr = out.query_responses
            masks, pos = masks_and_positions(lens, P, T)
            full = model(qr, mask=masks, input_pos=pos)[:, P - 1:-1].float() / args.temperature
        responses = qr[:, P:]
        stop = torch.isin(responses, torch.tensor(stops))
        valid = (stop.cumsum(-1) - stop.long()) == 0  # up to and including the first stop token
        delta_max = max(delta_max, (decode - full).abs().amax(-1)[valid].max().item())
        for b in range(B):
            n = int(valid[b].sum())
            noise = keyed_noise(torch.empty(1, n, decode.shape[-1]), [keys[b]], [list(range(n))], scratch)[0]
            for logits, kind in ((decode[b, :n], "decode"), (full[b, :n], "full")):
                race = torch.log_softmax(logits, -1) - noise.log()  # log of p / E
                top2 = race.topk(2, dim=-1)
                if kind == "decode":
                    assert torch.equal(top2.indices[:, 0], responses[b, :n]), "the decode's winner is not the sample"
                    gaps.append(top2.values[:, 0] - top2.values[:, 1])
                else:
                    flips += int((top2.indices[:, 0] != responses[b, :n]).sum())
            positions += n
    gap = torch.cat(gaps)
    gaps_below = int((gap < 2 * delta_max).sum())
    result = {
        "workload": args.workload, "T": T, "batch": B, "rounds": args.rounds, "temperature": args.temperature,
        "dtype": str(args.dtype).removeprefix("torch."), "positions": positions, "delta_max": delta_max,
        "near_ties": gaps_below, "near_tie_share": gaps_below / positions, "flips": flips,
        "smallest_gap": gap.min().item(), "gaps_below_1e-3": int((gap < 1e-3).sum()),
        "machine": machine_info(HERE.parents[1], torch.get_num_threads()),
    }
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
